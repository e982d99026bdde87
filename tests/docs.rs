//! The README's fail-safe table promises, row by row, what happens to DNS on a failure and names
//! the tests that prove it. This keeps every row backed: each names at least one test, and
//! every test it names exists and runs (a renamed, deleted or `#[ignore]`d test fails here, not
//! silently in the docs).

#![forbid(unsafe_code)]

use std::path::Path;

/// The rows of the table under the "fail-safe policy" heading: (failure, cited test names).
fn fail_safe_rows(readme: &str) -> Vec<(String, Vec<String>)> {
    let section = readme
        .split("\n## ")
        .find(|s| s.starts_with("What happens when") && s.contains("fail-safe"))
        .expect("README has a fail-safe section");
    let mut rows = Vec::new();
    for line in section.lines().filter(|l| l.starts_with('|')) {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        if cells.first().is_some_and(|c| *c == "failure" || c.starts_with("---")) {
            continue;
        }
        let proof = cells.last().copied().unwrap_or_default();
        let mut names = Vec::new();
        let mut base = String::new();
        for (i, part) in proof.split('`').enumerate() {
            // Odd parts are inside backticks; `_suffix` names a variant of the previous test.
            if i % 2 == 1 {
                let name = match part.strip_prefix('_') {
                    Some(_) if !base.is_empty() => format!("{base}{part}"),
                    _ => {
                        base = part.to_owned();
                        part.to_owned()
                    }
                };
                names.push(name);
            }
        }
        rows.push((cells[0].to_owned(), names));
    }
    rows
}

/// Every test that runs (`#[test]`, not `#[ignore]`d) among the `.rs` files under `tests/`.
fn test_names(root: &Path) -> Vec<String> {
    let mut names = Vec::new();
    for entry in std::fs::read_dir(root.join("tests")).expect("tests/") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        names.extend(tests_in(&std::fs::read_to_string(&path).expect("read test file")));
    }
    names
}

/// The tests of one file that run: `fn`s under a `#[test]` attribute and no `#[ignore]`, in
/// whatever order the attributes come. An ignored test proves nothing, so a row citing it fails.
fn tests_in(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    // The attributes above the next item.
    let (mut test, mut ignored) = (false, false);
    // Inside a top-level macro call (`guest_tests! { fn name() { … } }`), every `fn` is a test
    // the macro makes.
    let mut in_macro = false;
    for line in text.lines() {
        let trimmed = line.trim();
        if !line.starts_with(' ') && line.ends_with("! {") {
            in_macro = true;
        } else if line == "}" {
            in_macro = false;
        }
        if trimmed.starts_with("#[") {
            test |= trimmed == "#[test]";
            ignored |= trimmed.starts_with("#[ignore");
            continue;
        }
        if let Some(name) = trimmed.strip_prefix("fn ").and_then(|f| f.split('(').next()) {
            if (test || in_macro) && !ignored {
                names.push(name.to_owned());
            }
        }
        (test, ignored) = (false, false);
    }
    names
}

#[test]
fn every_fail_safe_row_is_backed_by_tests_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let rows = fail_safe_rows(&readme);
    let tests = test_names(root);
    assert!(rows.len() >= 9, "the table has {} rows", rows.len());
    for (failure, cited) in &rows {
        assert!(!cited.is_empty(), "row {failure:?} names no test");
        for name in cited {
            assert!(tests.contains(name), "row {failure:?} cites `{name}`, which is no test that runs (missing or #[ignore]d)");
        }
    }
    // The failures the policy must cover (issue 6), each in some row.
    for failure in [
        "cache crashes",
        "cache hangs",
        "SERVFAIL",
        "CoreDNS down",
        "both down",
        "agent crashes",
        "SIGTERM",
        "teardown",
        "flushes",
        "xtables lock",
    ] {
        assert!(rows.iter().any(|(f, _)| f.contains(failure)), "no row for {failure:?}");
    }
}

#[test]
fn the_row_parser_reads_names_and_variants() {
    let readme =
        "# x\n\n## What happens when … (fail-safe policy)\n\n| failure | a | proven by |\n\
                  |---|---|---|\n| crash | lost | `one_test` (`_v2`), `other` |\n\n## Next\n";
    let rows = fail_safe_rows(readme);
    assert_eq!(
        rows,
        vec![("crash".to_owned(), vec!["one_test".into(), "one_test_v2".into(), "other".into()])]
    );
}

#[test]
fn ignored_tests_do_not_count() {
    let text = "#[test]\nfn runs() {}\n\n#[test]\n#[ignore]\nfn ignored_after() {}\n\n\
                #[ignore = \"slow\"]\n#[test]\nfn ignored_before() {}\n\n#[test]\n\
                #[should_panic]\nfn panics() {}\n\nfn helper() {}\n\nguest_tests! {\n    \
                fn in_macro() { cell() }\n    #[ignore]\n    fn ignored_in_macro() { cell() }\n}\n";
    assert_eq!(tests_in(text), ["runs", "panics", "in_macro"]);
}

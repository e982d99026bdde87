//! The fail-safe tables (the README's, short, and docs/failsafe.md's, every row) promise, row by
//! row, what happens to DNS on a failure and name the tests that prove it. This keeps every row
//! backed: each names at least one test, and every test it names exists and runs (a renamed,
//! deleted or `#[ignore]`d test fails here, not silently in the docs). The README's list of
//! metrics, and of the transition hook's results, is what `/metrics` serves.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The rows of the table under the "fail-safe policy" heading: (failure, cited test names).
fn fail_safe_rows(readme: &str) -> Vec<(String, Vec<String>)> {
    let section = readme
        .split("\n## ")
        .find(|s| s.starts_with("What happens when") && s.contains("fail-safe"))
        .expect("a fail-safe section");
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

/// Every test that runs (`#[test]`, not `#[ignore]`d) among the `.rs` files under `tests/`,
/// `src/` and the workspace's other crates.
fn test_names(root: &Path) -> Vec<String> {
    let mut names = Vec::new();
    for dir in ["tests", "src", "crates"] {
        for path in rust_files(&root.join(dir)) {
            names.extend(tests_in(&std::fs::read_to_string(&path).expect("read test file")));
        }
    }
    names
}

/// The `.rs` files under `dir`, at any depth (the unit and kernel tests live beside the code).
fn rust_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).expect("a directory") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files
}

/// The tests of one file that run: `fn`s under a `#[test]` attribute (or `#[tokio::test]`, a
/// loop test's) and no `#[ignore]`, in whatever order the attributes come, and the cases of a
/// file that is its own harness. An ignored test
/// proves nothing, so a row citing it fails.
fn tests_in(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    // The attributes above the next item.
    let (mut test, mut ignored) = (false, false);
    // Inside a top-level macro call (`guest_tests! { fn name() { … } }`), every `fn` is a test
    // the macro makes.
    let mut in_macro = false;
    let mut previous = "";
    for line in text.lines() {
        let trimmed = line.trim();
        if !line.starts_with(' ') && line.ends_with("! {") {
            in_macro = true;
        } else if line == "}" {
            in_macro = false;
        }
        if trimmed.starts_with("#[") {
            test |= trimmed == "#[test]" || trimmed.starts_with("#[tokio::test");
            ignored |= trimmed.starts_with("#[ignore");
            continue;
        }
        let item = trimmed.strip_prefix("async ").unwrap_or(trimmed);
        if let Some(name) = item.strip_prefix("fn ").and_then(|f| f.split('(').next()) {
            if (test || in_macro) && !ignored {
                names.push(name.to_owned());
            }
        }
        // A table of cells in a macro call (`name: "kube-proxy", "backend", V4;`): one test each.
        if in_macro && trimmed.ends_with(';') {
            if let Some((name, _)) = trimmed.split_once(": ") {
                if name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_') {
                    names.push(name.to_owned());
                }
            }
        }
        (test, ignored) = (false, false);
        // A harness of its own (`harness = false`, the real node): its table of cases,
        // `("name", name),` on one line, or its two halves on lines of their own.
        let case = trimmed.strip_prefix("(\"").and_then(|t| t.split_once("\", "));
        if let Some((quoted, rest)) = case {
            if rest.trim_end_matches("),") == quoted {
                names.push(quoted.to_owned());
            }
        }
        if let Some(quoted) = previous.strip_prefix('"').and_then(|p| p.strip_suffix("\",")) {
            if trimmed.strip_suffix(',') == Some(quoted) {
                names.push(quoted.to_owned());
            }
        }
        previous = trimmed;
    }
    names
}

#[test]
fn every_fail_safe_row_is_backed_by_tests_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tests = test_names(root);
    for file in ["README.md", "docs/failsafe.md"] {
        let text = std::fs::read_to_string(root.join(file)).expect(file);
        let rows = fail_safe_rows(&text);
        every_row_is_backed(file, &rows, &tests);
    }
}

/// Each row of `file`'s table names tests that run, and the failures the policy must cover
/// each have a row.
fn every_row_is_backed(file: &str, rows: &[(String, Vec<String>)], tests: &[String]) {
    assert!(rows.len() >= 9, "{file}: the table has {} rows", rows.len());
    for (failure, cited) in rows {
        assert!(!cited.is_empty(), "{file}: row {failure:?} names no test");
        for name in cited {
            assert!(tests.contains(name), "{file}: row {failure:?} cites `{name}`, which is no test that runs (missing or #[ignore]d)");
        }
    }
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
        assert!(rows.iter().any(|(f, _)| f.contains(failure)), "{file}: no row for {failure:?}");
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
    // A macro's table of cells names a test per line; a `let` in a test body names none.
    let cells = "matrix! {\n    legacy_auto_v4: \"iptables-legacy\", \"auto\", V4;\n}\n\
                 #[test]\nfn t() {\n    let x: u8 = 1;\n}\n";
    assert_eq!(tests_in(cells), ["legacy_auto_v4", "t"]);
}

#[test]
fn ignored_tests_do_not_count() {
    let text = "#[test]\nfn runs() {}\n\n#[test]\n#[ignore]\nfn ignored_after() {}\n\n\
                #[ignore = \"slow\"]\n#[test]\nfn ignored_before() {}\n\n#[test]\n\
                #[should_panic]\nfn panics() {}\n\nfn helper() {}\n\nguest_tests! {\n    \
                fn in_macro() { cell() }\n    #[ignore]\n    fn ignored_in_macro() { cell() }\n}\n";
    assert_eq!(tests_in(text), ["runs", "panics", "in_macro"]);
}

/// The README's bullet that starts with `**title**`, up to the next bullet or heading.
fn bullet<'a>(readme: &'a str, title: &str) -> &'a str {
    let start = readme.find(&format!("* **{title}**")).unwrap_or_else(|| panic!("no {title:?}"));
    let rest = &readme[start + 2..];
    let end = ["\n* ", "\n#"].iter().filter_map(|e| rest.find(e)).min().unwrap_or(rest.len());
    &rest[..end]
}

/// What is between backticks in `text`.
fn quoted(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// Metric names and their labels as the README lists them: `nodelocaldns_ha_route{route}`,
/// then `_probes_total{…}` and the like, short for `nodelocaldns_ha_probes_total{…}`.
fn readme_metrics(readme: &str) -> BTreeMap<String, BTreeSet<String>> {
    let text = bullet(readme, "Metrics and health");
    let list = &text[..text.find("`/healthz`").expect("the list ends before /healthz")];
    let mut metrics = BTreeMap::new();
    let names = quoted(list)
        .into_iter()
        .filter(|q| q.starts_with("nodelocaldns_ha_") || q.starts_with('_'));
    for item in names {
        let (name, labels) = item.split_once('{').unwrap_or((item, "}"));
        let name =
            if name.starts_with('_') { format!("nodelocaldns_ha{name}") } else { name.to_owned() };
        let labels = labels.strip_suffix('}').expect("labels end with }");
        let labels = labels.split(',').filter(|l| !l.is_empty()).map(str::to_owned).collect();
        assert!(metrics.insert(name, labels).is_none(), "{item} listed twice");
    }
    metrics
}

/// What `text`, a scrape, serves as the README names it: each family (a counter with `_total`)
/// and the labels of its series, `le` aside.
fn served_metrics(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut metrics = BTreeMap::new();
    for line in text.lines().filter_map(|l| l.strip_prefix("# TYPE ")) {
        let (family, kind) = line.split_once(' ').expect("# TYPE name kind");
        let name = if kind == "counter" { format!("{family}_total") } else { family.to_owned() };
        let mut labels = BTreeSet::new();
        for sample in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((series, _)) = sample.split_once('{') else { continue };
            let own = series == name
                || series
                    .strip_prefix(family)
                    .is_some_and(|s| ["_bucket", "_sum", "_count"].contains(&s));
            if own {
                let inside = &sample[sample.find('{').unwrap() + 1..sample.rfind('}').unwrap()];
                for pair in inside.split(',') {
                    let label = pair.split_once('=').expect("label=value").0;
                    if label != "le" {
                        labels.insert(label.to_owned());
                    }
                }
            }
        }
        metrics.insert(name, labels);
    }
    metrics
}

#[test]
fn the_readme_lists_every_metric_served_with_its_labels() {
    use nodelocaldns_ha::metrics::Metrics;
    use nodelocaldns_ha::ruleset::Route;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let metrics = Metrics::new();
    // Route changes have no series before the first one; the forwarder's, none before the
    // agent binds one (the link-local failover is on by default).
    metrics.transition(Route::Local, Route::Upstream, "cache_refused");
    metrics.set_forwarders(vec![std::sync::Arc::default()]);
    let text = metrics.encode();
    assert_eq!(
        readme_metrics(&readme),
        served_metrics(&text),
        "the README (left), /metrics (right)"
    );

    // The hook's results, each a series from the start.
    let hook = bullet(&readme, "Transition hook");
    let results = &hook[hook.find("results").expect("the hook's results")..];
    let results = &results[..results.find(')').expect("listed in parentheses")];
    let promised: BTreeSet<&str> = quoted(results).into_iter().collect();
    let served: BTreeSet<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("nodelocaldns_ha_transition_hook_runs_total{result=\""))
        .map(|rest| &rest[..rest.find('"').unwrap()])
        .collect();
    assert_eq!(promised, served, "the hook results the README names (left), served (right)");
}

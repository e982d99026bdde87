//! The layout keeps its promises (docs/design.md, *Layout*): the library's modules import each
//! other one way only, and no source file grows past [`MAX_LINES`] unless its opening comment says
//! why.
//!
//! A module's imports are the `crate::<module>` paths in its files' code (comments and the unit
//! tests' files left out: a test may reach anywhere).

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The most lines a file of `src/` has without a word on why.
const MAX_LINES: usize = 600;

/// What a file past [`MAX_LINES`] says in its opening comment.
const WHY: &str = "past 600 lines";

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file of the library belongs to; `None` for the crate root, the
/// binary, unit tests' files and the test-only helpers.
fn module_of(file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src()).unwrap();
    let first = rel.components().next()?.as_os_str().to_str()?.trim_end_matches(".rs").to_owned();
    let skip = ["lib", "bin", "fuzzing", "testutil"];
    (!skip.contains(&first.as_str()) && !file.ends_with("tests.rs")).then_some(first)
}

/// The modules `code` names as `crate::<module>`, comments left out.
fn imports(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
        let line = line.split(" //").next().unwrap_or(line);
        let mut rest = line;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            let (names, tail) = match rest.strip_prefix('{') {
                Some(group) => group.split_once('}').unwrap_or((group, "")),
                None => (rest, ""),
            };
            for name in names.split(',') {
                let module: String = name
                    .trim()
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
                    .collect();
                if !module.is_empty() {
                    found.insert(module);
                }
            }
            if !tail.is_empty() {
                rest = tail;
            }
        }
    }
    found
}

/// The library's module graph: each top-level module and the others it imports.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let Some(module) = module_of(file) else { continue };
        let uses = imports(&std::fs::read_to_string(file).unwrap());
        graph.entry(module.clone()).or_default().extend(uses.into_iter().filter(|m| *m != module));
    }
    let known: BTreeSet<String> = graph.keys().cloned().collect();
    for uses in graph.values_mut() {
        uses.retain(|m| known.contains(m));
    }
    graph
}

/// A path `from` → … → `to` in `graph`, if there is one.
fn path(graph: &BTreeMap<String, BTreeSet<String>>, from: &str, to: &str) -> Option<Vec<String>> {
    let mut seen = BTreeSet::new();
    let mut stack = vec![vec![from.to_owned()]];
    while let Some(trail) = stack.pop() {
        let last = trail.last().unwrap();
        if last == to && trail.len() > 1 {
            return Some(trail);
        }
        if !seen.insert(last.clone()) {
            continue;
        }
        for next in graph.get(last).into_iter().flatten() {
            let mut longer = trail.clone();
            longer.push(next.clone());
            stack.push(longer);
        }
    }
    None
}

fn circles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    graph.keys().filter_map(|m| path(graph, m, m)).map(|trail| trail.join(" -> ")).collect()
}

#[test]
fn no_module_imports_one_that_imports_it_back() {
    let graph = graph();
    assert!(graph.contains_key("daemon") && graph.contains_key("agent"), "{graph:?}");
    assert!(graph["daemon"].contains("agent"), "the daemon runs the agent: {graph:?}");
    let found = circles(&graph);
    assert!(found.is_empty(), "import circles between modules:\n{}", found.join("\n"));
}

#[test]
fn no_source_file_past_the_limit_without_saying_why() {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let long: Vec<String> = files
        .iter()
        .filter_map(|file| {
            let text = std::fs::read_to_string(file).unwrap();
            let opening: String =
                text.lines().take_while(|l| l.starts_with("//!")).collect::<Vec<_>>().join(" ");
            let lines = text.lines().count();
            (lines > MAX_LINES && !opening.contains(WHY))
                .then(|| format!("{} ({lines} lines)", file.display()))
        })
        .collect();
    assert!(
        long.is_empty(),
        "files past {MAX_LINES} lines, their opening comment silent:\n{}",
        long.join("\n")
    );
}

#[test]
fn the_checks_see_what_they_look_for() {
    let code = "use crate::{agent::Agent, probe};\n// crate::daemon\nlet x = crate::health::f(); // crate::hooks\n";
    let found: Vec<String> = imports(code).into_iter().collect();
    assert_eq!(found, ["agent", "health", "probe"]);
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("a".to_owned(), BTreeSet::from(["b".to_owned()])),
        ("b".to_owned(), BTreeSet::from(["c".to_owned()])),
        ("c".to_owned(), BTreeSet::from(["a".to_owned()])),
        ("d".to_owned(), BTreeSet::from(["a".to_owned()])),
    ]
    .into();
    assert_eq!(circles(&graph), ["a -> b -> c -> a", "b -> c -> a -> b", "c -> a -> b -> c"]);
}

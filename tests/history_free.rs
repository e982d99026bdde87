//! What an operator or a maintainer reads says what is true now. README.md and every file under
//! docs/, manifests/, charts/, src/ and crates/ name no issue of the project's tracker, no
//! development session or earlier run, and no path outside the repository: history belongs in
//! CHANGELOG.md (not scanned), and a reference the reader cannot open is no reference. Figures name
//! the one benchmark run they come from, so the only dates allowed are those the benchmark's own
//! reports carry on their first line (docs/bench.md, docs/bench-quiet-pace.md,
//! docs/bench-real-node.md, docs/soak.md, docs/webhook-bench.md).
//!
//! Upstream references (`kubernetes/dns#310`, a GitHub URL) are public and stay allowed. Every
//! finding names its file and line.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The files scanned: README.md and every text file under the user-facing trees, build output
/// (`target/`) left out.
fn scanned() -> Vec<PathBuf> {
    let mut files = vec![repo().join("README.md")];
    for dir in ["docs", "manifests", "charts", "src", "crates"] {
        walk(&repo().join(dir), &mut files);
    }
    files
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("a directory") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n == "target" || n == ".git") {
                continue;
            }
            walk(&path, out);
        } else {
            out.push(path);
        }
    }
}

/// The dates of the benchmark runs the docs' figures come from: the first line of each report.
fn run_dates() -> Vec<String> {
    let mut dates = Vec::new();
    for report in [
        "docs/bench.md",
        "docs/bench-quiet-pace.md",
        "docs/bench-real-node.md",
        "docs/soak.md",
        "docs/webhook-bench.md",
    ] {
        let text = std::fs::read_to_string(repo().join(report)).expect("a benchmark report");
        dates.extend(dates_in(text.lines().next().unwrap_or("")).into_iter().map(|(_, d)| d));
    }
    assert!(!dates.is_empty(), "the benchmark reports name no run date on their first line");
    dates
}

/// Every `YYYY-MM-DD` in a line, with its byte offset.
fn dates_in(line: &str) -> Vec<(usize, String)> {
    let b = line.as_bytes();
    let digit = |i: usize| b.get(i).is_some_and(u8::is_ascii_digit);
    let mut found = Vec::new();
    for i in 0..b.len().saturating_sub(9) {
        let shape = (0..10).all(|k| if k == 4 || k == 7 { b[i + k] == b'-' } else { digit(i + k) });
        let bounded = (i == 0 || !b[i - 1].is_ascii_alphanumeric()) && !digit(i + 10);
        if shape && bounded {
            found.push((i, line[i..i + 10].to_owned()));
        }
    }
    found
}

/// Does `word` (lower case) occur in `lower`, followed by optional `#` and then a digit?
fn numbered(lower: &str, word: &str) -> bool {
    lower.match_indices(word).any(|(i, _)| {
        let before = lower[..i].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric()) {
            return false;
        }
        let rest = lower[i + word.len()..].trim_start_matches('#');
        rest.starts_with(|c: char| c.is_ascii_digit())
    })
}

/// What one line says that it should not, if anything.
fn finding(line: &str, run_dates: &[String]) -> Option<String> {
    let lower = line.to_lowercase();
    for word in ["issue ", "issues ", "acceptance ", "defect "] {
        if numbered(&lower, word) {
            return Some(format!("names a tracker item (`{}…`)", word.trim()));
        }
    }
    // `(#31)`: a tracker item by number; `owner/repo#31` upstream has no parenthesis before `#`.
    if lower
        .match_indices("(#")
        .any(|(i, _)| lower[i + 2..].starts_with(|c: char| c.is_ascii_digit()))
    {
        return Some("names a tracker item (`(#N)`)".into());
    }
    for path in ["../shared", "/work/", "wt-research"] {
        if lower.contains(path) {
            return Some(format!("names a path outside the repository (`{path}`)"));
        }
    }
    for diary in [
        "this session",
        "that session",
        "earlier session",
        "session's",
        "session of",
        "earlier run",
        "previous run",
        "run of 20",
        "runs of 20",
        "measured on the vm of",
    ] {
        if lower.contains(diary) {
            return Some(format!("tells the development's history (`{diary}`)"));
        }
    }
    for (_, date) in dates_in(line) {
        if !run_dates.contains(&date) {
            return Some(format!(
                "dates something ({date}) other than the benchmark run the figures come from \
                 ({run_dates:?})"
            ));
        }
    }
    None
}

#[test]
fn user_facing_files_name_no_issue_run_or_outside_path() {
    let dates = run_dates();
    let mut findings = Vec::new();
    let files = scanned();
    for file in &files {
        // Binary files (none today) say nothing a reader reads as prose.
        let Ok(text) = std::fs::read_to_string(file) else { continue };
        for (n, line) in text.lines().enumerate() {
            if let Some(what) = finding(line, &dates) {
                let rel = file.strip_prefix(repo()).unwrap_or(file);
                findings.push(format!("{}:{}: {what}", rel.display(), n + 1));
            }
        }
    }
    assert!(files.len() > 100, "scanned {} files: the walk lost them", files.len());
    assert!(
        findings.is_empty(),
        "{} lines tell history or point outside the repository (CHANGELOG.md keeps history):\n{}",
        findings.len(),
        findings.join("\n")
    );
}

#[test]
fn the_checks_see_what_they_look_for() {
    let dates = vec!["2026-11-29".to_owned()];
    for bad in [
        "the forwarder (issue 12; docs/design/link-local.md)",
        "// Issue 30, acceptance 5: one pod sends",
        "Issue #7 asks",
        "as acceptance 4 asks",
        "room (defect 7)",
        "fixed (#31)",
        "kubelet's rules (`../shared/REFERENCE.md` §10)",
        "scripts in /work/wt-research12",
        "an earlier session's VM gave up to 6 mCPU",
        "in the run of 2026-11-27: within the spread",
        "measured 2026-11-26: 500/s",
    ] {
        assert!(finding(bad, &dates).is_some(), "missed: {bad}");
    }
    for good in [
        "kubernetes/dns#310 explains why",
        "see https://github.com/kubernetes/kubernetes/issues/56903",
        "Benchmark of 2026-11-29 (2-core VM)",
        "No session is resumed: a resumed session would go on",
        "tissue 3",
        "two rounds; run 1; run 2",
        "the issue is that the cache",
    ] {
        assert_eq!(finding(good, &dates), None, "flagged: {good}");
    }
}

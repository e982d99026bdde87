//! `unsafe` lives in four small reviewed modules: `src/dataplane/nftables/ffi.rs` (the netlink
//! expressions libnftnl lacks), `src/netlink/socket.rs` (handing a netlink socket to tokio's
//! reactor, which tokio allows only in an `unsafe` call since it deprecated its safe
//! constructors as unsound; attaching a socket filter, which neither nix nor std wraps) and
//! `src/dataplane/iptables_sockopt.rs` (x_tables' `getsockopt`, whose buffer is input as well as
//! output, for iptables-legacy's change detector) and `src/malloc.rs` (glibc's `mallopt` and
//! `malloc_trim`, which keep an idle agent's memory to what it uses). The compiler enforces it (`deny` at the crate root, `forbid` on
//! every other module, in each binary and in the workspace's other crates); this test keeps
//! anyone from quietly widening it.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

/// Each reviewed module, the file that declares it, and the declaration with its `allow`.
const REVIEWED: [(&str, &str, &str); 4] = [
    (
        "src/dataplane/nftables/ffi.rs",
        "src/dataplane/nftables.rs",
        "#[allow(unsafe_code)]\nmod ffi;",
    ),
    ("src/netlink/socket.rs", "src/netlink.rs", "#[allow(unsafe_code)]\npub mod socket;"),
    (
        "src/dataplane/iptables_sockopt.rs",
        "src/dataplane/mod.rs",
        "#[allow(unsafe_code)]\nmod iptables_sockopt;",
    ),
    ("src/malloc.rs", "src/lib.rs", "#[allow(unsafe_code)]\npub mod malloc;"),
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.map(|e| e.expect("read_dir entry")) {
        let path = entry.path();
        if path.is_dir() {
            if !path.ends_with("target") {
                rust_files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The file's code with `//` comments and string literals blanked, line by line.
fn code_lines(text: &str) -> Vec<String> {
    text.lines()
        .map(|line| {
            // A quote as a char literal is no string's start or end.
            let line = line.replace("'\"'", "' '").replace("'\\\"'", "' '");
            let mut code = String::new();
            let mut in_string = false;
            let mut chars = line.chars().peekable();
            while let Some(c) = chars.next() {
                match c {
                    '\\' if in_string => {
                        chars.next();
                    }
                    '"' => in_string = !in_string,
                    '/' if !in_string && chars.peek() == Some(&'/') => break,
                    _ if !in_string => code.push(c),
                    _ => {}
                }
            }
            code
        })
        .collect()
}

fn has_word(code: &str, word: &str) -> bool {
    code.match_indices(word).any(|(i, _)| {
        let before = code[..i].chars().next_back();
        let after = code[i + word.len()..].chars().next();
        let ident = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
        !ident(before) && !ident(after)
    })
}

#[test]
fn unsafe_appears_only_in_the_reviewed_modules() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ["src", "tests", "benches", "fuzz", "crates"] {
        rust_files(&root.join(dir), &mut files);
    }
    assert!(files.len() > 20, "found only {} Rust files under {}", files.len(), root.display());
    let mut offenders = Vec::new();
    let mut allows = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(root).expect("under the root").to_string_lossy().into_owned();
        let text = std::fs::read_to_string(file).expect("read source");
        for (n, code) in code_lines(&text).iter().enumerate() {
            if has_word(code, "unsafe") && !REVIEWED.iter().any(|(module, ..)| rel == *module) {
                offenders.push(format!("{rel}:{}: {}", n + 1, code.trim()));
            }
            if code.contains("allow(unsafe_code)") {
                allows.push(format!("{rel}:{}", n + 1));
            }
        }
    }
    assert!(offenders.is_empty(), "unsafe outside the reviewed modules:\n{}", offenders.join("\n"));
    let want = REVIEWED.len();
    assert_eq!(allows.len(), want, "one allow(unsafe_code) per reviewed module, found {allows:?}");
    for (module, parent, declaration) in REVIEWED {
        let parent_text = std::fs::read_to_string(root.join(parent)).unwrap();
        assert!(parent_text.contains(declaration), "{parent} allows unsafe for {module}");
    }
}

#[test]
fn the_crate_denies_and_every_binary_forbids_unsafe() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = std::fs::read_to_string(root.join("src/lib.rs")).unwrap();
    assert!(lib.contains("#![deny(unsafe_code)]"), "src/lib.rs denies unsafe_code");
    let mut entry_points = vec![root.join("src/bin/nodelocaldns-ha/main.rs")];
    // The workspace's other crates: each root (library and binary) forbids it.
    let mut benches = vec![root.join("benches")];
    for krate in std::fs::read_dir(root.join("crates")).unwrap() {
        let krate = krate.unwrap().path();
        let src = krate.join("src");
        entry_points
            .extend(["lib.rs", "main.rs"].map(|f| src.join(f)).into_iter().filter(|p| p.is_file()));
        benches.push(krate.join("benches"));
    }
    for dir in benches.iter().filter(|d| d.is_dir()) {
        let files = std::fs::read_dir(dir).unwrap();
        entry_points.extend(files.map(|e| e.unwrap().path()).filter(|p| p.is_file()));
    }
    for file in entry_points {
        let text = std::fs::read_to_string(&file).unwrap();
        assert!(text.contains("#![forbid(unsafe_code)]"), "{} forbids unsafe_code", file.display());
    }
}

#[test]
fn the_scanner_sees_unsafe_code_and_ignores_comments_and_strings() {
    let lines = code_lines("let x = unsafe { f() }; // unsafe\nlet s = \"unsafe\"; // no\n");
    assert!(has_word(&lines[0], "unsafe"));
    assert!(!has_word(&lines[1], "unsafe"));
    let after_a_quote_char = code_lines("let q = '\"'; unsafe { f() }");
    assert!(has_word(&after_a_quote_char[0], "unsafe"));
    assert!(!has_word("unsafe_code", "unsafe"));
}

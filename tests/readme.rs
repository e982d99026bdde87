//! Every command the README (and docs/*.md) shows still works as shown: each `nodelocaldns-ha`
//! command (also where a `kubectl exec` runs it in the agent's pod) names a subcommand the binary
//! has and only flags that subcommand takes; each script it runs (`ci/…`, `testdata/…`) is there
//! and executable; each repository path it names is there; each `--set` of the Helm command is a
//! value the chart has. What the commands then do is the end-to-end tests' business (the demo is
//! `ci/demo.sh`; the chart's install is tests/e2e_deploy.rs's).

#![forbid(unsafe_code)]

use std::collections::BTreeSet;
use std::path::Path;

use clap::CommandFactory;
use nodelocaldns_ha::cli::Cli;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and the docs/*.md it links to (the command line, testing, install, operating), as
/// one text: the commands a reader is shown.
fn readme() -> String {
    let mut text = std::fs::read_to_string(repo().join("README.md")).expect("README.md");
    let mut docs: Vec<_> = std::fs::read_dir(repo().join("docs"))
        .expect("docs/")
        .map(|e| e.expect("docs/").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    for doc in docs {
        text += "\n";
        text += &std::fs::read_to_string(&doc).expect("a doc");
    }
    text
}

/// The README's commands: the lines of its code blocks (continuations joined, comments cut) and
/// its inline code spans, each as words.
fn commands(readme: &str) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    let mut block = false;
    let mut line = String::new();
    for raw in readme.lines() {
        if raw.trim_start().starts_with("```") {
            block = !block;
            continue;
        }
        if block {
            let text = raw.split(" #").next().unwrap_or("").trim();
            match text.strip_suffix('\\') {
                Some(head) => line.push_str(head),
                None => {
                    line.push_str(text);
                    found.push(std::mem::take(&mut line));
                }
            }
        } else {
            found.extend(raw.split('`').skip(1).step_by(2).map(str::to_owned));
        }
    }
    found
        .iter()
        .map(|l| l.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
        .filter(|words| !words.is_empty())
        .collect()
}

/// The agent's command in `words`: the words themselves, or what a `kubectl exec` runs in the
/// agent's pod (after its `--`), the form the docs give for the image, which has no shell.
fn agent_command(words: &[String]) -> Option<Vec<String>> {
    if words.first().is_some_and(|w| w == "kubectl") && words.iter().any(|w| w == "exec") {
        let dashes = words.iter().position(|w| w == "--")?;
        return Some(words[dashes + 1..].to_vec());
    }
    Some(words.to_vec())
}

#[test]
fn the_kubectl_exec_form_is_read_as_the_agents_command() {
    let words: Vec<String> = "kubectl -n kube-system exec $POD -c agent -- nodelocaldns-ha release"
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    assert_eq!(agent_command(&words).unwrap(), ["nodelocaldns-ha", "release"]);
    let exec_forms = commands(&readme())
        .iter()
        .filter(|w| w.first().is_some_and(|w| w == "kubectl") && w.iter().any(|w| w == "exec"))
        .filter_map(|w| agent_command(w))
        .filter(|w| w.first().is_some_and(|w| w == "nodelocaldns-ha"))
        .count();
    assert!(
        exec_forms >= 3,
        "the docs show {exec_forms} agent commands in their kubectl exec form"
    );
}

#[test]
fn every_agent_command_names_a_subcommand_and_its_flags() {
    let cli = Cli::command();
    let globals: BTreeSet<String> =
        cli.get_arguments().filter_map(|a| a.get_long()).map(str::to_owned).collect();
    let mut checked = 0;
    for words in commands(&readme()).iter().filter_map(|w| agent_command(w)) {
        let Some(rest) = words.strip_prefix(&["nodelocaldns-ha".to_owned()]) else { continue };
        let Some(name) = rest.first() else { continue };
        if name.starts_with('-') {
            continue; // `nodelocaldns-ha --version`, `--help`: clap's own.
        }
        let sub = cli
            .find_subcommand(name)
            .unwrap_or_else(|| panic!("README: `{}`: no subcommand {name}", words.join(" ")));
        let mut longs: BTreeSet<String> =
            sub.get_arguments().filter_map(|a| a.get_long()).map(str::to_owned).collect();
        longs.extend(globals.iter().cloned());
        for word in rest.iter().map(|w| w.trim_matches(|c| c == '[' || c == ']')) {
            let Some(flag) = word.strip_prefix("--") else { continue };
            let flag = flag.split('=').next().unwrap();
            assert!(
                longs.contains(flag),
                "README: `{}`: {name} has no --{flag} (it has {longs:?})",
                words.join(" ")
            );
        }
        checked += 1;
    }
    assert!(checked >= 5, "README shows {checked} agent commands: the parse lost them");
}

#[test]
fn every_script_and_path_the_readme_runs_is_there() {
    // Commands, not prose or the layout's tree: what starts with a program or a script.
    let programs = ["nodelocaldns-ha", "helm", "kubectl", "cargo", "docker", "podman", "sudo"];
    let is_command = |words: &Vec<String>| {
        let first = words[0].as_str();
        programs.contains(&first) || first.starts_with("ci/") || first.starts_with("testdata/")
    };
    let mut checked = 0;
    for words in commands(&readme()).into_iter().filter(is_command) {
        for word in &words {
            let word = word.trim_matches(|c: char| c == '"' || c == '\'' || c == ',' || c == ':');
            let is_path = ["ci/", "testdata/", "manifests/", "charts/", "docs/"]
                .iter()
                .any(|p| word.starts_with(p));
            if !is_path || word.contains(['*', '{', '$', '…', '<']) {
                continue;
            }
            let path = repo().join(word);
            assert!(path.exists(), "README names {word}, which is not in the repository");
            if word.ends_with(".sh") || word.starts_with("ci/vm/run") {
                let mode = std::os::unix::fs::PermissionsExt::mode(
                    &path.metadata().unwrap().permissions(),
                );
                assert!(mode & 0o111 != 0, "README runs {word}, which is not executable");
            }
            checked += 1;
        }
    }
    assert!(checked >= 5, "README names {checked} paths: the parse lost them");
}

#[test]
fn every_helm_value_the_readme_sets_is_the_charts() {
    let values =
        std::fs::read_to_string(repo().join("charts/nodelocaldns-ha/values.yaml")).unwrap();
    let values: serde_json::Value = serde_norway::from_str(&values).expect("values.yaml");
    let mut checked = 0;
    for words in commands(&readme()) {
        if words.first().map(String::as_str) != Some("helm") {
            continue;
        }
        for pair in words.windows(2).filter(|w| w[0] == "--set") {
            let key = pair[1].split('=').next().unwrap();
            let pointer = format!("/{}", key.replace('.', "/"));
            assert!(
                values.pointer(&pointer).is_some(),
                "README: `{}` sets {key}, which charts/nodelocaldns-ha/values.yaml lacks",
                words.join(" ")
            );
            checked += 1;
        }
    }
    assert!(checked >= 2, "README sets {checked} Helm values: the parse lost them");
}

//! The agent from its image (issue 34): the image built from the repository's Dockerfile by
//! `ci/image/build.sh` (rootful buildah, the builder made from Debian's packages), run by podman
//! as the DaemonSet runs it (`SimNode::agent_from_image`), in a simulated node.
//!
//! These tests need the image, named by `NLHA_AGENT_IMAGE`: ci/test.sh builds it and runs them
//! with `--ignored`. Without it they fail, naming the command that builds it.

use std::path::Path;

use nodelocaldns_ha::dataplane::iptables::{Flavour, Tool};
use testkit::*;

/// The image under test.
fn image() -> String {
    std::env::var("NLHA_AGENT_IMAGE").unwrap_or_else(|_| {
        panic!(
            "NLHA_AGENT_IMAGE is not set: build the image with `ci/image/build.sh` (it prints \
             the name) and run these tests with NLHA_AGENT_IMAGE=<name> … -- --ignored"
        )
    })
}

/// Acceptance 1: the ClusterIP shape on an nftables node (the backend speaking netlink from the
/// image): a cache SIGKILL under load from a pod loses no lookup.
#[test]
#[ignore = "needs the image: ci/image/build.sh, then NLHA_AGENT_IMAGE"]
fn image_agent_cache_sigkill_loses_no_pod_lookup() {
    let node = SimNode::up();
    let agent = node.agent_from_image(&image(), CLUSTER_DNS_IP, UPSTREAM_IP, &[]);
    let st = agent.state().expect("state");
    assert_eq!(st["dataplane"], "nftables", "{st}");
    cache_sigkill_loses_no_pod_lookup(&node, &agent);
}

/// The link-local shape on an iptables-legacy node, as kubespray arranges it, with the
/// DaemonSet's `--dataplane auto`: the image's iptables tools (legacy, with their extensions:
/// TPROXY, socket) read the node and install the rules, the forwarder listens on port 53 with
/// NET_BIND_SERVICE, and a cache SIGKILL loses no pod lookup to the link-local IP.
#[test]
#[ignore = "needs the image: ci/image/build.sh, then NLHA_AGENT_IMAGE"]
fn image_agent_link_local_on_iptables_legacy_loses_no_pod_lookup() {
    let node = SimNode::up_with(&["--kube-proxy", "iptables-legacy"]);
    let agent = node.agent_from_image(&image(), "", UPSTREAM_IP, &["--dataplane", "auto"]);
    let st = agent.state().expect("state");
    assert_eq!(st["dataplane"], "iptables-legacy", "{st}");
    assert!(st["shape"].as_str().unwrap().starts_with("link-local"), "{st}");
    assert!(st["warnings"].as_array().is_none_or(Vec::is_empty), "{st}");
    cache_sigkill_loses_no_lookup_to(&node, &agent, LOCAL_IP);
}

/// What is in the image: the agent, the webhook, the iptables tools the agent runs by name, the
/// drain bundle, `cp` for the overlay's init container; no shell, no package manager. Prints
/// the size and the files (the README's "The image" lists them).
#[test]
#[ignore = "needs the image: ci/image/build.sh, then NLHA_AGENT_IMAGE"]
fn image_holds_what_runs_and_no_shell() {
    let image = image();
    let out = podman().args(["image", "mount", &image]).output().expect("podman image mount");
    assert!(out.status.success(), "{}", describe(&out));
    let root = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    let root = Path::new(&root);
    let has = |path: &str| root.join(path.trim_start_matches('/')).symlink_metadata().is_ok();
    let mut wanted = vec![
        "/usr/local/bin/nodelocaldns-ha".to_owned(),
        "/usr/local/bin/nodelocaldns-ha-webhook".to_owned(),
        "/opt/nodelocaldns-ha/nodelocaldns-ha".to_owned(),
        "/opt/nodelocaldns-ha/ld.so".to_owned(),
        "/usr/bin/cp".to_owned(),
    ];
    // The iptables tools by the names the agent runs them (this kernel's families).
    for flavour in Flavour::ALL {
        for tool in [Tool::List, Tool::Save, Tool::Restore] {
            wanted.extend(flavour.binaries(tool).iter().map(|b| format!("/usr/sbin/{b}")));
        }
    }
    let missing: Vec<_> = wanted.iter().filter(|p| !has(p)).collect();
    let shells = ["/bin/sh", "/usr/bin/sh", "/bin/bash", "/usr/bin/bash", "/bin/dash"];
    let present: Vec<_> =
        shells.iter().chain(&["/usr/bin/apt-get", "/usr/bin/dpkg"]).filter(|p| has(p)).collect();
    let files = walk(root);
    let size = podman().args(["image", "inspect", "--format", "{{.Size}}", &image]).output();
    let _ = podman().args(["image", "unmount", &image]).output();
    println!("{image}: {} bytes", String::from_utf8_lossy(&size.expect("inspect").stdout).trim());
    for file in &files {
        println!("  {file}");
    }
    assert!(missing.is_empty(), "the image lacks {missing:?}");
    assert!(present.is_empty(), "the image has {present:?}");
}

/// Every file and link under `root`, as paths in the image, sorted.
fn walk(root: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read the image's directory").flatten() {
            let path = entry.path();
            match entry.file_type() {
                Ok(t) if t.is_dir() => dirs.push(path),
                _ => found.push(format!("/{}", path.strip_prefix(root).unwrap().display())),
            }
        }
    }
    found.sort();
    found
}

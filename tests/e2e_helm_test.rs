//! `helm test` of the chart on the real node (testdata/realnode.sh: a real kubelet and
//! containerd running upstream's node-local-dns, kube-proxy and CoreDNS): the agent installed
//! with `helm install` from its image, node-local-dns patched with the commands the install's
//! NOTES print, run as an operator runs them, then `helm test`, whose pod asks the node-local IP
//! and the kube-dns ClusterIP for kubernetes.default and prints the node's `nodelocaldns-ha
//! status`. Needs the image (ci/image/build.sh, then NLHA_AGENT_IMAGE): run with `--ignored`,
//! as ci/test.sh does once the image is built.

use std::process::Command;
use std::time::Duration;

use testkit::{describe, RealNode};

const NS: &str = "kube-system";

#[test]
#[ignore = "needs the image: ci/image/build.sh, then NLHA_AGENT_IMAGE"]
fn helm_test_passes_on_a_real_node_once_node_local_dns_is_patched_as_the_notes_say() {
    let image = std::env::var("NLHA_AGENT_IMAGE")
        .expect("NLHA_AGENT_IMAGE must name the agent's image (ci/image/build.sh prints it)");
    let (repository, tag) = image.rsplit_once(':').expect("the image has a tag");
    let node = RealNode::up(&["--agent-image", &image]);
    let chart = concat!(env!("CARGO_MANIFEST_DIR"), "/charts/nodelocaldns-ha");
    let repository = format!("image.repository={repository}");
    let tag = format!("image.tag={tag}");
    let out = node.helm(&[
        "install",
        "nlha",
        chart,
        "--namespace",
        NS,
        "--wait",
        "--timeout",
        "2m",
        "--set",
        &repository,
        "--set",
        &tag,
        "--set",
        "clusterDNSIP=10.96.0.10",
    ]);
    assert!(out.status.success(), "helm install:\n{}", describe(&out));
    let notes = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("{notes}");
    assert!(notes.contains("Found DaemonSet kube-system/node-local-dns"), "{notes}");

    // The NOTES' patches, by bash from the repository's root, kubectl being the node's (run in
    // the node's mount namespace: the repository's files by their full path there).
    let patches: Vec<&str> = notes
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("kubectl -n kube-system patch"))
        .take_while(|l| !l.trim().is_empty())
        .collect();
    assert_eq!(patches.iter().filter(|l| l.contains("kubectl")).count(), 2, "{notes}");
    let prefix = node.dir.file_name().unwrap().to_str().unwrap();
    let root = env!("CARGO_MANIFEST_DIR");
    let patches = patches.join("\n").replace(" manifests/", &format!(" {root}/manifests/"));
    let script =
        format!("kubectl() {{ testdata/realnode.sh kubectl {prefix} \"$@\"; }}\n{patches}\n");
    let out = Command::new("bash")
        .args(["-euo", "pipefail", "-c", &script])
        .current_dir(root)
        .env("REALNODE_DIR", node.dir.parent().unwrap())
        .output()
        .expect("bash");
    assert!(out.status.success(), "the NOTES' patches:\n{script}\n{}", describe(&out));
    node.wait_rollout(NS, "daemonset/node-local-dns", Duration::from_secs(180));
    let ds = node.get_json(&["-n", NS, "get", "daemonset", "node-local-dns"]);
    let args = &ds["spec"]["template"]["spec"]["containers"][0]["args"];
    assert!(args.to_string().ends_with(r#""-setupiptables=false","-skipteardown"]"#), "{args}");

    let out = node.helm(&["test", "nlha", "--namespace", NS, "--logs", "--timeout", "2m"]);
    let text = describe(&out);
    println!("{text}");
    assert!(out.status.success(), "helm test:\n{text}");
    for seen in ["169.254.20.10:53", "10.96.0.10:53", "answered", "agent:       running"] {
        assert!(text.contains(seen), "helm test's logs lack {seen:?}:\n{text}");
    }
}

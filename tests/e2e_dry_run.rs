//! Every manifest accepted by a real API server (issue 34, acceptance 3): each kustomization
//! under manifests/, and the components on top of them, built by the real kubectl's kustomize,
//! their placeholders filled as manifests/README.md fills them, and sent with `kubectl apply
//! --dry-run=server` to the simulated node's real kube-apiserver (issue 31), which runs its
//! defaulting, validation and admission on every object and stores none.
//!
//! As on a real cluster: kube-system already holds kube-dns and kube-dns-upstream (the test bed
//! made them), the CustomResourceDefinitions the components use are installed (prometheus-
//! operator's PodMonitor and PrometheusRule, cert-manager's Issuer and Certificate, as their
//! projects generate them, from the modules pinned in ci/k8s/versions.env), and the namespaces
//! the renderings create exist (a dry run creates nothing, so a namespace created by the same
//! rendering would not be there for its objects). node-local-dns's overlays take the stock
//! manifest from the pinned Kubernetes module, where a user's build fetches it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;
use testkit::*;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `NAME`'s value in ci/k8s/versions.env.
fn pin(name: &str) -> String {
    let text = std::fs::read_to_string(repo().join("ci/k8s/versions.env")).expect("versions.env");
    let prefix = format!("{name}=");
    let value = text.lines().find_map(|l| l.strip_prefix(&prefix));
    value.unwrap_or_else(|| panic!("ci/k8s/versions.env pins no {name}")).to_owned()
}

/// The directory of `module@version`, from the Go module proxy (or Go's module cache).
fn module_dir(module: &str, version: &str) -> PathBuf {
    let out = Command::new("go")
        .args(["mod", "download", "-json", &format!("{module}@{version}")])
        .env("GOTOOLCHAIN", "local")
        .env("GOFLAGS", "")
        .output()
        .expect("go (ci/deps.sh)");
    assert!(out.status.success(), "go mod download {module}@{version}: {}", describe(&out));
    let info: Value = serde_json::from_slice(&out.stdout).expect("go mod download's JSON");
    PathBuf::from(info["Dir"].as_str().unwrap_or_else(|| panic!("no Dir: {info}")))
}

/// `kubectl ARGS` as the cluster's admin, `input` on its stdin.
fn kubectl(node: &SimNode, args: &[&str], input: &str) -> Output {
    let mut child = node
        .kubectl()
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kubectl");
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), input.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

/// The renderings: (name, the kustomization's resources, its components), paths relative to a
/// kustomization one level below manifests/. Every kustomization, and every component on the
/// kustomization it is made for.
const RENDERINGS: [(&str, &[&str], &[&str]); 6] = [
    ("base", &["../base"], &[]),
    ("agent-link-local", &["../overlays/agent-link-local"], &[]),
    ("node-local-dns", &["../overlays/node-local-dns"], &["../monitoring/node-local-dns"]),
    ("node-local-dns-link-local", &["../overlays/node-local-dns-link-local"], &[]),
    (
        "base-with-every-component",
        &["../base"],
        &["../cluster-reports", "../cluster-reports/startup-taint", "../monitoring", "../webhook"],
    ),
    (
        "agent-link-local-with-reports-and-monitoring",
        &["../overlays/agent-link-local"],
        &["../cluster-reports", "../monitoring"],
    ),
];

/// A copy of manifests/ with node-local-dns's overlay on the stock manifest of the pinned
/// Kubernetes module, and a kustomization for each rendering; their builds, filled.
fn renderings(dir: &Path) -> Vec<(&'static str, String)> {
    let manifests = dir.join("manifests");
    let copied =
        Command::new("cp").arg("-R").arg(repo().join("manifests")).arg(&manifests).status();
    assert!(copied.expect("cp").success());
    let kubernetes = module_dir("k8s.io/kubernetes", &pin("K8S_VERSION"));
    let stock = kubernetes.join("cluster/addons/dns/nodelocaldns/nodelocaldns.yaml");
    let overlay = manifests.join("overlays/node-local-dns");
    std::fs::copy(&stock, overlay.join("nodelocaldns.yaml")).expect("the stock manifest");
    let kustomization = overlay.join("kustomization.yaml");
    let text = std::fs::read_to_string(&kustomization).unwrap();
    let remote = text.lines().find(|l| l.contains("https://")).expect("the remote resource");
    std::fs::write(&kustomization, text.replace(remote, "  - nodelocaldns.yaml")).unwrap();

    RENDERINGS
        .iter()
        .map(|&(name, resources, components)| {
            let at = manifests.join(format!("rendering-{name}"));
            std::fs::create_dir(&at).unwrap();
            let list = |items: &[&str]| items.iter().map(|i| format!("  - {i}\n")).collect::<String>();
            let text = format!(
                "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n{}{}",
                list(resources),
                if components.is_empty() { String::new() } else { format!("components:\n{}", list(components)) },
            );
            std::fs::write(at.join("kustomization.yaml"), text).unwrap();
            let out = Command::new(real_bin().join("kubectl")).arg("kustomize").arg(&at).output();
            let out = out.expect("kubectl kustomize");
            assert!(out.status.success(), "kubectl kustomize {name}: {}", describe(&out));
            (name, fill(&String::from_utf8(out.stdout).unwrap()))
        })
        .collect()
}

/// node-local-dns's placeholders filled as manifests/README.md's step 3 fills them.
fn fill(yaml: &str) -> String {
    yaml.replace("__PILLAR__LOCAL__DNS__", LOCAL_IP)
        .replace("__PILLAR__DNS__SERVER__", CLUSTER_DNS_IP)
        .replace("__PILLAR__DNS__DOMAIN__", "cluster.local")
}

/// Installs the CustomResourceDefinitions the components use and waits until they serve.
fn install_crds(node: &SimNode) {
    let monitoring = module_dir(
        "github.com/prometheus-operator/prometheus-operator",
        &pin("PROMETHEUS_OPERATOR_VERSION"),
    )
    .join("example/prometheus-operator-crd");
    let cert_manager =
        module_dir("github.com/cert-manager/cert-manager", &pin("CERT_MANAGER_VERSION"))
            .join("deploy/crds");
    let crds = [
        (
            monitoring.join("monitoring.coreos.com_podmonitors.yaml"),
            "podmonitors.monitoring.coreos.com",
        ),
        (
            monitoring.join("monitoring.coreos.com_prometheusrules.yaml"),
            "prometheusrules.monitoring.coreos.com",
        ),
        (cert_manager.join("cert-manager.io_issuers.yaml"), "issuers.cert-manager.io"),
        (cert_manager.join("cert-manager.io_certificates.yaml"), "certificates.cert-manager.io"),
    ];
    for (file, name) in &crds {
        let text =
            std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        // Server-side: the largest CRDs outgrow the last-applied annotation's 256 KiB.
        let out = kubectl(node, &["apply", "--server-side", "-f", "-"], &text);
        assert!(out.status.success(), "the CRD {name}: {}", describe(&out));
    }
    for (_, name) in &crds {
        let crd = format!("crd/{name}");
        let args = ["wait", "--for=condition=Established", "--timeout=30s", &crd];
        let out = kubectl(node, &args, "");
        assert!(out.status.success(), "{name} established: {}", describe(&out));
    }
}

/// The names of the Namespaces `yaml` creates.
fn namespaces(yaml: &str) -> Vec<String> {
    let mut found = Vec::new();
    for doc in yaml.split("\n---\n") {
        if doc.lines().any(|l| l == "kind: Namespace") {
            let name = doc
                .lines()
                .skip_while(|l| *l != "metadata:")
                .find_map(|l| l.trim().strip_prefix("name: "));
            found.push(name.expect("the Namespace's name").to_owned());
        }
    }
    found
}

#[test]
fn every_rendering_of_the_manifests_passes_a_server_side_dry_run() {
    let node = SimNode::up_with(&["--kube-proxy", "real-iptables"]);
    let renderings = renderings(&node.dir);
    install_crds(&node);
    for (_, yaml) in &renderings {
        for namespace in namespaces(yaml) {
            let out = kubectl(&node, &["create", "namespace", &namespace], "");
            let text = describe(&out);
            assert!(out.status.success() || text.contains("AlreadyExists"), "{namespace}: {text}");
        }
    }
    for (name, yaml) in &renderings {
        let objects = yaml.split("\n---\n").filter(|d| d.contains("kind:")).count();
        let out = kubectl(&node, &["apply", "--dry-run=server", "-f", "-"], yaml);
        let stdout = String::from_utf8_lossy(&out.stdout);
        println!("{name}: {objects} objects\n{stdout}");
        assert!(out.status.success(), "{name}: the API server refused it: {}", describe(&out));
        let accepted = stdout.lines().filter(|l| l.ends_with("(server dry run)")).count();
        assert_eq!(accepted, objects, "{name}: every object accepted: {stdout}");
    }
    // Nothing was stored: the agent's DaemonSet is not there.
    let out = kubectl(&node, &["-n", "kube-system", "get", "daemonset", "nodelocaldns-ha"], "");
    assert!(!out.status.success(), "a dry run stored the DaemonSet: {}", describe(&out));
}

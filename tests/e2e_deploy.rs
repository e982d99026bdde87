//! Deploying it (issue 34): the Helm chart (charts/nodelocaldns-ha) and the kustomizations
//! under manifests/, against the real kubectl, helm and kube-apiserver (ci/k8s/build.sh).
//!
//! * The chart renders exactly the objects kustomize builds from the same choices (shape,
//!   components), and `helm lint` passes.
//! * Every rendering, kustomize's and the chart's, passes `kubectl apply --dry-run=server` on the
//!   simulated node's real kube-apiserver (issue 31), which runs its defaulting, validation and
//!   admission on every object and stores none.
//! * `helm install`, `helm upgrade` and `helm uninstall` on that API server create, change and
//!   remove exactly the expected objects.
//!
//! As on a real cluster: kube-system already holds kube-dns and kube-dns-upstream (the test bed
//! made them), the CustomResourceDefinitions the components use are installed (prometheus-
//! operator's PodMonitor and PrometheusRule, cert-manager's Issuer and Certificate, as their
//! projects generate them, from the modules pinned in ci/k8s/versions.env), and the namespaces
//! the renderings create exist for the dry run (which creates nothing, so a namespace created by
//! the same rendering would not be there for its objects). node-local-dns's overlays take the
//! stock manifest from the pinned Kubernetes module, where a user's build fetches it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use std::collections::BTreeMap;

use serde::Deserialize;
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
    node.kubectl_input(args, input.as_bytes())
}

/// A rendering: a kustomization one level below manifests/ (its resources and components,
/// relative to it; it also sets the image, as a user's must for the webhook's Deployment) and,
/// where the chart makes the same choices, the chart's values (`--set`).
struct Rendering {
    name: &'static str,
    resources: &'static [&'static str],
    components: &'static [&'static str],
    values: Option<&'static [&'static str]>,
}

/// Every kustomization, and every component on the kustomization it is made for.
const RENDERINGS: [Rendering; 6] = [
    Rendering {
        name: "base",
        resources: &["../base"],
        components: &[],
        values: Some(&["clusterDNSIP=10.96.0.10", "kubeDNSUpstreamService.create=true"]),
    },
    Rendering {
        name: "agent-link-local",
        resources: &["../overlays/agent-link-local"],
        components: &[],
        values: Some(&["shape=LinkLocal", "kubeDNSUpstreamService.create=true"]),
    },
    Rendering {
        name: "node-local-dns",
        resources: &["../overlays/node-local-dns"],
        components: &["../monitoring/node-local-dns"],
        values: None,
    },
    Rendering {
        name: "node-local-dns-link-local",
        resources: &["../overlays/node-local-dns-link-local"],
        components: &[],
        values: None,
    },
    Rendering {
        name: "base-with-every-component",
        resources: &["../base"],
        components: &[
            "../cluster-reports",
            "../cluster-reports/startup-taint",
            "../monitoring",
            "../webhook",
        ],
        values: Some(&[
            "clusterDNSIP=10.96.0.10",
            "kubeDNSUpstreamService.create=true",
            "clusterReports.enabled=true",
            "clusterReports.startupTaint=true",
            "monitoring.enabled=true",
            "webhook.enabled=true",
        ]),
    },
    Rendering {
        name: "agent-link-local-with-reports-and-monitoring",
        resources: &["../overlays/agent-link-local"],
        components: &["../cluster-reports", "../monitoring"],
        values: Some(&[
            "shape=LinkLocal",
            "kubeDNSUpstreamService.create=true",
            "clusterReports.enabled=true",
            "monitoring.enabled=true",
        ]),
    },
];

/// The image every rendering names: manifests/base's, the chart's default.
const IMAGE: &str = "registry.example/nodelocaldns-ha:0.1.0";

/// kustomize's build of each rendering, filled, from a copy of manifests/ in `dir` with
/// node-local-dns's overlay on the stock manifest of the pinned Kubernetes module.
fn kustomize_builds(dir: &Path) -> Vec<(&'static Rendering, String)> {
    let manifests = dir.join("manifests");
    let _ = std::fs::remove_dir_all(&manifests);
    std::fs::create_dir_all(dir).unwrap();
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

    let (image, tag) = IMAGE.split_once(':').unwrap();
    let list = |items: &[&str]| items.iter().map(|i| format!("  - {i}\n")).collect::<String>();
    RENDERINGS
        .iter()
        .map(|r| {
            let at = manifests.join(format!("rendering-{}", r.name));
            std::fs::create_dir(&at).unwrap();
            let mut text =
                "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n".to_owned();
            text += &format!("resources:\n{}", list(r.resources));
            if !r.components.is_empty() {
                text += &format!("components:\n{}", list(r.components));
            }
            text += &format!(
                "images:\n  - {{name: nodelocaldns-ha, newName: {image}, newTag: \"{tag}\"}}\n"
            );
            std::fs::write(at.join("kustomization.yaml"), text).unwrap();
            let out = Command::new(real_bin().join("kubectl")).arg("kustomize").arg(&at).output();
            let out = out.expect("kubectl kustomize");
            assert!(out.status.success(), "kubectl kustomize {}: {}", r.name, describe(&out));
            (r, fill(&String::from_utf8(out.stdout).unwrap()))
        })
        .collect()
}

/// The chart (charts/nodelocaldns-ha), as helm installs it.
fn chart() -> PathBuf {
    repo().join("charts/nodelocaldns-ha")
}

/// The real helm (ci/k8s/build.sh helm).
fn helm() -> Command {
    Command::new(real_bin().join("helm"))
}

/// `--set` arguments for `values`.
fn set(values: &[&str]) -> Vec<String> {
    values.iter().flat_map(|v| ["--set".to_owned(), (*v).to_owned()]).collect()
}

/// `helm template` of the chart with `values`.
fn helm_template(values: &[&str]) -> String {
    let out = helm()
        .args(["template", "nodelocaldns-ha"])
        .arg(chart())
        .args(["--namespace", "kube-system"])
        .args(set(values))
        .output()
        .expect("helm (ci/k8s/build.sh helm)");
    assert!(out.status.success(), "helm template {values:?}: {}", describe(&out));
    String::from_utf8(out.stdout).unwrap()
}

/// The chart's rendering of each rendering it has values for.
fn chart_renderings() -> Vec<(&'static Rendering, String)> {
    RENDERINGS.iter().filter_map(|r| Some((r, helm_template(r.values?)))).collect()
}

/// YAML documents parsed, by (kind, namespace, name).
fn objects(yaml: &str) -> BTreeMap<(String, String, String), Value> {
    serde_norway::Deserializer::from_str(yaml)
        .map(|doc| Value::deserialize(doc).expect("YAML"))
        .filter(|doc| !doc.is_null())
        .map(|doc| {
            let at = |p: &str| doc.pointer(p).and_then(Value::as_str).unwrap_or("").to_owned();
            ((at("/kind"), at("/metadata/namespace"), at("/metadata/name")), doc)
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
    objects(yaml)
        .into_keys()
        .filter(|(kind, _, _)| kind == "Namespace")
        .map(|(_, _, n)| n)
        .collect()
}

#[test]
fn the_chart_renders_what_kustomize_builds() {
    let dir = std::env::temp_dir().join(format!("nlha-deploy-{}", std::process::id()));
    let built = kustomize_builds(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    let charted = chart_renderings();
    assert_eq!(charted.len(), 4, "the chart covers four renderings");
    for (r, yaml) in charted {
        let kustomized = &built.iter().find(|(k, _)| k.name == r.name).unwrap().1;
        let (want, got) = (objects(kustomized), objects(&yaml));
        let (want_ids, got_ids): (Vec<_>, Vec<_>) = (want.keys().collect(), got.keys().collect());
        assert_eq!(got_ids, want_ids, "{}: the chart's objects, then kustomize's", r.name);
        for (id, object) in &want {
            assert!(
                got[id] == *object,
                "{}: {id:?} differs.\nchart:\n{}\nkustomize:\n{}",
                r.name,
                serde_json::to_string_pretty(&got[id]).unwrap(),
                serde_json::to_string_pretty(object).unwrap()
            );
        }
        println!("{}: the chart renders kustomize's {} objects", r.name, want.len());
    }
}

#[test]
fn helm_lint_passes_and_bad_values_are_refused() {
    for values in [&["clusterDNSIP=10.96.0.10"][..], RENDERINGS[4].values.unwrap()] {
        let out = helm().args(["lint", "--strict"]).arg(chart()).args(set(values)).output();
        let out = out.expect("helm");
        assert!(out.status.success(), "helm lint {values:?}: {}", describe(&out));
    }
    // What an operator gets wrong, refused with what to do; nothing rendered.
    let refused = [
        (&[][..], "clusterDNSIP: the ClusterIP shape needs the kube-dns ClusterIP"),
        (&["shape=Ipvs"][..], "shape: \"Ipvs\" is neither ClusterIP nor LinkLocal"),
        (
            &["shape=LinkLocal", "clusterReports.startupTaint=true"][..],
            "needs clusterReports.enabled",
        ),
    ];
    for (values, says) in refused {
        let out = helm().args(["template", "x"]).arg(chart()).args(set(values)).output().unwrap();
        assert!(
            !out.status.success() && describe(&out).contains(says),
            "{values:?}: {}",
            describe(&out)
        );
    }
}

#[test]
fn every_rendering_passes_a_server_side_dry_run() {
    let node = SimNode::up_with(&["--kube-proxy", "real-iptables"]);
    let mut renderings: Vec<(String, String)> = kustomize_builds(&node.dir)
        .into_iter()
        .map(|(r, yaml)| (format!("kustomize {}", r.name), yaml))
        .collect();
    renderings.extend(
        chart_renderings().into_iter().map(|(r, yaml)| (format!("chart {}", r.name), yaml)),
    );
    install_crds(&node);
    for (_, yaml) in &renderings {
        for namespace in namespaces(yaml) {
            let out = kubectl(&node, &["create", "namespace", &namespace], "");
            let text = describe(&out);
            assert!(out.status.success() || text.contains("AlreadyExists"), "{namespace}: {text}");
        }
    }
    for (name, yaml) in &renderings {
        let count = objects(yaml).len();
        let out = kubectl(&node, &["apply", "--dry-run=server", "-f", "-"], yaml);
        let stdout = String::from_utf8_lossy(&out.stdout);
        println!("{name}: {count} objects\n{stdout}");
        assert!(out.status.success(), "{name}: the API server refused it: {}", describe(&out));
        let accepted = stdout.lines().filter(|l| l.ends_with("(server dry run)")).count();
        assert_eq!(accepted, count, "{name}: every object accepted: {stdout}");
    }
    // Nothing was stored: the agent's DaemonSet is not there.
    let out = kubectl(&node, &["-n", "kube-system", "get", "daemonset", "nodelocaldns-ha"], "");
    assert!(!out.status.success(), "a dry run stored the DaemonSet: {}", describe(&out));
}

/// The kinds the chart makes, as kubectl names them.
const KINDS: &str = "serviceaccounts,services,daemonsets,deployments,poddisruptionbudgets,\
                     configmaps,roles,rolebindings,clusterroles,clusterrolebindings,namespaces,\
                     podmonitors,prometheusrules,issuers,certificates,\
                     mutatingwebhookconfigurations";

/// What the API server holds of release `release`: every object of the chart's kinds that
/// Helm marked as the release's (its `meta.helm.sh/release-name` annotation), by id.
fn released(node: &SimNode, release: &str) -> BTreeMap<(String, String, String), Value> {
    let out = kubectl(node, &["get", KINDS, "--all-namespaces", "-o", "json"], "");
    assert!(out.status.success(), "kubectl get: {}", describe(&out));
    let list: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let ours = |o: &&Value| o["metadata"]["annotations"]["meta.helm.sh/release-name"] == release;
    let at = |o: &Value, p: &str| o.pointer(p).and_then(Value::as_str).unwrap_or("").to_owned();
    let items = list["items"].as_array().expect("items");
    items
        .iter()
        .filter(ours)
        .map(|o| {
            ((at(o, "/kind"), at(o, "/metadata/namespace"), at(o, "/metadata/name")), o.clone())
        })
        .collect()
}

/// `helm ARGS` against the node's API server, as its admin.
fn helm_on(node: &SimNode, args: &[&str], values: &[&str]) {
    let mut command = node.cmd("node", real_bin().join("helm").to_str().unwrap());
    command.args(args).arg("--kubeconfig").arg(node.dir.join("admin.kubeconfig")).args(set(values));
    let out = command.output().expect("helm");
    assert!(out.status.success(), "helm {args:?} {values:?}: {}", describe(&out));
}

/// The env of the agent's container in the DaemonSet the API server holds, by name.
fn agent_env(objects: &BTreeMap<(String, String, String), Value>) -> Vec<String> {
    let id = ("DaemonSet".to_owned(), "kube-system".to_owned(), "nodelocaldns-ha".to_owned());
    let env = objects[&id].pointer("/spec/template/spec/containers/0/env").cloned();
    let env = env.and_then(|e| e.as_array().cloned()).unwrap_or_default();
    env.iter().map(|e| e["name"].as_str().unwrap_or("").to_owned()).collect()
}

/// Install, upgrade (components on, then off again) and uninstall on the real API server: after
/// each, the release's objects there are exactly those `helm template` renders for the same
/// values; the objects it did not make (kube-dns-upstream, node-local-dns's) are left alone.
#[test]
fn helm_install_upgrade_and_uninstall_change_exactly_the_charts_objects() {
    let node = SimNode::up_with(&["--kube-proxy", "real-iptables"]);
    install_crds(&node);
    let chart = chart();
    let chart = chart.to_str().unwrap();
    let plain = ["clusterDNSIP=10.96.0.10"];
    let components = [
        "clusterDNSIP=10.96.0.10",
        "clusterReports.enabled=true",
        "clusterReports.startupTaint=true",
        "monitoring.enabled=true",
    ];
    let upstream = |node: &SimNode| {
        let args = ["-n", "kube-system", "get", "service", "kube-dns-upstream", "-o", "json"];
        let out = kubectl(node, &args, "");
        assert!(out.status.success(), "kube-dns-upstream: {}", describe(&out));
        serde_json::from_slice::<Value>(&out.stdout).unwrap()["spec"]["clusterIP"].clone()
    };
    let upstream_ip = upstream(&node);

    // `helm VERB` with `values`; then the release's objects in the API server are exactly what
    // the chart renders for them, and the agent's env as it renders it.
    let step = |verb: &str, values: &[&str]| {
        helm_on(&node, &[verb, "nlha", chart, "--namespace", "kube-system"], values);
        let held = released(&node, "nlha");
        let rendered = objects(&helm_template(values));
        assert_eq!(held.keys().collect::<Vec<_>>(), rendered.keys().collect::<Vec<_>>(), "{verb}");
        println!("{verb} {values:?}: {:?}", held.keys().collect::<Vec<_>>());
        agent_env(&held)
    };
    let reports = "NODELOCALDNS_HA_NODE_NAME".to_owned();
    assert!(!step("install", &plain).contains(&reports));
    let env = step("upgrade", &components);
    for name in [reports.as_str(), "NODELOCALDNS_HA_STARTUP_TAINT"] {
        assert!(env.contains(&name.to_owned()), "the upgraded DaemonSet's env: {env:?}");
    }
    assert!(!step("upgrade", &plain).contains(&reports));

    helm_on(&node, &["uninstall", "nlha", "--namespace", "kube-system"], &[]);
    let held = released(&node, "nlha");
    assert!(held.is_empty(), "left after uninstall: {:?}", held.keys().collect::<Vec<_>>());
    assert_eq!(upstream(&node), upstream_ip, "kube-dns-upstream, not the chart's, is untouched");
}

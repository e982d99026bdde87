//! Deploying it: the Helm chart (charts/nodelocaldns-ha) and the kustomizations under
//! manifests/, against the real kubectl, helm and kube-apiserver (ci/k8s/build.sh).
//!
//! * The chart renders exactly the objects kustomize builds from the same choices (shape,
//!   components), Helm's own labels and the `helm test` pod aside; `helm lint --strict` passes
//!   for every flavour of node-local-dns, and bad values are refused with what is wrong.
//! * Every rendering, kustomize's and the chart's for every flavour, passes `kubectl apply
//!   --dry-run=server` on the simulated node's real kube-apiserver, which runs its defaulting,
//!   validation and admission on every object and stores none.
//! * For each flavour (upstream's manifest, deliveryhero's chart, kubespray's templates; their
//!   objects from testdata/node-local-dns and the pinned Kubernetes module): the install refuses
//!   a cluster where the agent could not work (no upstream Service, the wrong addresses, a
//!   Corefile bound to 0.0.0.0); then `helm install` makes exactly the chart's objects, `helm
//!   uninstall` removes them, and every object of node-local-dns is as it was, byte for byte
//!   (its upstream Service's ClusterIP the same); the patches the install's NOTES give, and the
//!   removal manifests/README.md gives, change node-local-dns's DaemonSet as they say.
//! * `helm install`, `helm upgrade` and `helm uninstall` create, change and remove exactly the
//!   expected objects.
//!
//! As on a real cluster: kube-system already holds kube-dns and kube-dns-upstream (the test bed
//! made them), the CustomResourceDefinitions the components use are installed (prometheus-
//! operator's PodMonitor and PrometheusRule, cert-manager's Issuer and Certificate, as their
//! projects generate them, from the modules pinned in ci/k8s/versions.env), and the namespaces
//! the renderings create exist for the dry run (which creates nothing, so a namespace created by
//! the same rendering would not be there for its objects).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

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
/// relative to it; it also sets the image, as a user's must for the webhook's Deployment) and
/// the chart's values (`--set`) for the same choices.
struct Rendering {
    name: &'static str,
    resources: &'static [&'static str],
    components: &'static [&'static str],
    values: &'static [&'static str],
}

/// Every kustomization, and every component on the kustomization it is made for.
const RENDERINGS: [Rendering; 4] = [
    Rendering {
        name: "base",
        resources: &["../base"],
        components: &[],
        values: &["clusterDNSIP=10.96.0.10"],
    },
    Rendering {
        name: "agent-link-local",
        resources: &["../overlays/agent-link-local"],
        components: &[],
        values: &["shape=LinkLocal"],
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
        values: &[
            "clusterDNSIP=10.96.0.10",
            "clusterReports.enabled=true",
            "clusterReports.startupTaint=true",
            "monitoring.enabled=true",
            "webhook.enabled=true",
        ],
    },
    Rendering {
        name: "agent-link-local-with-reports-and-monitoring",
        resources: &["../overlays/agent-link-local"],
        components: &["../cluster-reports", "../monitoring"],
        values: &["shape=LinkLocal", "clusterReports.enabled=true", "monitoring.enabled=true"],
    },
];

/// The image every rendering names: manifests/base's, the chart's default.
const IMAGE: &str = "registry.example/nodelocaldns-ha:0.1.0";

/// A way node-local-dns is deployed, and the chart's values for it.
struct Flavour {
    name: &'static str,
    values: &'static [&'static str],
    daemonset: &'static str,
    upstream_service: &'static str,
    /// Its link-local IP and, in the ClusterIP shape, the kube-dns ClusterIP: what the agent
    /// probes and routes to.
    addresses: &'static [&'static str],
}

const FLAVOURS: [Flavour; 3] = [
    Flavour {
        name: "upstream",
        values: &["clusterDNSIP=10.96.0.10"],
        daemonset: "node-local-dns",
        upstream_service: "kube-dns-upstream",
        addresses: &["169.254.20.10", "10.96.0.10"],
    },
    Flavour {
        name: "deliveryhero",
        values: &["nodeLocalDNS.flavor=deliveryhero", "clusterDNSIP=10.96.0.10"],
        daemonset: "node-local-dns",
        upstream_service: "node-local-dns-upstream",
        addresses: &["169.254.20.25", "10.96.0.10"],
    },
    Flavour {
        name: "kubespray",
        values: &["nodeLocalDNS.flavor=kubespray"],
        daemonset: "nodelocaldns",
        upstream_service: "coredns",
        addresses: &["169.254.25.10"],
    },
];

/// The components' values, on top of a flavour's (the webhook needs the kube-dns ClusterIP).
const COMPONENTS: [&str; 3] =
    ["clusterReports.enabled=true", "clusterReports.startupTaint=true", "monitoring.enabled=true"];

impl Flavour {
    /// node-local-dns's objects as this flavour deploys them: upstream's manifest from the
    /// pinned Kubernetes module, filled as kubernetes.io's NodeLocal DNSCache page fills it;
    /// deliveryhero's and kubespray's from testdata/node-local-dns (each file says where from).
    fn objects(&self) -> String {
        match self.name {
            "upstream" => {
                let kubernetes = module_dir("k8s.io/kubernetes", &pin("K8S_VERSION"));
                let stock = kubernetes.join("cluster/addons/dns/nodelocaldns/nodelocaldns.yaml");
                fill(&std::fs::read_to_string(stock).expect("the stock manifest"))
            }
            name => {
                let file = repo().join(format!("testdata/node-local-dns/{name}.yaml"));
                std::fs::read_to_string(&file).expect("testdata/node-local-dns")
            }
        }
    }

    fn with_components(&self) -> Vec<&'static str> {
        self.values.iter().chain(&COMPONENTS).copied().collect()
    }
}

/// kustomize's build of each rendering, filled, from a copy of manifests/ in `dir`.
fn kustomize_builds(dir: &Path) -> Vec<(&'static Rendering, String)> {
    let manifests = dir.join("manifests");
    let _ = std::fs::remove_dir_all(&manifests);
    std::fs::create_dir_all(dir).unwrap();
    let copied =
        Command::new("cp").arg("-R").arg(repo().join("manifests")).arg(&manifests).status();
    assert!(copied.expect("cp").success());

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

/// `helm template` of the chart with `values`: its objects and its `helm test` pod.
fn helm_template(values: &[&str]) -> String {
    helm_template_with(values, &[])
}

/// [`helm_template`], with values read from files too (`--set-file KEY=PATH`).
fn helm_template_with(values: &[&str], files: &[String]) -> String {
    let out = helm()
        .args(["template", "nodelocaldns-ha"])
        .arg(chart())
        .args(["--namespace", "kube-system"])
        .args(set(values))
        .args(files.iter().flat_map(|f| ["--set-file", f]))
        .output()
        .expect("helm (ci/k8s/build.sh helm)");
    assert!(out.status.success(), "helm template {values:?} {files:?}: {}", describe(&out));
    String::from_utf8(out.stdout).unwrap()
}

/// A self-signed serving certificate for the webhook's Service, as manifests/README.md makes
/// one, in `dir`: the `--set-file` arguments of `webhook.certificate=provided`.
fn webhook_certificate(dir: &Path) -> Vec<String> {
    std::fs::create_dir_all(dir).unwrap();
    let (crt, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    let out = Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"])
        .args(["-days", "2", "-subj", "/CN=nodelocaldns-ha-webhook"])
        .args(["-addext", "subjectAltName=DNS:nodelocaldns-ha-webhook.nodelocaldns-ha.svc"])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&crt)
        .output()
        .expect("openssl");
    assert!(out.status.success(), "openssl: {}", describe(&out));
    let (crt, key) = (crt.display(), key.display());
    vec![
        format!("webhook.tls.crt={crt}"),
        format!("webhook.tls.key={key}"),
        format!("webhook.tls.ca={crt}"),
    ]
}

/// An object's identity: kind, namespace, name.
type Id = (String, String, String);

/// YAML documents parsed, by (kind, namespace, name).
fn objects(yaml: &str) -> BTreeMap<Id, Value> {
    serde_norway::Deserializer::from_str(yaml)
        .map(|doc| Value::deserialize(doc).expect("YAML"))
        .filter(|doc| !doc.is_null())
        .map(|doc| {
            let at = |p: &str| doc.pointer(p).and_then(Value::as_str).unwrap_or("").to_owned();
            ((at("/kind"), at("/metadata/namespace"), at("/metadata/name")), doc)
        })
        .collect()
}

/// What an install creates: the objects but Helm's hooks (the `helm test` pod).
fn installed(objects: BTreeMap<Id, Value>) -> BTreeMap<Id, Value> {
    let hook = |o: &Value| o.pointer("/metadata/annotations/helm.sh~1hook").is_some();
    objects.into_iter().filter(|(_, o)| !hook(o)).collect()
}

/// The labels the chart adds to kustomize's objects, for Helm's tools: taken out again.
const HELM_LABELS: [&str; 4] = [
    "helm.sh/chart",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
];

fn without_helm_labels(mut object: Value) -> Value {
    for at in ["/metadata/labels", "/spec/template/metadata/labels"] {
        if let Some(labels) = object.pointer_mut(at).and_then(Value::as_object_mut) {
            labels.retain(|k, _| !HELM_LABELS.contains(&k.as_str()));
        }
    }
    object
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
    for (r, kustomized) in built {
        let want = objects(&kustomized);
        let got: BTreeMap<Id, Value> = installed(objects(&helm_template(r.values)))
            .into_iter()
            .map(|(id, o)| (id, without_helm_labels(o)))
            .collect();
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

/// Every object the chart renders carries Helm's labels and the app.kubernetes.io name; the
/// agent's selector is the manifests' (immutable: an upgrade must not change it).
#[test]
fn every_object_the_chart_renders_is_labelled_and_the_selector_is_the_manifests() {
    let every = [&["clusterDNSIP=10.96.0.10", "webhook.enabled=true"][..], &COMPONENTS];
    let values: Vec<&str> = every.concat();
    let rendered = objects(&helm_template(&values));
    for (id, object) in &rendered {
        let labels = object["metadata"]["labels"].as_object().expect("labels");
        for key in HELM_LABELS.iter().chain(&["app.kubernetes.io/name"]) {
            assert!(labels.contains_key(*key), "{id:?}: no {key}: {labels:?}");
        }
    }
    let id = ("DaemonSet".into(), "kube-system".into(), "nodelocaldns-ha".into());
    let selector = &rendered[&id]["spec"]["selector"];
    assert_eq!(selector, &serde_json::json!({"matchLabels": {"k8s-app": "nodelocaldns-ha"}}));
}

#[test]
fn helm_lint_passes_and_bad_values_are_refused() {
    let mut lint: Vec<Vec<&str>> = RENDERINGS.iter().map(|r| r.values.to_vec()).collect();
    lint.extend(FLAVOURS.iter().map(Flavour::with_components));
    for values in &lint {
        let out = helm().args(["lint", "--strict"]).arg(chart()).args(set(values)).output();
        let out = out.expect("helm");
        assert!(out.status.success(), "helm lint {values:?}: {}", describe(&out));
    }
    // What an operator gets wrong, refused with what is wrong or what to do; nothing rendered.
    // The schema's (values.schema.json) first, then the templates'.
    let refused = [
        (&["shape=Ipvs"][..], "at '/shape': value must be one of '', 'ClusterIP', 'LinkLocal'"),
        (&["nodeLocalDNS.flavor=kops"][..], "value must be one of 'upstream', 'deliveryhero'"),
        (&["clusterDNSIP=10.96.0"][..], "'10.96.0' is not valid ipv4"),
        (&["clusterDnsIP=10.96.0.10"][..], "additional properties 'clusterDnsIP' not allowed"),
        (&["metricsPort=0"][..], "at '/metricsPort': minimum"),
        (&["image.pullPolicy=Sometimes"][..], "at '/image/pullPolicy': value must be one of"),
        (&["nodeLocalDNS.upstreamService=Kube_DNS"][..], "at '/nodeLocalDNS/upstreamService'"),
        (
            &["clusterReports.startupTaintTimeout=soon"][..],
            "at '/clusterReports/startupTaintTimeout'",
        ),
        (&["clusterReports.ownNodeOnly=yes"][..], "at '/clusterReports/ownNodeOnly'"),
        (&[][..], "clusterDNSIP: the ClusterIP shape needs the kube-dns ClusterIP"),
        (&["nodeLocalDNS.flavor=deliveryhero"][..], "the ClusterIP shape needs the kube-dns"),
        (
            &["shape=LinkLocal", "clusterReports.startupTaint=true"][..],
            "needs clusterReports.enabled",
        ),
        (
            &["nodeLocalDNS.flavor=kubespray", "webhook.enabled=true"][..],
            "the kube-dns ClusterIP as their second nameserver: set clusterDNSIP",
        ),
        (
            &["clusterDNSIP=10.96.0.10", "webhook.enabled=true", "webhook.certificate=provided"][..],
            "webhook.tls.crt: webhook.certificate=provided needs the serving certificate",
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
    // The admission policy's API is GA from 1.30: older clusters are told to turn it off.
    let reports = ["clusterDNSIP=10.96.0.10", "clusterReports.enabled=true"];
    let on_1_29 = |values: &[&str]| {
        let mut cmd = helm();
        cmd.args(["template", "x", "--kube-version", "1.29.0"]).arg(chart()).args(set(values));
        cmd.output().unwrap()
    };
    let out = on_1_29(&reports);
    let says = "clusterReports.ownNodeOnly needs Kubernetes 1.30 or later";
    assert!(!out.status.success() && describe(&out).contains(says), "{}", describe(&out));
    let out = on_1_29(&[&reports[..], &["clusterReports.ownNodeOnly=false"]].concat());
    assert!(out.status.success(), "{}", describe(&out));
}

/// Each flavour's preset: node-local-dns's names and addresses, and the agent's settings and
/// RBAC naming its upstream Service.
#[test]
fn each_flavour_names_its_upstream_service_and_addresses() {
    for f in &FLAVOURS {
        let rendered = objects(&helm_template(&f.with_components()));
        let ds = &rendered[&("DaemonSet".into(), "kube-system".into(), "nodelocaldns-ha".into())];
        let env = &ds["spec"]["template"]["spec"]["containers"][0]["env"];
        let var = |name: &str| {
            let found = env.as_array().unwrap().iter().find(|v| v["name"] == name);
            found.and_then(|v| v["value"].as_str()).map(str::to_owned)
        };
        assert_eq!(var("NODELOCALDNS_HA_UPSTREAM_SVC").as_deref(), Some(f.upstream_service));
        assert_eq!(var("NODELOCALDNS_HA_LOCAL_IP").as_deref(), Some(f.addresses[0]), "{}", f.name);
        assert_eq!(var("NODELOCALDNS_HA_CLUSTER_DNS_IP").as_deref(), f.addresses.get(1).copied());
        let role =
            &rendered[&("Role".into(), "kube-system".into(), "nodelocaldns-ha-upstream".into())];
        assert_eq!(role["rules"][0]["resourceNames"], serde_json::json!([f.upstream_service]));
        let test = &rendered[&("Pod".into(), "kube-system".into(), "nodelocaldns-ha-test".into())];
        let probed: Vec<&str> = test["spec"]["containers"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|c| c["args"].as_array())
            .filter(|a| a[0] == "probe")
            .map(|a| a[2].as_str().unwrap())
            .collect();
        assert_eq!(probed, f.addresses, "{}: the helm test asks what pods ask", f.name);
    }
}

#[test]
fn every_rendering_passes_a_server_side_dry_run() {
    let node = SimNode::up_with(&["--kube-proxy", "real-iptables"]);
    let mut renderings: Vec<(String, String)> = kustomize_builds(&node.dir)
        .into_iter()
        .map(|(r, yaml)| (format!("kustomize {}", r.name), yaml))
        .collect();
    for r in &RENDERINGS {
        renderings.push((format!("chart {}", r.name), helm_template(r.values)));
    }
    for f in &FLAVOURS {
        renderings.push((format!("chart, {} preset", f.name), helm_template(f.values)));
        let values = f.with_components();
        renderings.push((format!("chart, {} with components", f.name), helm_template(&values)));
    }
    // The webhook without cert-manager: its Secret and caBundle from the values.
    let provided =
        ["clusterDNSIP=10.96.0.10", "webhook.enabled=true", "webhook.certificate=provided"];
    let files = webhook_certificate(&node.dir.join("webhook-tls"));
    let yaml = helm_template_with(&provided, &files);
    let webhook = &objects(&yaml)
        [&("MutatingWebhookConfiguration".into(), "".into(), "nodelocaldns-ha-webhook".into())];
    assert!(webhook["webhooks"][2]["clientConfig"]["caBundle"].is_string(), "{webhook}");
    renderings.push(("chart, the webhook's certificate provided".to_owned(), yaml));
    // The hooks: the `helm test` pods, whose ServiceAccount (the agent's) a dry run of the same
    // rendering does not create, and the pre-delete hook's Job and RBAC: dry-run after it is
    // there, as `helm test` runs after the install.
    let mut hooks = Vec::new();
    for (name, yaml) in &mut renderings {
        let all = objects(yaml);
        let kept = installed(all.clone());
        hooks.extend(
            all.into_iter()
                .filter(|(id, _)| !kept.contains_key(id))
                .map(|(_, o)| (format!("{name}, its hook"), serde_json::to_string(&o).unwrap())),
        );
        *yaml = kept.values().map(|o| serde_json::to_string(o).unwrap() + "\n---\n").collect();
    }
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
    let account = std::fs::read_to_string(repo().join("manifests/base/serviceaccount.yaml"));
    let out = kubectl(&node, &["apply", "-f", "-"], &account.unwrap());
    assert!(out.status.success(), "the agent's ServiceAccount: {}", describe(&out));
    assert!(!hooks.is_empty());
    for (name, pod) in &hooks {
        let out = kubectl(&node, &["apply", "--dry-run=server", "-f", "-"], pod);
        assert!(out.status.success(), "{name}: the API server refused it: {}", describe(&out));
    }
    println!("{} hook objects accepted (helm test pods, the pre-delete hook's)", hooks.len());
    // Nothing was stored: the agent's DaemonSet is not there.
    let out = kubectl(&node, &["-n", "kube-system", "get", "daemonset", "nodelocaldns-ha"], "");
    assert!(!out.status.success(), "a dry run stored the DaemonSet: {}", describe(&out));
}

/// The kinds the chart makes, as kubectl names them.
const KINDS: &str = "serviceaccounts,services,daemonsets,deployments,poddisruptionbudgets,\
                     configmaps,secrets,roles,rolebindings,clusterroles,clusterrolebindings,\
                     namespaces,podmonitors,prometheusrules,issuers,certificates,\
                     mutatingwebhookconfigurations,validatingadmissionpolicies,\
                     validatingadmissionpolicybindings";

/// What the API server holds of release `release`: every object of the chart's kinds that
/// Helm marked as the release's (its `meta.helm.sh/release-name` annotation), by id.
fn released(node: &SimNode, release: &str) -> BTreeMap<Id, Value> {
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

/// `helm ARGS` against the node's API server, as its admin: its output, whatever its status.
fn try_helm_on(node: &SimNode, args: &[&str], values: &[&str]) -> Output {
    let mut command = node.cmd("node", real_bin().join("helm").to_str().unwrap());
    command.args(args).arg("--kubeconfig").arg(node.dir.join("admin.kubeconfig")).args(set(values));
    command.output().expect("helm")
}

/// [`try_helm_on`], which must succeed: its standard output.
fn helm_on(node: &SimNode, args: &[&str], values: &[&str]) -> String {
    let out = try_helm_on(node, args, values);
    assert!(out.status.success(), "helm {args:?} {values:?}: {}", describe(&out));
    String::from_utf8(out.stdout).unwrap()
}

/// The env of the agent's container in the DaemonSet the API server holds, by name.
fn agent_env(objects: &BTreeMap<Id, Value>) -> Vec<String> {
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
    let components: Vec<&str> = plain.iter().chain(&COMPONENTS).copied().collect();
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
        let rendered = installed(objects(&helm_template(values)));
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

/// Each of `ids` as the API server holds it, whole (resourceVersion, uid, managedFields: any
/// write shows).
fn held(node: &SimNode, ids: &[Id]) -> Vec<Value> {
    ids.iter()
        .map(|(kind, namespace, name)| {
            let what = format!("{kind}/{name}");
            let out = kubectl(node, &["-n", namespace, "get", &what, "-o", "json"], "");
            assert!(out.status.success(), "{what}: {}", describe(&out));
            serde_json::from_slice(&out.stdout).unwrap()
        })
        .collect()
}

/// `script` run by bash from the repository's root, in the node's namespace, with the real
/// kubectl first on PATH and the admin's kubeconfig: as an operator runs what they are shown.
fn operator(node: &SimNode, script: &str) -> Output {
    let path = format!("{}:{}", real_bin().display(), std::env::var("PATH").unwrap_or_default());
    node.cmd("node", "bash")
        .args(["-euo", "pipefail", "-c", script])
        .current_dir(repo())
        .env("PATH", path)
        .env("KUBECONFIG", node.dir.join("admin.kubeconfig"))
        .output()
        .expect("bash")
}

/// The `kubectl patch` commands of an install's NOTES (a command may span lines, `$(` to `)`),
/// before its removal.
fn notes_patches(notes: &str) -> String {
    let mut script = String::new();
    let mut open = false;
    for line in notes.lines().take_while(|l| !l.starts_with("Remove it")) {
        let line = line.trim();
        if line.starts_with("kubectl") && line.contains(" patch ") || open {
            script += line;
            script += "\n";
            open = line.ends_with("$(") || (open && !line.ends_with(')') && !line.ends_with(")\""));
        }
    }
    assert!(script.matches("kubectl").count() == 2, "the NOTES' two patches:\n{notes}");
    script
}

/// The NOTES' removal of node-local-dns's patches: the indented lines under "Remove it", up
/// to the `helm uninstall`.
fn notes_removal(notes: &str) -> String {
    let lines = notes.lines().skip_while(|l| !l.starts_with("Remove it")).skip(1);
    let lines = lines.take_while(|l| l.starts_with("  ") && !l.contains("helm uninstall"));
    let script: String = lines.map(|l| format!("{}\n", &l[2..])).collect();
    assert_eq!(script.matches("kubectl").count(), 3, "the NOTES' removal:\n{notes}");
    script
}

/// manifests/README.md's removal of the patches: its "Removing" section's first `sh` block.
fn readme_removal() -> String {
    let readme = std::fs::read_to_string(repo().join("manifests/README.md")).unwrap();
    let section = readme.split("\n## ").find(|s| s.starts_with("Removing")).expect("Removing");
    let block = section.split("```sh\n").nth(1).expect("an sh block");
    block[..block.find("```").expect("the block ends")].to_owned()
}

/// For each flavour, on the real API server: the install's checks refuse what would not work;
/// `helm install` with its preset and every component, then `helm uninstall`, leave every
/// object of node-local-dns exactly as it was; the NOTES' patches, the NOTES' removal and
/// manifests/README.md's removal change its DaemonSet as they say.
#[test]
fn each_flavour_installs_and_uninstalls_leaving_node_local_dns_as_it_was() {
    let node = SimNode::up_with(&["--kube-proxy", "real-iptables"]);
    install_crds(&node);
    let chart = chart();
    let install = ["install", "nlha", chart.to_str().unwrap(), "--namespace", "kube-system"];
    // No controller runs here: the pre-delete hook's Job (clusterReports' uninstall) would never
    // end. The real node runs it (tests/e2e_kubelet.rs, helm_uninstall_loses_no_lookup).
    let uninstall = ["uninstall", "nlha", "--namespace", "kube-system", "--no-hooks"];
    let refused = |values: &[&str], says: &str| {
        let out = try_helm_on(&node, &install, values);
        let text = describe(&out);
        assert!(!out.status.success() && text.contains(says), "{values:?}: {text}");
        println!("refused, as it should be: {}", text.lines().find(|l| l.contains(says)).unwrap());
        assert!(released(&node, "nlha").is_empty(), "a refused install left objects");
    };
    // Upstream last: the test bed's kube-dns-upstream is there from the start.
    for f in FLAVOURS.iter().rev() {
        println!("--- {}", f.name);
        let theirs = f.objects();
        let ids: Vec<Id> = objects(&theirs).into_keys().collect();
        let values = f.with_components();
        if f.name != "upstream" {
            let missing = format!("Service kube-system/{} not found", f.upstream_service);
            refused(&values, &missing);
        }
        let out = kubectl(&node, &["apply", "-f", "-"], &theirs);
        assert!(out.status.success(), "{}'s objects: {}", f.name, describe(&out));
        if f.name == "deliveryhero" {
            // Its own default, bindIp=false: every server block binds 0.0.0.0.
            let wildcard = theirs.replace("bind 169.254.20.25 10.96.0.10", "bind 0.0.0.0");
            let out = kubectl(&node, &["apply", "-f", "-"], &wildcard);
            assert!(out.status.success(), "{}", describe(&out));
            refused(&values, "binds the wildcard address");
            let out = kubectl(&node, &["apply", "-f", "-"], &theirs);
            assert!(out.status.success(), "{}", describe(&out));
            // Another flavour's addresses: not what its node-cache listens on.
            refused(&FLAVOURS[0].with_components(), "not on 169.254.20.10");
        }
        let before = held(&node, &ids);

        let notes = helm_on(&node, &install, &values);
        let rendered = installed(objects(&helm_template(&values)));
        let ours = released(&node, "nlha");
        assert_eq!(ours.keys().collect::<Vec<_>>(), rendered.keys().collect::<Vec<_>>());
        assert!(ids.iter().all(|id| !ours.contains_key(id)), "the release took one of theirs");
        assert!(notes.contains(&format!("Found DaemonSet kube-system/{}", f.daemonset)), "{notes}");
        helm_on(&node, &uninstall, &[]);
        assert!(released(&node, "nlha").is_empty(), "left after uninstall");
        assert_eq!(held(&node, &ids), before, "{}: node-local-dns's objects changed", f.name);
        println!("{}: {} objects of node-local-dns, untouched", f.name, ids.len());

        // The NOTES' patches, as an operator runs them, then the README's removal.
        let id = ("DaemonSet".to_owned(), "kube-system".to_owned(), f.daemonset.to_owned());
        let pod = |ds: &Value| ds["spec"]["template"]["spec"].clone();
        let original = pod(&held(&node, std::slice::from_ref(&id))[0]);
        let out = operator(&node, &notes_patches(&notes));
        assert!(out.status.success(), "{}: the NOTES' patches: {}", f.name, describe(&out));
        let patched = pod(&held(&node, std::slice::from_ref(&id))[0]);
        let cache = &patched["containers"][0];
        let args: Vec<&str> =
            cache["args"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
        assert!(args.ends_with(&["-setupiptables=false", "-skipteardown"]), "{args:?}");
        let command = &cache["lifecycle"]["preStop"]["exec"]["command"];
        assert!(command.as_array().unwrap().contains(&"drain".into()), "{command}");
        assert_eq!(patched["initContainers"][0]["image"], IMAGE, "the agent's image");
        assert_eq!(patched["terminationGracePeriodSeconds"], 30);

        // The NOTES' removal, as printed; then the patches again, and the README's removal.
        let removals = [
            ("the NOTES' removal", notes_removal(&notes)),
            ("the README's removal", format!("DS={}\n{}", f.daemonset, readme_removal())),
        ];
        for (i, (what, script)) in removals.iter().enumerate() {
            if i > 0 {
                let out = operator(&node, &notes_patches(&notes));
                assert!(out.status.success(), "{}: the NOTES' patches: {}", f.name, describe(&out));
            }
            let out = operator(&node, script);
            assert!(out.status.success(), "{}: {what}: {}", f.name, describe(&out));
            let mut removed = pod(&held(&node, std::slice::from_ref(&id))[0]);
            // What stays: an empty `lifecycle` where there was none, and the grace period the
            // drain needed (kubespray's 0 comes back with its next run).
            let lifecycle = removed["containers"][0].as_object_mut().unwrap().remove("lifecycle");
            assert_eq!(lifecycle, Some(serde_json::json!({})), "{what}");
            removed["terminationGracePeriodSeconds"] =
                original["terminationGracePeriodSeconds"].clone();
            assert_eq!(removed, original, "{}: {what} left the patch's changes", f.name);
        }

        if f.name == "deliveryhero" {
            // Upstream's manifest has objects of the same names.
            let out = kubectl(&node, &["delete", "-f", "-"], &theirs);
            assert!(out.status.success(), "{}", describe(&out));
        }
    }
}

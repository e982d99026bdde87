//! The webhook on a real kube-apiserver (issue 32, acceptance 1): the simulated node's real
//! control plane (`--kube-proxy real-iptables`, issue 31) calls the webhook binary, which runs
//! in the node's namespace as a webhook pod would on a node, registered by the project's own
//! MutatingWebhookConfiguration applied with kubectl (its Service reference replaced by the
//! webhook's URL and CA, as the test bed has no Service routing for the API server). Pods are
//! created as a ReplicaSet creates them (`generateName`), and the pod the API server stored is
//! read back.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair, SanType};
use serde_json::{json, Value};
use testkit::{describe, require_root, wait_for, SimNode};

/// The node's address on its link to the control plane: where the API server reaches the
/// webhook.
const WEBHOOK_IP: &str = "10.240.0.1";
const WEBHOOK_ADDR: &str = "10.240.0.1:18443";
const MANIFEST: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../manifests/webhook/mutatingwebhookconfiguration.yaml"
);

struct Ca(CertifiedIssuer<'static, KeyPair>);

impl Ca {
    fn new() -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        Ca(CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap())
    }

    /// A serving certificate for [`WEBHOOK_IP`], written to `dir` as cert-manager's Secret
    /// volume has it (`..data` flipped to a new directory).
    fn issue(&self, dir: &Path, generation: u32) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.subject_alt_names = vec![SanType::IpAddress(WEBHOOK_IP.parse().unwrap())];
        let cert = params.signed_by(&key, &self.0).unwrap();
        let data = dir.join(format!("..gen{generation}"));
        fs::create_dir_all(&data).unwrap();
        fs::write(data.join("tls.crt"), cert.pem()).unwrap();
        fs::write(data.join("tls.key"), key.serialize_pem()).unwrap();
        let tmp = dir.join("..data_tmp");
        let _ = fs::remove_file(&tmp);
        std::os::unix::fs::symlink(data.file_name().unwrap(), &tmp).unwrap();
        fs::rename(&tmp, dir.join("..data")).unwrap();
        for file in ["tls.crt", "tls.key"] {
            if !dir.join(file).exists() {
                std::os::unix::fs::symlink(format!("..data/{file}"), dir.join(file)).unwrap();
            }
        }
    }
}

/// The webhook binary in the node's namespace, its log in a file.
struct Webhook {
    child: Child,
    log: PathBuf,
}

impl Webhook {
    fn start(node: &SimNode, tls: &Path, nameservers: &str) -> Self {
        let log = unique(node.dir.join("webhook"));
        let child = node
            .cmd("node", env!("CARGO_BIN_EXE_nodelocaldns-ha-webhook"))
            .args(["--listen", WEBHOOK_ADDR, "--metrics-listen", "127.0.0.1:19254"])
            .args(["--nameserver", nameservers])
            .arg("--tls-cert-file")
            .arg(tls.join("tls.crt"))
            .arg("--tls-key-file")
            .arg(tls.join("tls.key"))
            .env("NO_COLOR", "1")
            .stderr(Stdio::from(fs::File::create(&log).unwrap()))
            .spawn()
            .unwrap();
        let hook = Webhook { child, log };
        hook.wait_log("serving", 1);
        hook
    }

    /// Waits until the log has `n` lines containing `text`.
    fn wait_log(&self, text: &str, n: usize) {
        wait_for(&format!("{n} × {text:?} in the webhook's log"), Duration::from_secs(10), || {
            let log = fs::read_to_string(&self.log).unwrap_or_default();
            (log.lines().filter(|l| l.contains(text)).count() >= n).then_some(())
        });
    }

    fn stop(mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        assert!(self.child.wait().unwrap().success());
    }
}

impl Drop for Webhook {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn unique(path: PathBuf) -> PathBuf {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    path.with_extension(format!("{n}.log"))
}

/// kubectl with `input` on its standard input; its standard output, or a panic saying why not.
fn kubectl(node: &SimNode, args: &[&str], input: &str) -> String {
    let mut child = node
        .kubectl()
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "kubectl {args:?}: {}", describe(&out));
    String::from_utf8(out.stdout).unwrap()
}

/// The project's MutatingWebhookConfiguration, calling `url` and trusting `ca` (PEM).
fn configuration(url: &str, ca: &str) -> Value {
    let text = fs::read_to_string(MANIFEST).unwrap();
    let mut doc: Value = serde_norway::from_str(&text).unwrap();
    let bundle = base64(ca.as_bytes());
    for hook in doc["webhooks"].as_array_mut().unwrap() {
        hook["clientConfig"] = json!({"url": url, "caBundle": bundle});
    }
    doc
}

/// A pod as a ReplicaSet creates it, with `spec` merged into a minimal spec; the stored pod.
fn create_pod(node: &SimNode, namespace: &str, labels: Value, spec: Value) -> Value {
    let mut pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "web-", "namespace": namespace, "labels": labels},
        "spec": {"containers": [{"name": "web", "image": "registry.k8s.io/pause:3.10"}]},
    });
    for (k, v) in spec.as_object().unwrap() {
        pod["spec"][k] = v.clone();
    }
    let out = kubectl(node, &["create", "-f", "-", "-o", "json"], &pod.to_string());
    serde_json::from_str(&out).unwrap()
}

fn cluster_config(namespace: &str, nameservers: &[&str]) -> Value {
    json!({
        "nameservers": nameservers,
        "searches": [format!("{namespace}.svc.cluster.local"), "svc.cluster.local", "cluster.local"],
        "options": [{"name": "ndots", "value": "3"}, {"name": "attempts", "value": "2"},
                    {"name": "timeout", "value": "1"}],
    })
}

/// Asserts that the stored `pod` was mutated to `config`, or left as created.
fn assert_dns(pod: &Value, policy: &str, config: Option<&Value>, what: &str) {
    let spec = &pod["spec"];
    assert_eq!(spec["dnsPolicy"], policy, "{what}: {spec}");
    match config {
        Some(config) => {
            assert_eq!(&spec["dnsConfig"], config, "{what}");
            assert_eq!(
                pod["metadata"]["annotations"]["nodelocaldns-ha.io/dns"], "injected",
                "{what}"
            );
        }
        None => assert!(
            pod["metadata"]["annotations"].get("nodelocaldns-ha.io/dns").is_none(),
            "{what}: {pod}"
        ),
    }
}

const NODE_LOCAL: &str = "169.254.20.10";
const KUBE_DNS: &str = "10.96.0.10";

#[test]
fn pods_created_through_the_real_api_server_get_the_second_nameserver() {
    require_root();
    let node = SimNode::up_with(&["--kube-proxy", "real-iptables"]);
    let tls = node.dir.join("webhook-tls");
    fs::create_dir_all(&tls).unwrap();
    let ca = Ca::new();
    ca.issue(&tls, 1);
    let hook = Webhook::start(&node, &tls, &format!("{NODE_LOCAL},{KUBE_DNS}"));
    let url = format!("https://{WEBHOOK_ADDR}/mutate");
    kubectl(&node, &["apply", "-f", "-"], &configuration(&url, &ca.0.pem()).to_string());

    // Namespaces: ours, ACK's label, none; kube-system labelled too (excluded by the selector).
    // Each with the service account a controller-manager would have made.
    let namespaces = [
        ("injected", json!({"nodelocaldns-ha.io/dns-injection": "enabled"})),
        ("ack", json!({"node-local-dns-injection": "enabled"})),
        ("plain", json!({})),
    ];
    for (name, labels) in &namespaces {
        let ns = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": labels}});
        kubectl(&node, &["create", "-f", "-"], &ns.to_string());
        kubectl(&node, &["create", "serviceaccount", "default", "-n", name], "");
    }
    kubectl(
        &node,
        &["label", "namespace", "kube-system", "nodelocaldns-ha.io/dns-injection=enabled"],
        "",
    );
    kubectl(&node, &["create", "serviceaccount", "default", "-n", "kube-system"], "");
    // The API server calls a webhook only once its configuration is in its informer: wait for
    // the first mutated pod.
    wait_for("the API server calling the webhook", Duration::from_secs(30), || {
        let pod = create_pod(&node, "injected", json!({}), json!({}));
        (pod["spec"]["dnsPolicy"] == "None").then_some(())
    });

    let ours = cluster_config("injected", &[NODE_LOCAL, KUBE_DNS]);
    let pod = create_pod(&node, "injected", json!({"app": "web"}), json!({}));
    assert_dns(&pod, "None", Some(&ours), "ClusterFirst (the default)");
    let pod =
        create_pod(&node, "injected", json!({}), json!({"dnsPolicy": "ClusterFirstWithHostNet"}));
    assert_dns(&pod, "None", Some(&ours), "ClusterFirstWithHostNet, pod network");
    let own = json!({
        "nameservers": ["10.0.0.53"],
        "searches": ["corp.example"],
        "options": [{"name": "ndots", "value": "2"}, {"name": "edns0"}],
    });
    let pod = create_pod(&node, "injected", json!({}), json!({"dnsConfig": own}));
    let merged = json!({
        "nameservers": [NODE_LOCAL, KUBE_DNS, "10.0.0.53"],
        "searches": ["injected.svc.cluster.local", "svc.cluster.local", "cluster.local", "corp.example"],
        "options": [{"name": "ndots", "value": "2"}, {"name": "attempts", "value": "2"},
                    {"name": "timeout", "value": "1"}, {"name": "edns0"}],
    });
    assert_dns(&pod, "None", Some(&merged), "its own dnsConfig, merged");
    let pod = create_pod(&node, "injected", json!({}), json!({"dnsPolicy": "Default"}));
    assert_dns(&pod, "Default", None, "dnsPolicy Default");
    let none = json!({"nameservers": ["10.0.0.53"]});
    let pod =
        create_pod(&node, "injected", json!({}), json!({"dnsPolicy": "None", "dnsConfig": none}));
    assert_dns(&pod, "None", None, "dnsPolicy None");
    assert_eq!(pod["spec"]["dnsConfig"], none);
    let host = json!({"hostNetwork": true, "dnsPolicy": "ClusterFirstWithHostNet"});
    let pod = create_pod(&node, "injected", json!({}), host);
    assert_dns(&pod, "ClusterFirstWithHostNet", None, "host network");
    let out = json!({"nodelocaldns-ha.io/dns-injection": "disabled"});
    let pod = create_pod(&node, "injected", out, json!({}));
    assert_dns(&pod, "ClusterFirst", None, "opted out");
    let pod = create_pod(&node, "ack", json!({}), json!({}));
    assert_dns(&pod, "None", Some(&cluster_config("ack", &[NODE_LOCAL, KUBE_DNS])), "ACK's label");
    let pod = create_pod(&node, "plain", json!({}), json!({}));
    assert_dns(&pod, "ClusterFirst", None, "a namespace not labelled");
    let pod = create_pod(&node, "kube-system", json!({}), json!({}));
    assert_dns(&pod, "ClusterFirst", None, "kube-system, labelled");

    // The certificate rotated under the running webhook: picked up, and the API server still
    // calls it (it verifies every new connection against the same CA).
    ca.issue(&tls, 2);
    hook.wait_log("reloaded", 1);
    for _ in 0..3 {
        let pod = create_pod(&node, "injected", json!({}), json!({}));
        assert_dns(&pod, "None", Some(&ours), "after the rotation");
    }

    // The webhook stopped: pods are still created, as they are (failurePolicy Ignore), well
    // within the configuration's 2 s.
    hook.stop();
    let started = Instant::now();
    let pod = create_pod(&node, "injected", json!({}), json!({}));
    assert_dns(&pod, "ClusterFirst", None, "the webhook stopped");
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());

    // Dual-stack kube-dns: both its addresses after the node-local IP; a pod's own nameserver
    // then leaves no room, and the pod is left alone rather than trimmed.
    let hook = Webhook::start(&node, &tls, &format!("{NODE_LOCAL},{KUBE_DNS},fd00:10:96::a"));
    wait_for("the restarted webhook called", Duration::from_secs(10), || {
        let pod = create_pod(&node, "injected", json!({}), json!({}));
        (pod["spec"]["dnsPolicy"] == "None").then_some(pod)
    });
    let dual = cluster_config("injected", &[NODE_LOCAL, KUBE_DNS, "fd00:10:96::a"]);
    let pod = create_pod(&node, "injected", json!({}), json!({}));
    assert_dns(&pod, "None", Some(&dual), "dual-stack kube-dns");
    let pod = create_pod(&node, "injected", json!({}), json!({"dnsConfig": own}));
    assert_dns(&pod, "ClusterFirst", None, "dual-stack, its own nameserver too");
    hook.stop();
    drop(node);
}

/// Standard base64 (RFC 4648), as a caBundle is written.
fn base64(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(DIGITS[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[test]
fn base64_is_rfc_4648() {
    assert_eq!(base64(b""), "");
    assert_eq!(base64(b"f"), "Zg==");
    assert_eq!(base64(b"fo"), "Zm8=");
    assert_eq!(base64(b"foo"), "Zm9v");
    assert_eq!(base64(b"foobar"), "Zm9vYmFy");
}

//! The webhook on a real kube-apiserver: the simulated node's real
//! control plane (`--kube-proxy real-iptables`) calls the webhook binary, which runs
//! in the node's namespace as a webhook pod would on a node, registered by the project's own
//! MutatingWebhookConfiguration applied with kubectl (its Service reference replaced by the
//! webhook's URL and CA, as the test bed has no Service routing for the API server). Pods are
//! created as a ReplicaSet creates them (`generateName`), and the pod the API server stored is
//! read back.

mod common;

use std::fs;
use std::time::{Duration, Instant};

use common::{configuration, kubectl, namespace, publish, Ca, Webhook, WEBHOOK_ADDR, WEBHOOK_IP};
use rcgen::SanType;
use serde_json::{json, Value};
use testkit::{require_root, wait_for, SimNode};

/// A serving certificate for the webhook's address, from `ca`, as generation `generation` of
/// the Secret volume in `dir`.
fn issue(ca: &Ca, dir: &std::path::Path, generation: u32) {
    let (cert, _, key) = ca.leaf(SanType::IpAddress(WEBHOOK_IP.parse().unwrap()));
    publish(dir, generation, &cert, &key);
}

/// Creates `pod` through the API; the pod the API server stored.
fn create(node: &SimNode, pod: Value) -> Value {
    let out = kubectl(node, &["create", "-f", "-", "-o", "json"], &pod.to_string());
    serde_json::from_slice(&out.stdout).unwrap()
}

fn create_pod(node: &SimNode, namespace: &str, labels: Value, spec: Value) -> Value {
    create(node, common::pod(namespace, labels, spec))
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
    issue(&ca, &tls, 1);
    let hook = Webhook::start(&node, &tls, &format!("{NODE_LOCAL},{KUBE_DNS}"));
    let url = format!("https://{WEBHOOK_ADDR}/mutate");
    kubectl(&node, &["apply", "-f", "-"], &configuration(&url, &ca.pem()).to_string());

    // Namespaces: ours, ACK's label, none; kube-system labelled too (excluded by the selector).
    // Each with the service account a controller-manager would have made.
    let namespaces = [
        ("injected", json!({"nodelocaldns-ha.io/dns-injection": "enabled"})),
        ("ack", json!({"node-local-dns-injection": "enabled"})),
        ("plain", json!({})),
    ];
    for (name, labels) in namespaces {
        namespace(&node, name, labels);
    }
    kubectl(
        &node,
        &["label", "namespace", "kube-system", "nodelocaldns-ha.io/dns-injection=enabled"],
        "",
    );
    kubectl(&node, &["create", "serviceaccount", "default", "-n", "kube-system"], "");
    // The DNS egress example of manifests/examples, accepted by the API server.
    let policy = fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../manifests/examples/networkpolicy-dns-egress.yaml"
    ))
    .unwrap();
    kubectl(&node, &["apply", "--dry-run=server", "-n", "injected", "-f", "-"], &policy);
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
    issue(&ca, &tls, 2);
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

#[test]
fn base64_is_rfc_4648() {
    use common::base64;
    assert_eq!(base64(b""), "");
    assert_eq!(base64(b"f"), "Zg==");
    assert_eq!(base64(b"fo"), "Zm8=");
    assert_eq!(base64(b"foo"), "Zm9v");
    assert_eq!(base64(b"foobar"), "Zm9vYmFy");
}

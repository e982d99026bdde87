//! End to end on a simulated node with real Kubernetes parts (issue 31), built by
//! `ci/k8s/build.sh`: etcd and kube-apiserver on a control-plane namespace of their own, real
//! kube-proxy (iptables mode, iptables-nft; or nftables mode) in the node's namespace writing its own rules from
//! the Services and EndpointSlices created through the API, real CoreDNS (the kubernetes plugin
//! reading the API server) at the kube-dns endpoints. The node-local cache is still unbound:
//! node-cache cannot be had here (the Go module proxy refuses k8s.io/dns: 403).
//!
//! A real part that does not build or start fails `simnode.sh up` naming the part and its log's
//! tail, and so the test: never a skip, never a stand-in. Each test makes its own namespaces
//! (unique prefix, `-cp` for the control plane) and removes them, whatever happens.

use testkit::*;

/// The core case on the real parts, kube-proxy in `mode` (`real-iptables`, `real-nftables`):
/// 500 lookups/s from a pod to the kube-dns ClusterIP; the cache SIGKILLed loses no lookup, real
/// CoreDNS answers through real kube-proxy's DNAT until the cache is back, then the cache again.
/// The agent's `auto` must find real kube-proxy's backend: `dataplane`.
fn cache_sigkill_loses_no_pod_lookup(mode: &str, dataplane: &str) {
    let node = SimNode::up_with(&["--kube-proxy", mode]);
    // Without the agent, the pod's query goes where real kube-proxy's DNAT sends it: CoreDNS.
    assert_eq!(node.dig("pod1", CLUSTER_DNS_IP), COREDNS_ANSWER, "real kube-proxy's DNAT");
    let agent = node.agent(&["--dataplane", "auto"]);
    let st = agent.state().expect("state");
    assert_eq!(st["dataplane"], dataplane, "{st}");
    testkit::cache_sigkill_loses_no_pod_lookup(&node, &agent);
    node.tear_down(agent);
}

#[test]
fn real_kube_proxy_iptables_cache_sigkill_loses_no_pod_lookup() {
    cache_sigkill_loses_no_pod_lookup("real-iptables", "iptables-nft");
}

#[test]
fn real_kube_proxy_nftables_cache_sigkill_loses_no_pod_lookup() {
    cache_sigkill_loses_no_pod_lookup("real-nftables", "nftables");
}

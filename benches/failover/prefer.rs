//! The `prefer-same-node` part (issue 35, part 3): the peer that Kubernetes itself now offers,
//! `trafficDistribution: PreferSameNode` (KEP-3015, GA in 1.35), beside the agent, both on the
//! node with the real parts (real kube-apiserver, kube-proxy in iptables mode and CoreDNS;
//! testdata/simnode/real.sh) in the same run as the other arrangements.
//!
//! With PreferSameNode the cache runs as an endpoint of kube-dns on every node (here at the
//! node's address, as node-local-dns's host-network pods would be), and kube-proxy sends a
//! node's queries for 10.96.0.10 to its own node's ready endpoint, to the others when it has
//! none. No NOTRACK, no agent: the fallback is the endpoint's readiness. kube-proxy's part is
//! real (its rules, its syncs, its conntrack cleanup); the kubelet's and the EndpointSlice
//! controller's are played by the test bed (`simnode.sh cache-endpoint`), on this model:
//!
//! * **kill**: the kubelet sees the container gone at its next PLEG relist (every 1 s; the
//!   endpoint is set not-ready [`KUBELET_NOTICES_MS`] after the SIGKILL, the relist's mean),
//!   and ready again as long after the restarted cache answers: node-local-dns's manifest has
//!   no readiness probe, so a running container is a ready one.
//! * **hang**: only the liveness probe can see it (node-local-dns's manifest: period 10 s and
//!   failureThreshold 3 by default, timeout 5 s), 30 s or more after the hang began: longer
//!   than the benchmark's 5 s hang, so the endpoint stays ready throughout, as it would.

use super::{Arrangement, Client, Setup, Shape};

/// How long after the SIGKILL the kubelet reports the cache's container gone, and after the
/// restart running (its PLEG relists every second: half of that on average).
pub(crate) const KUBELET_NOTICES_MS: u64 = 500;

/// The arrangements of the real parts' node: the agent first, then kube-dns reshaped.
pub(crate) const ARRANGEMENTS: &[Arrangement] = &[
    Arrangement {
        key: "real-agent",
        label: "h. agent (defaults), real kube-proxy and CoreDNS",
        shape: Shape::ClusterIp,
        setup: Setup::Agent(&[]),
        client: Client::Dnsload,
        pod: None,
    },
    Arrangement {
        key: "prefer-same-node",
        label: "i. PreferSameNode: the cache a same-node endpoint of kube-dns, no agent",
        shape: Shape::ClusterIp,
        setup: Setup::PreferSameNode,
        client: Client::Dnsload,
        pod: None,
    },
];

//! The test kit: a simulated Kubernetes node for the agent's end-to-end tests and benchmarks —
//! `testdata/simnode.sh` namespaces, the real agent binary in the node namespace, the `dnsload`
//! client (crates/dnsload) in a pod or the node — and what the tests and benchmarks read back.
//!
//! Everything a test starts is stopped by its own handle's `Drop` (by pid), and the namespaces
//! are deleted by [`SimNode`]'s `Drop`, so a failing test leaves nothing behind.
//!
//! The rooms: [`SimNode`] (the namespaces and the servers), [`Agent`] (the agent process and
//! what it logs and writes), [`Load`] (a dnsload run and its output), [`Proc`] (any other child),
//! the agent from its image ([`ContainerAgent`]), the binaries' paths ([`agent_exe`],
//! [`dnsload_exe`], [`musl_client`]), a pod's resolv.conf ([`NetnsEtc`]), a pod forging the
//! agent's lease heartbeat ([`Forger`]), waiting ([`wait_for`], [`poll`]), and what only the
//! benchmarks use ([`Machine`], [`setting`], [`median`], [`cpu_ticks`]).

#![forbid(unsafe_code)]

mod agent;
mod bench;
mod binaries;
mod cases;
mod clock;
mod forger;
mod image;
mod load;
mod netns_etc;
mod pod;
mod process;
mod realnode;
mod simnode;

pub use agent::{fallback_refused, Agent, Switch};
pub use bench::{clock_ticks_per_s, cpu_ticks, kernel_ticks, median, percentile, setting, Machine};
pub use binaries::{agent_exe, dnsload_exe, musl_client};
pub use cases::{
    cache_sigkill_loses_no_lookup_to, cache_sigkill_loses_no_pod_lookup,
    node_cache_rules_are_named, tcp_lookups_follow_the_route,
};
pub use clock::{now_ms, poll, sleep_until_ms, wait_for};
pub use forger::Forger;
pub use image::{podman, ContainerAgent};
pub use load::{
    assert_lost_to_the_kill, assert_tcp_lost_to_the_kill_or_return, assert_within,
    coredns_seen_after, field, kill_and_restart_cache, read_lookups, sent_at, summary_of, Load,
    Lookup, Outcome, Restart, ATTEMPT_TIMEOUT_MS,
};
pub use netns_etc::NetnsEtc;
pub use pod::POD;
pub use process::Proc;
pub use realnode::{counts, Cluster, PodLoad, RealNode};
pub use simnode::{
    counting_wrappers, describe, real_bin, real_parts_built, require_root, strip_counters, SimNode,
    CACHE_ANSWER, CLUSTER_DNS_IP, COREDNS_ANSWER, LOCAL_IP, UPSTREAM_IP,
};

//! nodelocaldns-ha: keeps a node's DNS alive when its node-local cache fails.
//!
//! The agent probes node-local-dns with real DNS queries ([`probe`]), decides with a pure
//! hysteresis state machine ([`health`]) which route pod queries for the cluster-DNS IP take, and
//! installs the matching NOTRACK ruleset ([`ruleset`]) through a [`dataplane`] backend in one
//! atomic batch, which the [`reconciler`] keeps installed. [`agent`] is the synchronous core that
//! ties them together; [`daemon`] runs it with its probe and watch tasks; [`sockdiag`] hears the
//! cache's sockets die, and [`stall`] sees them stop draining; [`addresses`] keeps the
//! link-local listen IPs local when node-cache deletes its interface.

// `unsafe` is denied in the whole crate and forbidden (no `allow` can undo it) in every module
// but those on the way to the reviewed places that need it: `dataplane::nftables::ffi`
// (libnftnl lacks the `fib` and `socket` expressions), `netlink::socket` (tokio registers a
// descriptor only in an `unsafe` call), `dataplane::iptables_sockopt` (x_tables' `getsockopt`)
// and `malloc` (glibc's allocator settings). tests/unsafe_confined.rs keeps it that way.
#![deny(unsafe_code)]

#[forbid(unsafe_code)]
pub mod addresses;
#[forbid(unsafe_code)]
pub mod agent;
#[forbid(unsafe_code)]
mod atomic_file;
#[forbid(unsafe_code)]
mod beat;
#[forbid(unsafe_code)]
mod blocking;
#[forbid(unsafe_code)]
pub mod cli;
pub mod cluster;
#[forbid(unsafe_code)]
pub mod config;
#[forbid(unsafe_code)]
pub mod control;
#[forbid(unsafe_code)]
pub mod daemon;
pub mod dataplane;
#[forbid(unsafe_code)]
pub mod detect;
#[forbid(unsafe_code)]
pub mod firewall;
#[forbid(unsafe_code)]
pub mod forwarder;
#[cfg(fuzzing)]
#[forbid(unsafe_code)]
pub mod fuzzing;
#[forbid(unsafe_code)]
pub mod health;
#[forbid(unsafe_code)]
pub mod hooks;
#[forbid(unsafe_code)]
pub mod maintenance;
#[allow(unsafe_code)]
pub mod malloc;
#[forbid(unsafe_code)]
pub mod metrics;
mod netlink;
#[forbid(unsafe_code)]
pub mod overrides;
#[forbid(unsafe_code)]
mod pace;
#[forbid(unsafe_code)]
pub mod probe;
#[forbid(unsafe_code)]
pub mod reconciler;
#[forbid(unsafe_code)]
pub mod ruleset;
#[forbid(unsafe_code)]
pub mod sockdiag;
#[forbid(unsafe_code)]
pub mod stall;
#[forbid(unsafe_code)]
pub mod state;
#[cfg(test)]
#[forbid(unsafe_code)]
mod testutil;
#[forbid(unsafe_code)]
pub mod upstream;
#[forbid(unsafe_code)]
mod waiting;

//! nodelocaldns-ha: keeps a node's DNS alive when its node-local cache fails.
//!
//! The agent probes node-local-dns with real DNS queries ([`probe`]), decides with a pure
//! hysteresis state machine ([`health`]) which route pod queries for the cluster-DNS IP take, and
//! installs the matching NOTRACK ruleset ([`ruleset`]) through a [`dataplane`] backend in one
//! atomic batch. [`agent`] ties them together; [`sockdiag`] hears the cache's sockets die.

#![deny(unsafe_code)]

pub mod agent;
pub mod cli;
pub mod config;
pub mod control;
pub mod dataplane;
pub mod detect;
pub mod health;
pub mod maintenance;
pub mod metrics;
pub mod probe;
pub mod ruleset;
pub mod sockdiag;
pub mod state;
#[cfg(test)]
mod testutil;

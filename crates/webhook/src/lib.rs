//! The admission webhook: in opted-in namespaces, a pod gets the node-local IP and
//! the kube-dns IP as its nameservers, so that a node whose whole DNS path is gone (the cache
//! and the agent's failover both) leaves its pods a second nameserver.
//!
//! [`mutate::mutate`] decides, from the pod and the [`mutate::Settings`], what kubelet should be
//! told (`dnsPolicy: None` and the whole `dnsConfig`, merged as kubelet merges a pod's own
//! entries) and the JSON patch that says it; [`review::answer`] turns an AdmissionReview into
//! its answer. Both are pure. [`server`] serves them over HTTPS ([`tls`]: the certificate,
//! reloaded) with [`metrics`].

#![forbid(unsafe_code)]

pub mod metrics;
pub mod mutate;
mod patch;
pub mod pod;
pub mod review;
pub mod server;
pub mod tls;

//! The admission webhook of issue 32: in opted-in namespaces, a pod gets the node-local IP and
//! the kube-dns IP as its nameservers, so that a node whose whole DNS path is gone (the cache
//! and the agent's failover both) leaves its pods a second nameserver.
//!
//! This crate holds the mutation, pure: [`mutate::mutate`] decides, from the pod and the
//! [`mutate::Settings`], what kubelet should be told (`dnsPolicy: None` and the whole
//! `dnsConfig`, merged as kubelet merges a pod's own entries) and the JSON patch that says it.
//! The HTTPS server, the metrics and the manifests come next.

#![forbid(unsafe_code)]

pub mod mutate;
mod patch;

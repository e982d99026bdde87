//! The JSON patch (RFC 6902) of a [`Mutation`](crate::mutate::Mutation): `dnsPolicy`,
//! `dnsConfig` and the mark, each an `add` (which replaces a member that exists).

use k8s_openapi::api::core::v1::PodDNSConfig;
use serde_json::{json, Value};

use crate::pod::PodDns;

/// One operation of a JSON patch.
#[derive(Clone, Debug, PartialEq)]
pub struct Op {
    /// Where, as a JSON pointer.
    pub path: String,
    /// What goes there.
    pub value: Value,
}

impl Op {
    /// As the AdmissionReview's patch carries it.
    pub fn to_json(&self) -> Value {
        json!({ "op": "add", "path": self.path, "value": self.value })
    }
}

/// The patch that gives `pod` `dnsPolicy: None`, `dns_config` and the annotation `mark`.
pub fn for_pod(pod: &PodDns, dns_config: &PodDNSConfig, mark: (&str, &str)) -> Vec<Op> {
    let mut ops = Vec::new();
    if !pod.has_spec {
        ops.push(Op { path: "/spec".into(), value: json!({}) });
    }
    ops.push(Op { path: "/spec/dnsPolicy".into(), value: json!("None") });
    let config = serde_json::to_value(dns_config).expect("a PodDNSConfig serializes");
    ops.push(Op { path: "/spec/dnsConfig".into(), value: config });
    let (key, value) = mark;
    if !pod.has_annotations {
        ops.push(Op { path: "/metadata/annotations".into(), value: json!({ key: value }) });
    } else {
        let path = format!("/metadata/annotations/{}", escape(key));
        ops.push(Op { path, value: json!(value) });
    }
    ops
}

/// `key` as one reference token of a JSON pointer (RFC 6901): `~` → `~0`, `/` → `~1`.
fn escape(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

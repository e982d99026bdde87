//! What the webhook does to a pod: nothing, with the reason, or `dnsPolicy: None` and the whole
//! `dnsConfig` kubelet should write into the pod's resolv.conf.
//!
//! kubelet's rules (`pkg/kubelet/network/dns/dns.go` in kubernetes/kubernetes): with `ClusterFirst` a pod gets kubelet's
//! `clusterDNS` list, the search list `<ns>.svc.<domain> svc.<domain> <domain>` (then the node's
//! own), `ndots:5`, and its own `dnsConfig` merged on top: nameservers and searches appended,
//! duplicates dropped, options merged by name (the pod's value wins). To put the node-local IP
//! first and the kube-dns IP second, the webhook writes the whole list under `dnsPolicy: None`
//! and merges the pod's own entries by the same rules, so that nothing the pod asked for is
//! lost. A pod whose own entries do not fit (more than 3 nameservers in all, a search list past
//! kubelet's limits, or more options or longer entries than a resolver takes: [`crate::pod`]) is
//! left alone, not trimmed. The node's own search list is not known here and is not added (as
//! ACK's webhook does).

use k8s_openapi::api::core::v1::{Pod, PodDNSConfig, PodDNSConfigOption};

use crate::patch::{self, Op};
use crate::pod::PodDns;

/// The annotation that marks a pod as mutated: a second pass (reinvocation) changes nothing.
pub const MARK: &str = "nodelocaldns-ha.io/dns";
/// [`MARK`]'s value.
pub const MARKED: &str = "injected";
/// The labels and annotations that opt a pod out, each with the value `disabled`: ours, and
/// ACK's and CCE's, so that pods written for those webhooks keep their meaning.
pub const OPT_OUT: [&str; 3] =
    ["nodelocaldns-ha.io/dns-injection", "node-local-dns-injection", "node-localdns-injection"];

/// At most this many nameservers (the API server's validation of `dnsConfig`).
pub const MAX_NAMESERVERS: usize = 3;
/// At most this many search domains, of at most [`MAX_SEARCH_CHARS`] characters in all
/// (kubelet's limits since Kubernetes 1.28).
pub const MAX_SEARCHES: usize = 32;
/// See [`MAX_SEARCHES`].
pub const MAX_SEARCH_CHARS: usize = 2048;

/// What the webhook is configured with.
#[derive(Clone, Debug)]
pub struct Settings {
    /// The nameservers, in order: the node-local IP, then the kube-dns ClusterIP.
    pub nameservers: Vec<String>,
    /// kubelet's `--cluster-domain` (`cluster.local`).
    pub cluster_domain: String,
    /// The resolver options (ACK's: `ndots:3`, `attempts:2`, `timeout:1`; kubelet's: `ndots:5`).
    pub options: Vec<(String, Option<String>)>,
    /// Whether host-network pods with `ClusterFirstWithHostNet` are mutated too.
    pub host_network: bool,
}

/// ACK's resolver options (`ack-node-local-dns`), the webhook's default.
pub const ACK_OPTIONS: [(&str, &str); 3] = [("ndots", "3"), ("attempts", "2"), ("timeout", "1")];

impl Settings {
    /// `nameservers` with [`ACK_OPTIONS`], for the cluster domain `cluster.local`, host-network
    /// pods left alone.
    pub fn ack(nameservers: &[&str]) -> Settings {
        Settings {
            nameservers: nameservers.iter().map(|s| s.to_string()).collect(),
            cluster_domain: "cluster.local".into(),
            options: ACK_OPTIONS
                .iter()
                .map(|(n, v)| (n.to_string(), Some(v.to_string())))
                .collect(),
            host_network: false,
        }
    }
}

/// Why a pod is left as it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Skip {
    /// Marked by an earlier pass.
    AlreadyMutated,
    /// Opted out by a label or an annotation ([`OPT_OUT`]).
    OptedOut,
    /// `dnsPolicy: None` or `Default`: the pod chose its own resolver.
    OwnPolicy,
    /// A host-network pod: on the node's resolver (`ClusterFirst`), or not configured for.
    HostNetwork,
    /// The pod's own nameservers leave no room for the webhook's.
    TooManyNameservers,
    /// The search list would pass kubelet's limits.
    SearchListTooLong,
    /// No namespace to build the search list from.
    NoNamespace,
    /// Its own `dnsConfig` has more options, or longer entries, than a resolver takes
    /// ([`MAX_OWN_OPTIONS`](crate::pod::MAX_OWN_OPTIONS), [`MAX_OWN_ENTRY`](crate::pod::MAX_OWN_ENTRY)).
    OwnConfigTooLarge,
}

impl Skip {
    /// The reason, for the log and the metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Skip::AlreadyMutated => "already mutated",
            Skip::OptedOut => "opted out",
            Skip::OwnPolicy => "dnsPolicy None or Default",
            Skip::HostNetwork => "host network",
            Skip::TooManyNameservers => "its own nameservers leave no room",
            Skip::SearchListTooLong => "the search list would pass kubelet's limits",
            Skip::NoNamespace => "no namespace",
            Skip::OwnConfigTooLarge => "its own dnsConfig is larger than a resolver takes",
        }
    }

    /// The reason as a metric label.
    pub fn label(self) -> &'static str {
        match self {
            Skip::AlreadyMutated => "already_mutated",
            Skip::OptedOut => "opted_out",
            Skip::OwnPolicy => "own_policy",
            Skip::HostNetwork => "host_network",
            Skip::TooManyNameservers => "too_many_nameservers",
            Skip::SearchListTooLong => "search_list_too_long",
            Skip::NoNamespace => "no_namespace",
            Skip::OwnConfigTooLarge => "own_config_too_large",
        }
    }
}

/// The mutation of one pod.
#[derive(Clone, Debug, PartialEq)]
pub struct Mutation {
    /// What the pod's spec gets: `dnsPolicy: None` and this `dnsConfig`.
    pub dns_config: PodDNSConfig,
    /// The JSON patch (RFC 6902) that makes the change, the mark included.
    pub patch: Vec<Op>,
}

/// What the webhook does to `pod`, created in `namespace` (the review's, which a pod created
/// from `generateName` may not yet carry itself).
pub fn mutate(pod: &Pod, namespace: &str, settings: &Settings) -> Result<Mutation, Skip> {
    mutate_dns(&PodDns::from(pod), namespace, settings)
}

/// [`mutate`] of what the webhook read of a pod.
pub fn mutate_dns(pod: &PodDns, namespace: &str, settings: &Settings) -> Result<Mutation, Skip> {
    if pod.marked {
        return Err(Skip::AlreadyMutated);
    }
    if pod.opted_out {
        return Err(Skip::OptedOut);
    }
    match pod.dns_policy.as_deref().unwrap_or("ClusterFirst") {
        "ClusterFirst" if pod.host_network => return Err(Skip::HostNetwork),
        "ClusterFirst" => {}
        "ClusterFirstWithHostNet" if pod.host_network && !settings.host_network => {
            return Err(Skip::HostNetwork)
        }
        "ClusterFirstWithHostNet" => {}
        _ => return Err(Skip::OwnPolicy),
    }
    if namespace.is_empty() {
        return Err(Skip::NoNamespace);
    }
    let own = &pod.own;

    let mut nameservers = Vec::new();
    for server in settings.nameservers.iter().chain(&own.nameservers.items) {
        push_new(&mut nameservers, server);
    }
    if own.nameservers.overflow || nameservers.len() > MAX_NAMESERVERS {
        return Err(Skip::TooManyNameservers);
    }
    let domain = &settings.cluster_domain;
    let cluster = [format!("{namespace}.svc.{domain}"), format!("svc.{domain}"), domain.clone()];
    let mut searches = Vec::new();
    for search in cluster.iter().chain(&own.searches.items) {
        push_new(&mut searches, search);
    }
    let chars = searches.iter().map(String::len).sum::<usize>() + searches.len().saturating_sub(1);
    if own.searches.overflow || searches.len() > MAX_SEARCHES || chars > MAX_SEARCH_CHARS {
        return Err(Skip::SearchListTooLong);
    }
    if own.too_many_options || own.too_long {
        return Err(Skip::OwnConfigTooLarge);
    }
    let mut options: Vec<PodDNSConfigOption> = settings
        .options
        .iter()
        .map(|(name, value)| PodDNSConfigOption { name: Some(name.clone()), value: value.clone() })
        .collect();
    for (name, value) in &own.options {
        match options.iter_mut().find(|o| o.name == *name) {
            Some(ours) => ours.value = value.clone(),
            None => options.push(PodDNSConfigOption { name: name.clone(), value: value.clone() }),
        }
    }
    let dns_config = PodDNSConfig {
        nameservers: Some(nameservers),
        searches: Some(searches),
        options: (!options.is_empty()).then_some(options),
    };
    let patch = patch::for_pod(pod, &dns_config, (MARK, MARKED));
    Ok(Mutation { dns_config, patch })
}

/// The resolv.conf kubelet has written for a pod with `dnsPolicy: None` and `config` (the
/// container runtime's format: the search list, the nameservers, the options).
pub fn resolv_conf(config: &PodDNSConfig) -> String {
    let mut text = String::new();
    if let Some(searches) = config.searches.as_ref().filter(|s| !s.is_empty()) {
        text.push_str(&format!("search {}\n", searches.join(" ")));
    }
    for server in config.nameservers.iter().flatten() {
        text.push_str(&format!("nameserver {server}\n"));
    }
    let options: Vec<String> = config
        .options
        .iter()
        .flatten()
        .filter_map(|o| {
            let name = o.name.as_deref()?;
            Some(o.value.as_deref().map_or(name.to_owned(), |v| format!("{name}:{v}")))
        })
        .collect();
    if !options.is_empty() {
        text.push_str(&format!("options {}\n", options.join(" ")));
    }
    text
}

/// Appends `item` unless `list` has it.
fn push_new(list: &mut Vec<String>, item: &str) {
    if !list.iter().any(|i| i == item) {
        list.push(item.to_owned());
    }
}

#[cfg(test)]
mod tests;

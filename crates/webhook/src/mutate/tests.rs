//! The mutation over every combination of what a pod may bring: idempotent, at
//! most 3 nameservers, the pod's own entries kept, the result a valid pod, the patch saying
//! exactly that.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Pod, PodDNSConfig, PodDNSConfigOption, PodSpec};
use serde_json::Value;

use super::*;
use crate::pod::PodDns;

const NODE_LOCAL: &str = "169.254.20.10";
const KUBE_DNS: &str = "10.96.0.10";

fn settings() -> Settings {
    Settings::ack(&[NODE_LOCAL, KUBE_DNS])
}

fn option(name: &str, value: Option<&str>) -> PodDNSConfigOption {
    PodDNSConfigOption { name: Some(name.into()), value: value.map(Into::into) }
}

/// Every pod of the combinations: policy × host network × own nameservers × own searches ×
/// own options × labels and annotations.
fn pods() -> Vec<Pod> {
    let policies = [
        None,
        Some("ClusterFirst"),
        Some("ClusterFirstWithHostNet"),
        Some("Default"),
        Some("None"),
    ];
    let servers: [&[&str]; 5] =
        [&[], &["10.0.0.53"], &["10.0.0.53", "10.0.0.54"], &[KUBE_DNS], &[NODE_LOCAL, "10.0.0.53"]];
    let searches: [&[&str]; 3] =
        [&[], &["corp.example"], &["default.svc.cluster.local", "corp.example"]];
    let options: [&[(&str, Option<&str>)]; 4] = [
        &[],
        &[("ndots", Some("1"))],
        &[("edns0", None)],
        &[("timeout", Some("5")), ("single-request", None)],
    ];
    let marks: [&[(&str, &str)]; 4] = [
        &[],
        &[("nodelocaldns-ha.io/dns-injection", "disabled")],
        &[("node-local-dns-injection", "disabled")],
        &[("app", "web")],
    ];
    let mut pods = Vec::new();
    for policy in policies {
        for host in [false, true] {
            for own_servers in servers {
                for own_searches in searches {
                    for own_options in options {
                        for (i, marks) in marks.iter().enumerate() {
                            let own = PodDNSConfig {
                                nameservers: (!own_servers.is_empty())
                                    .then(|| own_servers.iter().map(|s| s.to_string()).collect()),
                                searches: (!own_searches.is_empty())
                                    .then(|| own_searches.iter().map(|s| s.to_string()).collect()),
                                options: (!own_options.is_empty()).then(|| {
                                    own_options.iter().map(|(n, v)| option(n, *v)).collect()
                                }),
                            };
                            let empty = own == PodDNSConfig::default();
                            let map: BTreeMap<String, String> =
                                marks.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
                            let mut pod = Pod::default();
                            // The opt-out as a label on odd rounds, an annotation on even ones.
                            if i % 2 == 1 {
                                pod.metadata.labels = Some(map);
                            } else if !map.is_empty() {
                                pod.metadata.annotations = Some(map);
                            }
                            pod.spec = Some(PodSpec {
                                dns_policy: policy.map(Into::into),
                                host_network: host.then_some(true),
                                dns_config: (!empty).then_some(own),
                                ..PodSpec::default()
                            });
                            pods.push(pod);
                        }
                    }
                }
            }
        }
    }
    pods
}

/// The checks the API server makes of a pod's DNS settings (validation of `dnsPolicy` and
/// `dnsConfig`), and kubelet's limits on the search list.
fn valid(spec: &PodSpec) -> Result<(), String> {
    let config = spec.dns_config.clone().unwrap_or_default();
    let servers = config.nameservers.unwrap_or_default();
    if spec.dns_policy.as_deref() == Some("None") && servers.is_empty() {
        return Err("dnsPolicy None without a nameserver".into());
    }
    if servers.len() > MAX_NAMESERVERS {
        return Err(format!("{} nameservers", servers.len()));
    }
    if servers.iter().any(|s| s.parse::<std::net::IpAddr>().is_err()) {
        return Err(format!("a nameserver that is no IP: {servers:?}"));
    }
    let searches = config.searches.unwrap_or_default();
    let chars = searches.iter().map(String::len).sum::<usize>() + searches.len().saturating_sub(1);
    if searches.len() > MAX_SEARCHES || chars > MAX_SEARCH_CHARS {
        return Err("search list too long".into());
    }
    if config.options.unwrap_or_default().iter().any(|o| o.name.as_deref().unwrap_or("").is_empty())
    {
        return Err("an option without a name".into());
    }
    Ok(())
}

/// `pod` with `ops` applied (each an `add`, as RFC 6902 defines it for objects).
fn patched(pod: &Pod, ops: &[Op]) -> Pod {
    let mut doc = serde_json::to_value(pod).unwrap();
    for op in ops {
        let (parent, key) = op.path.rsplit_once('/').unwrap();
        let key = key.replace("~1", "/").replace("~0", "~");
        let target =
            doc.pointer_mut(parent).unwrap_or_else(|| panic!("no {parent} for {}", op.path));
        let Value::Object(map) = target else { panic!("{parent} is no object") };
        map.insert(key, op.value.clone());
    }
    serde_json::from_value(doc).unwrap()
}

#[test]
fn every_pod_mutated_is_valid_keeps_its_own_entries_and_is_mutated_once() {
    let settings = settings();
    let (mut mutated, mut skipped) = (0, BTreeMap::new());
    for pod in pods() {
        let result = mutate(&pod, "default", &settings);
        let Ok(m) = result else {
            *skipped.entry(result.unwrap_err().as_str()).or_insert(0) += 1;
            continue;
        };
        mutated += 1;
        let after = patched(&pod, &m.patch);
        let spec = after.spec.clone().unwrap();
        assert_eq!(spec.dns_policy.as_deref(), Some("None"));
        assert_eq!(
            spec.dns_config.as_ref(),
            Some(&m.dns_config),
            "the patch says what was decided"
        );
        valid(&spec).unwrap_or_else(|e| panic!("{e}: {pod:?}"));
        let config = m.dns_config.clone();
        let servers = config.nameservers.unwrap();
        assert_eq!(
            servers[..2],
            [NODE_LOCAL, KUBE_DNS],
            "the node-local IP first, kube-dns second"
        );
        let own = pod.spec.as_ref().unwrap().dns_config.clone().unwrap_or_default();
        for server in own.nameservers.iter().flatten() {
            assert!(servers.contains(server), "own nameserver {server} lost: {servers:?}");
        }
        let searches = config.searches.unwrap();
        assert_eq!(
            searches[..3],
            ["default.svc.cluster.local", "svc.cluster.local", "cluster.local"]
        );
        for search in own.searches.iter().flatten() {
            assert!(searches.contains(search), "own search {search} lost");
        }
        let options = config.options.unwrap();
        for o in own.options.iter().flatten() {
            assert!(options.contains(o), "own option {o:?} lost or changed: {options:?}");
        }
        for (name, value) in &settings.options {
            let theirs = own.options.iter().flatten().any(|o| o.name.as_ref() == Some(name));
            if !theirs {
                assert!(options.contains(&option(name, value.as_deref())), "{name} missing");
            }
        }
        let names: Vec<_> = options.iter().map(|o| o.name.clone()).collect();
        let unique: std::collections::BTreeSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "an option twice: {names:?}");
        // A second pass (reinvocation) changes nothing.
        assert_eq!(mutate(&after, "default", &settings), Err(Skip::AlreadyMutated));
    }
    println!("mutated {mutated}, skipped {skipped:?}");
    assert!(mutated > 0);
    for reason in [Skip::OptedOut, Skip::OwnPolicy, Skip::HostNetwork, Skip::TooManyNameservers] {
        assert!(skipped.contains_key(reason.as_str()), "never skipped for {}", reason.as_str());
    }
}

#[test]
fn a_pods_json_is_read_as_the_typed_pod_is() {
    for pod in pods() {
        let json = serde_json::to_string(&pod).unwrap();
        let read = PodDns::from_json(&json).unwrap_or_else(|e| panic!("{e}: {json}"));
        assert_eq!(read, PodDns::from(&pod), "{json}");
    }
}

#[test]
fn own_entries_no_resolver_takes_are_left_alone_not_trimmed() {
    let with = |config: PodDNSConfig| Pod {
        spec: Some(PodSpec { dns_config: Some(config), ..PodSpec::default() }),
        ..Pod::default()
    };
    let options = (0..=crate::pod::MAX_OWN_OPTIONS).map(|i| option(&format!("o{i}"), None));
    let many = with(PodDNSConfig { options: Some(options.collect()), ..PodDNSConfig::default() });
    assert_eq!(mutate(&many, "ns", &settings()), Err(Skip::OwnConfigTooLarge));
    let long = option("ndots", Some(&"1".repeat(crate::pod::MAX_OWN_ENTRY + 1)));
    let long = with(PodDNSConfig { options: Some(vec![long]), ..PodDNSConfig::default() });
    assert_eq!(mutate(&long, "ns", &settings()), Err(Skip::OwnConfigTooLarge));
    // As many as may be, each as long as may be: taken.
    let options = (0..crate::pod::MAX_OWN_OPTIONS).map(|i| option(&format!("o{i}"), Some("1")));
    let most = with(PodDNSConfig { options: Some(options.collect()), ..PodDNSConfig::default() });
    assert!(mutate(&most, "ns", &settings()).is_ok());
}

#[test]
fn a_plain_pod_gets_the_two_nameservers_the_cluster_search_list_and_the_options() {
    let pod = Pod { spec: Some(PodSpec::default()), ..Pod::default() };
    let m = mutate(&pod, "shop", &settings()).unwrap();
    let config = m.dns_config;
    assert_eq!(config.nameservers.unwrap(), [NODE_LOCAL, KUBE_DNS]);
    assert_eq!(
        config.searches.unwrap(),
        ["shop.svc.cluster.local", "svc.cluster.local", "cluster.local"]
    );
    let options = config.options.unwrap();
    assert_eq!(
        options,
        [option("ndots", Some("3")), option("attempts", Some("2")), option("timeout", Some("1"))]
    );
    let ops: Vec<Value> = m.patch.iter().map(Op::to_json).collect();
    assert_eq!(ops[0]["path"], "/spec/dnsPolicy");
    assert_eq!(
        ops[2],
        serde_json::json!({"op": "add", "path": "/metadata/annotations", "value": {MARK: MARKED}})
    );
}

#[test]
fn a_mark_beside_other_annotations_is_added_by_its_escaped_key() {
    let mut pod = Pod { spec: Some(PodSpec::default()), ..Pod::default() };
    pod.metadata.annotations = Some([("a/b".to_string(), "c".to_string())].into());
    let m = mutate(&pod, "shop", &settings()).unwrap();
    assert_eq!(m.patch.last().unwrap().path, "/metadata/annotations/nodelocaldns-ha.io~1dns");
    let after = patched(&pod, &m.patch);
    let annotations = after.metadata.annotations.unwrap();
    assert_eq!(annotations.get("a/b").map(String::as_str), Some("c"));
    assert_eq!(annotations.get(MARK).map(String::as_str), Some(MARKED));
}

#[test]
fn host_network_pods_are_mutated_only_when_configured_and_never_on_the_nodes_resolver() {
    let host = |policy: &str| Pod {
        spec: Some(PodSpec {
            host_network: Some(true),
            dns_policy: Some(policy.into()),
            ..PodSpec::default()
        }),
        ..Pod::default()
    };
    let mut with_host = settings();
    assert_eq!(mutate(&host("ClusterFirstWithHostNet"), "ns", &with_host), Err(Skip::HostNetwork));
    with_host.host_network = true;
    assert!(mutate(&host("ClusterFirstWithHostNet"), "ns", &with_host).is_ok());
    // kubelet gives a host-network ClusterFirst pod the node's resolver: left to it.
    assert_eq!(mutate(&host("ClusterFirst"), "ns", &with_host), Err(Skip::HostNetwork));
}

#[test]
fn a_search_list_past_kubelets_limits_is_left_alone() {
    let long: Vec<String> = (0..30).map(|i| format!("d{i}.example")).collect();
    let pod = Pod {
        spec: Some(PodSpec {
            dns_config: Some(PodDNSConfig { searches: Some(long), ..PodDNSConfig::default() }),
            ..PodSpec::default()
        }),
        ..Pod::default()
    };
    assert_eq!(mutate(&pod, "ns", &settings()), Err(Skip::SearchListTooLong));
    assert_eq!(
        mutate(&Pod { spec: Some(PodSpec::default()), ..Pod::default() }, "", &settings()),
        Err(Skip::NoNamespace)
    );
}

#[test]
fn resolv_conf_is_written_as_the_runtime_writes_it() {
    let pod = Pod { spec: Some(PodSpec::default()), ..Pod::default() };
    let mutation = mutate(&pod, "shop", &settings()).unwrap();
    assert_eq!(
        resolv_conf(&mutation.dns_config),
        "search shop.svc.cluster.local svc.cluster.local cluster.local\n\
         nameserver 169.254.20.10\nnameserver 10.96.0.10\n\
         options ndots:3 attempts:2 timeout:1\n"
    );
    let bare = PodDNSConfig {
        nameservers: Some(vec![NODE_LOCAL.into()]),
        searches: None,
        options: Some(vec![option("edns0", None)]),
    };
    assert_eq!(resolv_conf(&bare), "nameserver 169.254.20.10\noptions edns0\n");
}

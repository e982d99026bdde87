//! What the webhook reads of a pod's JSON: what it reads of the typed pod (every combination:
//! `mutate/tests.rs`), duplicates and nulls as `k8s-openapi` reads them, no pod for what is
//! none, and the pod's own `dnsConfig` kept only while it could fit, whatever the pod holds.

use serde_json::{json, Value};

use super::*;

fn read(pod: &Value) -> PodDns {
    PodDns::from_json(&pod.to_string()).unwrap_or_else(|e| panic!("{e}: {pod}"))
}

fn typed(pod: &Value) -> PodDns {
    PodDns::from(&serde_json::from_value::<Pod>(pod.clone()).unwrap())
}

#[test]
fn nulls_and_absent_members_read_as_the_typed_pod() {
    for pod in [
        json!({}),
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": null, "spec": null}),
        json!({"metadata": {"annotations": null, "labels": null}, "spec": {"dnsConfig": null}}),
        json!({"metadata": {"annotations": {}}, "spec": {"dnsConfig": {"nameservers": null}}}),
        json!({"spec": {"hostNetwork": null, "dnsPolicy": null, "dnsConfig": {"options": null}}}),
        json!({"metadata": {"annotations": {"nodelocaldns-ha.io/dns": "injected"}}}),
        json!({"metadata": {"labels": {"node-localdns-injection": "disabled"}}}),
        json!({"metadata": {"annotations": {"node-local-dns-injection": "enabled"}}}),
        json!({"spec": {"dnsConfig": {"options": [{"name": "ndots"}, {"value": "1"}, {}]}}}),
    ] {
        assert_eq!(read(&pod), typed(&pod), "{pod}");
    }
}

#[test]
fn a_member_given_twice_counts_as_the_last_one() {
    let text = r#"{"metadata": {"annotations": {"nodelocaldns-ha.io/dns": "injected",
                                                "nodelocaldns-ha.io/dns": "no"}},
                   "spec": {"dnsPolicy": "Default", "dnsPolicy": "ClusterFirst",
                            "dnsConfig": {"nameservers": ["10.0.0.1"], "nameservers": ["10.0.0.2"],
                                          "options": [{"name": "a", "value": "1", "value": "2"}]}}}"#;
    let pod = PodDns::from_json(text).unwrap();
    assert!(!pod.marked);
    assert_eq!(pod.dns_policy.as_deref(), Some("ClusterFirst"));
    assert_eq!(pod.own.nameservers.items, ["10.0.0.2"]);
    assert_eq!(pod.own.options, [(Some("a".to_owned()), Some("2".to_owned()))]);
}

#[test]
fn what_is_no_pod_is_refused_naming_what_is_wrong() {
    for (text, says) in [
        (r#"{"apiVersion": "v2"}"#, "expected v1"),
        (r#"{"kind": "Service"}"#, "expected Pod"),
        (r#"{"spec": "not a spec"}"#, "expected a pod's spec"),
        (r#"{"metadata": {"labels": {"app": 1}}}"#, "expected a string"),
        (r#"{"spec": {"hostNetwork": "yes"}}"#, "expected a boolean"),
        (r#"{"spec": {"dnsConfig": {"searches": "a"}}}"#, "expected a list"),
        (r#"[1, 2]"#, "expected a pod"),
    ] {
        let e = PodDns::from_json(text).unwrap_err().to_string();
        assert!(e.contains(says), "{text}: {e}");
    }
}

#[test]
fn what_the_webhook_does_not_read_is_walked_past_whatever_it_holds() {
    let depth = 100_000;
    let nested = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
    let wide = vec![0; 100_000];
    let text = format!(
        r#"{{"metadata": {{"name": "x", "managedFields": {nested}}},
             "spec": {{"containers": [{{"name": "c", "args": {}}}], "x": {nested},
                       "dnsPolicy": "ClusterFirstWithHostNet"}},
             "status": {{"a": {{"b": [null, true, 1.5e300, "\u00e9\n"]}}}}}}"#,
        serde_json::to_string(&wide).unwrap()
    );
    let pod = PodDns::from_json(&text).unwrap();
    assert_eq!(pod.dns_policy.as_deref(), Some("ClusterFirstWithHostNet"));
    assert!(pod.has_spec && !pod.has_annotations);
}

#[test]
fn a_pods_own_dns_config_is_kept_only_while_it_could_fit() {
    let config = |config: Value| read(&json!({"spec": {"dnsConfig": config}})).own;
    // A million times the same domain is one domain.
    let own = config(json!({"searches": vec!["corp.example"; 1_000_000]}));
    assert_eq!((own.searches.items.len(), own.searches.overflow), (1, false));
    // Past the limits: the first that fit kept, the list marked.
    let servers: Vec<String> = (0..40).map(|i| format!("10.0.0.{i}")).collect();
    let own = config(json!({"nameservers": servers}));
    assert_eq!(own.nameservers.items, servers[..MAX_NAMESERVERS]);
    assert!(own.nameservers.overflow);
    let domains: Vec<String> = (0..1000).map(|i| format!("d{i}.example")).collect();
    let own = config(json!({"searches": domains}));
    assert_eq!((own.searches.items.len(), own.searches.overflow), (MAX_SEARCHES, true));
    let long: Vec<String> = (0..20).map(|i| format!("{i:0>200}.example")).collect();
    let own = config(json!({"searches": long}));
    assert!(own.searches.overflow && own.searches.items.len() < 20);
    let options: Vec<Value> = (0..100_000).map(|i| json!({"name": format!("o{i}")})).collect();
    let own = config(json!({"options": options}));
    assert_eq!((own.options.len(), own.too_many_options), (MAX_OWN_OPTIONS, true));
    // A later value of a kept option still counts.
    let own = config(
        json!({"options": [{"name": "ndots", "value": "1"}, {"name": "ndots", "value": "2"}]}),
    );
    assert_eq!(own.options, [(Some("ndots".to_owned()), Some("2".to_owned()))]);
    // An entry longer than a domain name is marked, not kept.
    let huge = "x".repeat(1_000_000);
    for own in [
        config(json!({"nameservers": [huge]})),
        config(json!({"searches": [huge]})),
        config(json!({"options": [{"name": huge}]})),
        config(json!({"options": [{"name": "a", "value": huge}]})),
    ] {
        assert!(own.too_long, "{own:?}");
        let kept = own.nameservers.items.iter().chain(&own.searches.items).map(String::len);
        assert_eq!(kept.sum::<usize>() + own.options.len(), 0);
    }
}

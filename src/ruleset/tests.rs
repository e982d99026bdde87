use super::*;
use crate::testutil::golden;

fn addrs(local: &[&str], cluster_dns: &[&str]) -> ListenAddrs {
    let parse = |list: &[&str]| list.iter().map(|s| s.parse().unwrap()).collect();
    ListenAddrs { local: parse(local), cluster_dns: parse(cluster_dns) }
}

#[test]
fn golden_ipv4_local() {
    let set = RuleSet::desired(&addrs(&["169.254.20.10"], &["10.96.0.10"]), Route::Local);
    golden("ipv4-local.nft", &set.to_string());
}

#[test]
fn golden_ipv4_upstream() {
    let set = RuleSet::desired(&addrs(&["169.254.20.10"], &["10.96.0.10"]), Route::Upstream);
    golden("ipv4-upstream.nft", &set.to_string());
}

#[test]
fn golden_dual_stack_local() {
    let set = RuleSet::desired(
        &addrs(&["169.254.20.10", "fd00:169:254::10"], &["10.96.0.10", "fd00:96::10"]),
        Route::Local,
    );
    golden("dual-local.nft", &set.to_string());
}

#[test]
fn upstream_lets_every_query_to_the_cluster_dns_ip_through() {
    let set = RuleSet::desired(&addrs(&["169.254.20.10"], &["10.96.0.10"]), Route::Upstream);
    let cluster: Vec<_> = set.rules().filter(|(_, r)| r.addr.to_string() == "10.96.0.10").collect();
    assert_eq!(cluster.len(), 6);
    // No NOTRACK of a query: each is pinned to conntrack instead, whatever NOTRACK follows.
    for (chain, rule) in cluster {
        match rule.side {
            Side::Source => assert_eq!((chain.hook, rule.action), (Hook::Output, Action::Notrack)),
            Side::Destination => {
                assert_eq!((rule.guard, rule.action), (Guard::NotUntracked, Action::Track))
            }
        }
    }
}

#[test]
fn every_query_to_the_cluster_dns_ip_not_sent_to_the_cache_is_pinned() {
    let a = addrs(&["169.254.20.10"], &["10.96.0.10"]);
    let local = RuleSet::desired(&a, Route::Local);
    for hook in [Hook::Prerouting, Hook::Output] {
        let queries: Vec<(Guard, Action)> = local
            .rules()
            .filter(|(c, r)| c.hook == hook && !c.is_fallback() && r.side == Side::Destination)
            .filter(|(_, r)| r.addr.to_string() == "10.96.0.10")
            .map(|(_, r)| (r.guard, r.action))
            .collect();
        // Per protocol: the NOTRACK to the cache first, then the pin of what it left.
        let to_cache =
            if hook == Hook::Prerouting { Guard::LocalSocket } else { Guard::LocalAddress };
        let per_proto = [(to_cache, Action::Notrack), (Guard::NotUntracked, Action::Track)];
        assert_eq!(queries, [per_proto, per_proto].concat(), "{hook:?}");
    }
    assert!(local.steers_to_cache());
    let upstream = RuleSet::desired(&a, Route::Upstream);
    assert!(!upstream.steers_to_cache(), "a pin steers nothing to the cache");
    assert_eq!(local.without_cache_steering(), upstream);
}

#[test]
fn local_guards_every_cluster_dns_query_rule() {
    let set = RuleSet::desired(&addrs(&["169.254.20.10"], &["10.96.0.10"]), Route::Local);
    for (chain, rule) in set.rules().filter(|(chain, _)| !chain.is_fallback()) {
        let cluster = rule.addr.to_string() == "10.96.0.10";
        let expected = match (cluster, chain.hook, rule.side) {
            (false, Hook::Output, Side::Source) if rule.comment == PROBE_REPLY_COMMENT => {
                Guard::ToLoopback
            }
            (false, Hook::Output, Side::Source) if rule.comment == FORWARDER_REPLY_COMMENT => {
                Guard::FromForwarder
            }
            (false, _, _) | (true, _, Side::Source) => Guard::None,
            (true, _, Side::Destination) if rule.action == Action::Track => Guard::NotUntracked,
            (true, Hook::Prerouting, Side::Destination) => Guard::LocalSocket,
            (true, Hook::Output, Side::Destination) => Guard::LocalAddress,
        };
        assert_eq!(rule.guard, expected, "{rule}");
    }
}

#[test]
fn the_fallback_leaves_the_cache_only_for_its_socket_and_the_probes() {
    // In both routes the agent's probes reach the cache itself and everything else ends at
    // the forwarder; in Local, a query first goes to the cache while its socket is there.
    let a = addrs(&["169.254.20.10", "fd00::10"], &[]);
    for route in [Route::Local, Route::Upstream] {
        let set = RuleSet::desired(&a, route);
        let fallback = set.chains.iter().find(|c| c.is_fallback()).expect("a fallback chain");
        let shape: Vec<_> = fallback.rules.iter().map(|r| (r.guard, r.action)).collect();
        let to = |ip: &str| Action::Tproxy(forwarder_for(ip.parse().unwrap()));
        let per_proto = |ip| match route {
            Route::Local => vec![
                (Guard::FromLoopback, Action::Accept),
                (Guard::LocalSocket, Action::Accept),
                (Guard::None, to(ip)),
            ],
            Route::Upstream => {
                vec![(Guard::FromLoopback, Action::Accept), (Guard::None, to(ip))]
            }
        };
        let v4 = per_proto("169.254.20.10");
        let v6 = per_proto("fd00::10");
        assert_eq!(shape, [v4.clone(), v4, v6.clone(), v6].concat(), "{route}");
        assert!(!set.steers_to_cache(), "no cluster-DNS IP, nothing for the ACCEPTs to cover");
    }
    assert_eq!(
        RuleSet::desired(&a, Route::Local).without_cache_steering(),
        RuleSet::desired(&a, Route::Upstream)
    );
    // No link-local IP, no fallback chain.
    let clusterip_only = RuleSet::desired(&addrs(&[], &["10.96.0.10"]), Route::Local);
    assert!(!clusterip_only.chains.iter().any(Chain::is_fallback));
}

#[test]
fn comments_fit_nftnl_limit() {
    let set = RuleSet::desired(
        &addrs(&["169.254.20.10", "fd00:169:254::10"], &["10.96.0.10", "fd00:96::10"]),
        Route::Local,
    );
    assert!(set.rules().all(|(_, r)| r.comment.len() < 128));
}

#[test]
fn accepts_cover_both_directions_of_every_listen_address() {
    let a = addrs(&["169.254.20.10", "fd00::10"], &["10.96.0.10", "fd00::a"]);
    let set = RuleSet::desired(&a, Route::Upstream).with_accepts(&a);
    // 4 addresses × udp/tcp × (input, output) × (queries, replies).
    assert_eq!(set.accepts.len(), 4 * 2 * 2 * 2);
    let queries_in = set
        .accepts
        .iter()
        .filter(|x| x.hook == FilterHook::Input && x.rule.side == Side::Destination);
    assert_eq!(queries_in.count(), 8);
    // The nftables rendering is the NOTRACK table only.
    assert_eq!(set.to_string(), RuleSet::desired(&a, Route::Upstream).to_string());
}

#[test]
fn without_the_fast_path_only_the_socket_guard_goes() {
    let a = addrs(&["169.254.20.10"], &["10.96.0.10"]);
    let with = RuleSet::desired(&a, Route::Local);
    let without = with.clone().without_fast_path();
    let guards = |set: &RuleSet| set.rules().map(|(_, r)| r.guard).collect::<Vec<_>>();
    assert!(guards(&with).contains(&Guard::LocalSocket));
    assert!(!guards(&without).contains(&Guard::LocalSocket));
    assert_eq!(with.rules().count(), without.rules().count());
    assert!(without.to_string().contains(
        "ip daddr 10.96.0.10 udp dport 53 fib daddr type local counter notrack comment \"pods to cache (no fast path)\""
    ));
}

#[test]
fn local_less_its_steering_is_upstream_in_every_shape() {
    let a = addrs(&["169.254.20.10", "fd00::10"], &["10.96.0.10", "fd00::a"]);
    let (local, upstream) =
        (RuleSet::desired(&a, Route::Local), RuleSet::desired(&a, Route::Upstream));
    assert!(local.steers_to_cache() && !upstream.steers_to_cache());
    assert_eq!(local.clone().without_cache_steering(), upstream);
    let local = local.without_fast_path().with_accepts(&a);
    assert!(local.steers_to_cache());
    assert_eq!(local.without_cache_steering(), upstream.without_fast_path().with_accepts(&a));
}

#[test]
fn priority_is_spelled_like_nft() {
    assert_eq!(priority_text(-310), "raw - 10");
    assert_eq!(priority_text(-300), "raw");
    assert_eq!(priority_text(-295), "raw + 5");
    assert_eq!(priority_text(-150), "mangle");
    assert_eq!(priority_text(-100), "-100");
}

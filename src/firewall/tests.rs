//! The node firewall's evaluation on plain chains: what stops a pod's DNS to the cache, what does
//! not, what is unknown.

use super::*;

const CLUSTER_DNS: &str = "10.96.0.10";

fn meta(key: u32) -> Expr {
    Expr::Meta { key, dreg: 1 }
}
fn eq(data: &[u8]) -> Expr {
    Expr::Cmp { sreg: 1, op: CMP_EQ, data: data.to_vec() }
}
fn verdict(v: Verdict) -> Expr {
    Expr::Verdict(v)
}
fn rule(exprs: Vec<Expr>) -> Rule {
    Rule { exprs }
}
fn ifname(name: &str) -> Vec<u8> {
    let mut b = name.as_bytes().to_vec();
    b.resize(16, 0);
    b
}
/// `ct state <bits>`: ct load, bitwise and mask, cmp neq 0.
fn ct_state(bits: u32, then: Verdict) -> Rule {
    rule(vec![
        Expr::Ct { key: CT_STATE, dreg: 1 },
        Expr::Bitwise { sreg: 1, dreg: 1, mask: bits.to_ne_bytes().to_vec(), xor: vec![0; 4] },
        Expr::Cmp { sreg: 1, op: CMP_NEQ, data: vec![0; 4] },
        verdict(then),
    ])
}
/// `ip daddr <addr> th dport 53 accept` in an inet table, as nft generates it.
fn allow_dns_to(addr: [u8; 4]) -> Rule {
    rule(vec![
        meta(META_NFPROTO),
        eq(&[2]),
        Expr::Payload { base: PAYLOAD_NETWORK, offset: 16, len: 4, dreg: 1 },
        eq(&addr),
        Expr::Payload { base: PAYLOAD_TRANSPORT, offset: 2, len: 2, dreg: 1 },
        eq(&53u16.to_be_bytes()),
        verdict(Verdict::Accept),
    ])
}

/// firewalld's nftables backend, in short (see testdata/simnode.sh --nft-firewall).
fn firewalld(first: Option<Rule>) -> Table {
    let mut input = vec![
        rule(vec![
            Expr::Ct { key: CT_STATE, dreg: 1 },
            Expr::Other("lookup".into()),
            verdict(Verdict::Accept),
        ]),
        // ct status dnat accept: no conntrack entry, no match.
        rule(vec![
            Expr::Ct { key: 2, dreg: 1 },
            Expr::Other("bitwise".into()),
            verdict(Verdict::Accept),
        ]),
        rule(vec![meta(META_IIFNAME), eq(&ifname("lo")), verdict(Verdict::Accept)]),
        ct_state(1, Verdict::Drop), // invalid
        rule(vec![verdict(Verdict::Jump("filter_INPUT_ZONES".into()))]),
        rule(vec![Expr::Reject]),
    ];
    if let Some(first) = first {
        input.insert(0, first);
    }
    Table {
        family: 1,
        name: "firewalld".into(),
        chains: vec![
            Chain {
                name: "filter_INPUT".into(),
                hook: Some((HOOK_INPUT, 10)),
                policy: Some(NF_ACCEPT),
                rules: input,
            },
            Chain {
                name: "filter_INPUT_ZONES".into(),
                hook: None,
                policy: None,
                rules: vec![rule(vec![verdict(Verdict::Goto("filter_IN_public".into()))])],
            },
            Chain {
                name: "filter_IN_public".into(),
                hook: None,
                policy: None,
                rules: vec![
                    rule(vec![
                        meta(META_L4PROTO),
                        Expr::Other("lookup".into()),
                        verdict(Verdict::Accept),
                    ]),
                    rule(vec![
                        meta(META_L4PROTO),
                        eq(&[TCP]),
                        Expr::Payload { base: PAYLOAD_TRANSPORT, offset: 2, len: 2, dreg: 1 },
                        eq(&22u16.to_be_bytes()),
                        verdict(Verdict::Accept),
                    ]),
                ],
            },
        ],
    }
}

fn addrs() -> Vec<IpAddr> {
    vec![CLUSTER_DNS.parse().unwrap()]
}

#[test]
fn a_firewalld_input_chain_rejects_pods_queries() {
    let found = blocking(&[firewalld(None)], &addrs(), &[]);
    assert_eq!(found.len(), 1, "{found:?}");
    let b = &found[0];
    assert_eq!((b.table.as_str(), b.chain.as_str()), ("inet firewalld", "filter_INPUT"));
    assert_eq!(b.direction, Direction::Query);
    assert_eq!(
        b.fix(),
        "nft insert rule inet firewalld filter_INPUT ip daddr 10.96.0.10 th dport 53 accept"
    );
    assert!(b.to_string().contains("pods' DNS queries to 10.96.0.10"), "{b}");
}

#[test]
fn the_rule_it_suggests_lets_them_through() {
    let fixed = firewalld(Some(allow_dns_to([10, 96, 0, 10])));
    assert_eq!(blocking(&[fixed], &addrs(), &[]), vec![]);
    // An accept for another address does not.
    let other = firewalld(Some(allow_dns_to([10, 96, 0, 99])));
    assert_eq!(blocking(&[other], &addrs(), &[]).len(), 1);
}

#[test]
fn untracked_packets_are_neither_invalid_nor_established_nor_on_lo() {
    let chain = |rules| Table {
        family: 2,
        name: "filter".into(),
        chains: vec![Chain {
            name: "input".into(),
            hook: Some((HOOK_INPUT, 0)),
            policy: Some(NF_DROP),
            rules,
        }],
    };
    // ct state established,related accept; iifname lo accept; policy drop: drops ours.
    let t = chain(vec![
        ct_state(2 | 4, Verdict::Accept),
        rule(vec![meta(META_IIFNAME), eq(&ifname("lo")), verdict(Verdict::Accept)]),
    ]);
    let found = blocking(&[t], &addrs(), &[]);
    assert_eq!(found.len(), 1);
    assert!(found[0].surely);
    // ct state untracked accept lets them in.
    let t = chain(vec![ct_state(CT_STATE_UNTRACKED, Verdict::Accept)]);
    assert_eq!(blocking(&[t], &addrs(), &[]), vec![]);
    // An ip6 table never sees IPv4 packets.
    let mut t = chain(vec![]);
    t.family = 10;
    assert_eq!(blocking(&[t], &addrs(), &[]), vec![]);
}

#[test]
fn an_unknown_match_before_a_drop_counts_as_dropping() {
    // ip saddr 10.244.0.0/16 accept (unknown source) before policy drop: may drop.
    let t = Table {
        family: 1,
        name: "host".into(),
        chains: vec![Chain {
            name: "input".into(),
            hook: Some((HOOK_INPUT, 0)),
            policy: Some(NF_DROP),
            rules: vec![rule(vec![
                Expr::Payload { base: PAYLOAD_NETWORK, offset: 12, len: 4, dreg: 1 },
                Expr::Other("bitwise".into()),
                verdict(Verdict::Accept),
            ])],
        }],
    };
    let found = blocking(&[t], &addrs(), &[]);
    assert_eq!(found.len(), 1);
    assert!(!found[0].surely);
    assert!(found[0].to_string().contains("may drop"), "{}", found[0]);
}

#[test]
fn replies_are_judged_on_output_and_other_hooks_are_not_ours() {
    let t = |hook| Table {
        family: 1,
        name: "host".into(),
        chains: vec![Chain {
            name: "c".into(),
            hook: Some((hook, 0)),
            policy: Some(NF_DROP),
            rules: vec![],
        }],
    };
    let found = blocking(&[t(HOOK_OUTPUT)], &addrs(), &[]);
    assert_eq!(found[0].direction, Direction::Reply);
    assert!(found[0].fix().contains("ip saddr 10.96.0.10 th sport 53 accept"));
    // prerouting (0), forward (2): not the cache's path.
    assert_eq!(blocking(&[t(0), t(2)], &addrs(), &[]), vec![]);
}

#[test]
fn return_and_goto_come_back_where_nft_does() {
    // jump sub; sub: return; then accept → accepted. goto sub2 (falls off) → back to the
    // base chain's caller: the policy (drop).
    let base = |rules| Table {
        family: 1,
        name: "t".into(),
        chains: vec![
            Chain { name: "in".into(), hook: Some((HOOK_INPUT, 0)), policy: Some(NF_DROP), rules },
            Chain {
                name: "sub".into(),
                hook: None,
                policy: None,
                rules: vec![rule(vec![verdict(Verdict::Return)])],
            },
            Chain { name: "sub2".into(), hook: None, policy: None, rules: vec![] },
        ],
    };
    let jumped = base(vec![
        rule(vec![verdict(Verdict::Jump("sub".into()))]),
        rule(vec![verdict(Verdict::Accept)]),
    ]);
    assert_eq!(blocking(&[jumped], &addrs(), &[]), vec![]);
    let went = base(vec![
        rule(vec![verdict(Verdict::Goto("sub2".into()))]),
        rule(vec![verdict(Verdict::Accept)]),
    ]);
    assert_eq!(blocking(&[went], &addrs(), &[]).len(), 1);
}

/// `ip saddr <net>/<len> goto <zone>` (nft's shape: the address loaded, masked, compared).
fn source_in(net: [u8; 4], len: u32, zone: &str) -> Rule {
    let mask = (u32::MAX << (32 - len)).to_be_bytes().to_vec();
    rule(vec![
        meta(META_NFPROTO),
        eq(&[2]),
        Expr::Payload { base: PAYLOAD_NETWORK, offset: 12, len: 4, dreg: 1 },
        Expr::Bitwise { sreg: 1, dreg: 1, mask, xor: vec![0; 4] },
        eq(&net),
        verdict(Verdict::Goto(zone.into())),
    ])
}

/// firewalld with a trusted zone whose sources or interfaces come first in `zones`.
fn firewalld_trusting(zones: Vec<Rule>) -> Table {
    let mut table = firewalld(None);
    let dispatch = table.chains.iter_mut().find(|c| c.name == "filter_INPUT_ZONES").unwrap();
    dispatch.rules.splice(0..0, zones);
    table.chains.push(Chain {
        name: "filter_IN_trusted".into(),
        hook: None,
        policy: None,
        rules: vec![rule(vec![verdict(Verdict::Accept)])],
    });
    table
}

fn pods(places: &[(&str, &str, u8)]) -> Vec<PodSource> {
    let place = |&(iface, net, prefix_len): &(&str, &str, u8)| PodSource {
        iface: iface.into(),
        net: net.parse().unwrap(),
        prefix_len,
    };
    places.iter().map(place).collect()
}

#[test]
fn a_trusted_zone_for_the_pod_cidr_lets_the_pods_it_holds_through() {
    // With the pods' places unknown the source is unknown, and the route would stay
    // Upstream for good where node-local-dns alone served the pods.
    let t = firewalld_trusting(vec![source_in([10, 244, 0, 0], 16, "filter_IN_trusted")]);
    let calico = pods(&[("cali1", "10.244.1.5", 32), ("cali2", "10.244.1.6", 32)]);
    assert_eq!(blocking(std::slice::from_ref(&t), &addrs(), &calico), vec![]);
    let unknown = blocking(std::slice::from_ref(&t), &addrs(), &[]);
    assert!(unknown.len() == 1 && !unknown[0].surely, "{unknown:?}");
    // Pods outside the trusted prefix are stopped, and named.
    let with_docker = pods(&[("cali1", "10.244.1.5", 32), ("docker0", "172.17.0.0", 16)]);
    let found = blocking(std::slice::from_ref(&t), &addrs(), &with_docker);
    // (Not surely: firewalld's first rule, `ct state { established, related }`, is a lookup.)
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].pods, Some(with_docker[1].clone()));
    assert!(found[0].to_string().contains("(pods on docker0 172.17.0.0/16)"), "{}", found[0]);
    // A prefix only partly trusted may be stopped.
    let wider = pods(&[("cni0", "10.0.0.0", 8)]);
    let found = blocking(&[t], &addrs(), &wider);
    assert!(found.len() == 1 && !found[0].surely, "{found:?}");
}

#[test]
fn a_byte_aligned_prefix_is_a_shorter_load_and_judged_the_same() {
    // nft compiles `ip saddr 10.244.0.0/16` to a two-byte load and no mask.
    let t = firewalld_trusting(vec![rule(vec![
        meta(META_NFPROTO),
        eq(&[2]),
        Expr::Payload { base: PAYLOAD_NETWORK, offset: 12, len: 2, dreg: 1 },
        eq(&[10, 244]),
        verdict(Verdict::Goto("filter_IN_trusted".into())),
    ])]);
    let inside = pods(&[("pod1", "10.244.0.2", 32), ("cni0", "10.244.1.0", 24)]);
    assert_eq!(blocking(std::slice::from_ref(&t), &addrs(), &inside), vec![]);
    let outside = pods(&[("pod1", "10.245.0.2", 32)]);
    assert_eq!(blocking(&[t], &addrs(), &outside).len(), 1);
}

#[test]
fn a_trusted_zone_for_the_cnis_interfaces_lets_their_pods_through() {
    let iif = |name: &[u8]| {
        rule(vec![meta(META_IIFNAME), eq(name), verdict(Verdict::Goto("filter_IN_trusted".into()))])
    };
    // `iifname "cni0"` compares the whole name; `iifname "cali*"` its first four bytes.
    let t = firewalld_trusting(vec![iif(&ifname("cni0")), iif(b"cali")]);
    let trusted = pods(&[("cni0", "10.244.0.0", 24), ("cali9", "10.244.1.9", 32)]);
    assert_eq!(blocking(std::slice::from_ref(&t), &addrs(), &trusted), vec![]);
    let other = pods(&[("cni0", "10.244.0.0", 24), ("eth1", "192.168.7.0", 24)]);
    let found = blocking(&[t], &addrs(), &other);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].pods.as_ref().map(|p| p.iface.as_str()), Some("eth1"));
}

#[test]
fn pods_of_the_other_family_leave_an_address_judged_as_before() {
    // Only IPv6 places known: an IPv4 query comes from anywhere but lo, as without places.
    let t = firewalld_trusting(vec![source_in([10, 244, 0, 0], 16, "filter_IN_trusted")]);
    let found = blocking(&[t], &addrs(), &pods(&[("cali1", "fd00:244::5", 128)]));
    assert!(found.len() == 1 && !found[0].surely, "{found:?}");
}

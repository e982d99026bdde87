//! Tests of the nftables backend: the comparison on plain data, then the real kernel, each test
//! in a network namespace of its own.

use super::compare::hook_number;
use super::expr::{rule_expressions, Found};
use super::*;
use crate::ruleset::{ListenAddrs, Route, TABLE};

fn addrs(local: &[&str], cluster_dns: &[&str]) -> ListenAddrs {
    let parse = |list: &[&str]| list.iter().map(|s| s.parse().unwrap()).collect();
    ListenAddrs { local: parse(local), cluster_dns: parse(cluster_dns) }
}

fn dual_stack() -> ListenAddrs {
    addrs(&["169.254.20.10", "fd00:169:254::10"], &["10.96.0.10", "fd00:96::10"])
}

/// What the kernel reports for `rules` once they are installed.
fn installed(rules: &RuleSet) -> Installed {
    Installed {
        table: Some(objects::Table { name: TABLE.to_owned(), flags: 0 }),
        chains: rules
            .chains
            .iter()
            .map(|chain| objects::Chain {
                table: TABLE.to_owned(),
                name: chain.name().to_owned(),
                hook: Some(objects::ChainHook {
                    hooknum: hook_number(chain.hook),
                    priority: chain.priority,
                }),
                chain_type: Some("filter".to_owned()),
                policy: Some(1),
            })
            .collect(),
        rules: (4..)
            .zip(rules.rules())
            .map(|(handle, (chain, rule))| objects::Rule {
                table: TABLE.to_owned(),
                chain: chain.name().to_owned(),
                handle,
                exprs: rule_expressions(rule).into_iter().map(Found::Known).collect(),
                comment: Some(rule.comment.clone()),
                packets: None,
            })
            .collect(),
    }
}

#[test]
fn table_name_is_the_rulesets() {
    assert_eq!(TABLE_NAME.to_str().unwrap(), TABLE);
}

#[test]
fn compare_matches_exactly_what_was_wanted() {
    let local = RuleSet::desired(&dual_stack(), Route::Local);
    let upstream = RuleSet::desired(&dual_stack(), Route::Upstream);
    assert_eq!(compare(&local, &installed(&local)), Check::Matches);
    assert_eq!(compare(&upstream, &installed(&upstream)), Check::Matches);
    assert_eq!(
        compare(&local, &installed(&upstream)),
        Check::Differs("chain prerouting: 8 rules, want 12".to_owned())
    );
    assert_eq!(compare(&local, &Installed::default()), Check::Missing);
}

#[test]
fn compare_says_what_differs_first() {
    let want = RuleSet::desired(&addrs(&["169.254.20.10"], &["10.96.0.10"]), Route::Local);
    type Tamper = fn(&mut Installed);
    let cases: [(Tamper, &str); 11] = [
        (
            |i| i.table.as_mut().unwrap().flags = 1,
            "table flags are 0x1, want 0 (0x1 is dormant: its chains see no packets)",
        ),
        (|i| i.chains.truncate(1), "chain output is missing"),
        (
            |i| i.chains[0].hook.as_mut().unwrap().priority = -300,
            "chain prerouting hooks prerouting at priority -300, want prerouting at priority -310",
        ),
        (|i| i.chains[1].hook = None, "chain output is not a base chain"),
        (|i| i.chains[1].policy = Some(0), "chain output has policy drop, want accept"),
        (|i| i.rules.retain(|r| r.chain != "prerouting"), "chain prerouting: 0 rules, want 6"),
        (
            |i| i.rules[8].comment = Some("x".to_owned()),
            "chain output: rule 3 has comment \"x\", want \"cache replies to the agent's probes\"",
        ),
        (
            |i| i.rules[0].comment = None,
            "chain prerouting: rule 1 has no comment, want \"pods to cache (link-local)\"",
        ),
        (
            |i| {
                i.rules[2].exprs[3] =
                    Found::Known(expr::Expr::Cmp { op: 0, data: vec![10, 96, 0, 11] })
            },
            "chain prerouting: rule 3 expression 4 is `cmp eq 0a60000b`, want `cmp eq 0a60000a` \
             (ip daddr 10.96.0.10 udp dport 53 fib daddr type local socket transparent 0 socket \
             wildcard 0 counter notrack comment \"pods to cache while it listens\")",
        ),
        (
            |i| i.rules[0].exprs[9] = Found::Other("immediate".to_owned()),
            "chain prerouting: rule 1 expression 10 is `immediate (not one this agent writes)`, \
             want `notrack` (ip daddr 169.254.20.10 udp dport 53 counter notrack comment \
             \"pods to cache (link-local)\")",
        ),
        (
            |i| {
                let mut extra = i.chains[0].clone();
                extra.name = "foo".to_owned();
                i.chains.push(extra);
            },
            "extra chain foo",
        ),
    ];
    for (tamper, want_text) in cases {
        let mut got = installed(&want);
        tamper(&mut got);
        assert_eq!(compare(&want, &got), Check::Differs(want_text.to_owned()));
    }
}

#[test]
fn compare_counts_expressions() {
    let want = RuleSet::desired(&addrs(&["169.254.20.10"], &[]), Route::Local);
    let mut got = installed(&want);
    got.rules[0].exprs.pop();
    assert_eq!(
        compare(&want, &got),
        Check::Differs(
            "chain prerouting: rule 1 has 9 expressions (meta cmp payload cmp meta cmp payload \
             cmp counter), want 10 (ip daddr 169.254.20.10 udp dport 53 counter notrack comment \
             \"pods to cache (link-local)\")"
                .to_owned()
        )
    );
}

/// Real-kernel tests, each in a network namespace of its own.
mod kernel;

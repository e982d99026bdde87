//! Real-kernel tests. Each runs in a fresh network namespace: the test binary runs the one test
//! again under `ip netns exec`, so no thread of the calling process ever changes namespace and
//! nothing here can touch the host's netfilter.

use std::fmt::Write as _;
use std::io::{ErrorKind, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use super::*;
use crate::testutil::{in_netns, run, test_path};

fn nft(ns: &str, args: &[&str]) -> String {
    let args = [&["netns", "exec", ns, "nft"], args].concat();
    run("ip", &args)
}

/// Loads an nft script (e.g. a [`RuleSet`]'s rendering) with `nft -f -`.
fn nft_load(ns: &str, script: &str) {
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns, "nft", "-f", "-"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(script.as_bytes()).unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "nft -f: {}\n{script}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// `nft list table inet nodelocaldns-ha`, with `counter packets N bytes M` as `counter`.
fn listing(ns: &str) -> String {
    const COUNTER: &str = " counter packets ";
    let text = nft(ns, &["list", "table", "inet", TABLE]);
    let mut out = String::new();
    for line in text.lines() {
        match line.split_once(COUNTER) {
            None => out.push_str(line),
            Some((head, tail)) => {
                // tail: "<packets> bytes <bytes> <rest>"
                let rest = tail.splitn(4, ' ').nth(3).unwrap_or_default();
                out.push_str(&format!("{head} counter {rest}"));
            }
        }
        out.push('\n');
    }
    out
}

/// The packet count of the one rule whose text contains `rule`.
fn packets(ns: &str, rule: &str) -> u64 {
    let text = nft(ns, &["list", "table", "inet", TABLE]);
    let mut lines = text.lines().filter(|line| line.contains(rule));
    let line = lines.next().expect("rule listed");
    assert!(lines.next().is_none(), "{rule} is in more than one rule");
    let count = line.split_once("packets ").unwrap().1;
    count.split(' ').next().unwrap().parse().unwrap()
}

#[test]
fn apply_local_lists_exactly_the_rendering() {
    in_netns("nft", test_path!(), |ns| {
        let local = RuleSet::desired(&dual_stack(), Route::Local);
        let mut nftables = Nftables::new().unwrap();
        nftables.apply(&local).unwrap();
        assert_eq!(listing(ns), local.to_string());
        assert_eq!(nftables.check(&local).unwrap(), Check::Matches);
        // Applying again puts in the same.
        nftables.apply(&local).unwrap();
        assert_eq!(listing(ns), local.to_string());
    });
}

/// The generation moves with every commit in the namespace, another tool's included (an
/// iptables-nft rule), and with nothing else: the reconciler's safety net may trust it.
#[test]
fn the_ruleset_generation_moves_with_every_commit_and_only_then() {
    in_netns("nft", test_path!(), |ns| {
        let mut nftables = Nftables::new().unwrap();
        let first = nftables.generation().unwrap();
        assert_eq!(nftables.generation().unwrap(), first, "a read moved it");
        nftables.apply(&RuleSet::desired(&dual_stack(), Route::Local)).unwrap();
        let applied = nftables.generation().unwrap();
        assert_ne!(applied, first);
        nftables.check(&RuleSet::desired(&dual_stack(), Route::Local)).unwrap();
        assert_eq!(nftables.generation().unwrap(), applied, "a read-back moved it");
        run(
            "ip",
            &["netns", "exec", ns, "iptables-nft", "-t", "raw", "-A", "OUTPUT", "-j", "ACCEPT"],
        );
        assert_ne!(nftables.generation().unwrap(), applied, "iptables-nft's commit");
        // The benchmark's floor is a real transaction, and leaves nothing.
        let before = nftables.generation().unwrap();
        nftables.commit_floor().unwrap();
        assert_ne!(nftables.generation().unwrap(), before, "the floor committed nothing");
        assert!(!nft(ns, &["list", "tables"]).contains("trial"), "the floor left its table");
    });
}

#[test]
fn switching_to_upstream_drops_the_cluster_dns_rules() {
    in_netns("nft", test_path!(), |ns| {
        let local = RuleSet::desired(&dual_stack(), Route::Local);
        let upstream = RuleSet::desired(&dual_stack(), Route::Upstream);
        let mut nftables = Nftables::new().unwrap();
        nftables.apply(&local).unwrap();
        nftables.apply(&upstream).unwrap();
        assert_eq!(listing(ns), upstream.to_string());
        assert_eq!(nftables.check(&upstream).unwrap(), Check::Matches);
        assert_eq!(
            nftables.check(&local).unwrap(),
            Check::Differs("chain prerouting: 8 rules, want 12".to_owned())
        );
    });
}

/// The handle of the agent's table: kept while the table stays, new when it is replaced.
fn table_handle(ns: &str) -> String {
    let text = nft(ns, &["-a", "list", "table", "inet", TABLE]);
    let first = text.lines().next().unwrap_or_default();
    first.split_once("# handle ").expect("a handle").1.trim().to_owned()
}

/// A switch refills the chains in place (the table, its base chains and their hooks stay);
/// a table another writer changed is replaced whole, whatever the change.
#[test]
fn a_switch_refills_the_chains_and_a_changed_table_is_replaced() {
    in_netns("nft", test_path!(), |ns| {
        let local = RuleSet::desired(&dual_stack(), Route::Local);
        let upstream = RuleSet::desired(&dual_stack(), Route::Upstream);
        let mut nftables = Nftables::new().unwrap();
        nftables.apply(&local).unwrap();
        assert!(nftables.last_commit().is_some());
        let first = table_handle(ns);
        for rules in [&upstream, &local, &upstream] {
            let generation = nftables.generation().unwrap();
            nftables.apply(rules).unwrap();
            assert_eq!(listing(ns), rules.to_string());
            assert_eq!(table_handle(ns), first, "a switch replaced the table");
            let commits = nftables.generation().unwrap().wrapping_sub(generation);
            assert_eq!(commits, 1, "a switch is one transaction");
        }
        // A chain gone: the refill is refused, and the table replaced.
        nft(ns, &["delete", "chain", "inet", TABLE, "fallback"]);
        nftables.apply(&local).unwrap();
        assert_eq!(listing(ns), local.to_string());
        let second = table_handle(ns);
        assert_ne!(second, first);
        // A chain more: the refill reads back wrong, and the table is replaced.
        nft(ns, &["add", "chain", "inet", TABLE, "foo"]);
        nftables.apply(&upstream).unwrap();
        assert_eq!(listing(ns), upstream.to_string());
        assert_ne!(table_handle(ns), second);
        // Removed, then applied: a whole table again.
        nftables.remove().unwrap();
        nftables.apply(&local).unwrap();
        assert_eq!(listing(ns), local.to_string());
    });
}

#[test]
fn tampering_is_seen_and_repaired() {
    in_netns("nft", test_path!(), |ns| {
        let local = RuleSet::desired(&dual_stack(), Route::Local);
        let mut nftables = Nftables::new().unwrap();
        let differs = |nftables: &mut Nftables, tamper: &[&str], want: &str| {
            nftables.apply(&local).unwrap();
            nft(ns, tamper);
            match nftables.check(&local).unwrap() {
                Check::Differs(text) => assert!(text.contains(want), "{tamper:?}: {text}"),
                other => panic!("{tamper:?}: {other:?}"),
            }
        };
        differs(
            &mut nftables,
            &["flush", "chain", "inet", TABLE, "prerouting"],
            "chain prerouting: 0 rules, want 12",
        );
        differs(
            &mut nftables,
            &["add", "rule", "inet", TABLE, "output", "accept"],
            "chain output: 29 rules, want 28",
        );
        differs(&mut nftables, &["add", "chain", "inet", TABLE, "foo"], "extra chain foo");
        differs(
            &mut nftables,
            &["add", "table", "inet", TABLE, "{ flags dormant; }"],
            "table flags are 0x1",
        );
        differs(
            &mut nftables,
            &[
                "add",
                "chain",
                "inet",
                TABLE,
                "output",
                "{ type filter hook output priority -310; policy drop; }",
            ],
            "chain output has policy drop, want accept",
        );
        differs(
            &mut nftables,
            &[
                "insert",
                "rule",
                "inet",
                TABLE,
                "prerouting",
                "ip daddr 10.96.0.11 udp dport 53 counter notrack comment \
                 \"pods to cache (link-local)\"",
            ],
            "chain prerouting: 13 rules, want 12",
        );

        nftables.apply(&local).unwrap();
        nft(ns, &["delete", "table", "inet", TABLE]);
        assert_eq!(nftables.check(&local).unwrap(), Check::Missing);
        nftables.apply(&local).unwrap();
        assert_eq!(nftables.check(&local).unwrap(), Check::Matches);
        assert_eq!(listing(ns), local.to_string());
    });
}

#[test]
fn a_rejected_batch_changes_nothing() {
    in_netns("nft", test_path!(), |ns| {
        let local = RuleSet::desired(&dual_stack(), Route::Local);
        let mut nftables = Nftables::new().unwrap();
        nftables.apply(&local).unwrap();
        // A second prerouting chain at another priority: the kernel refuses to move a hook.
        let mut bad = RuleSet::desired(&dual_stack(), Route::Upstream);
        let mut moved = bad.chains[0].clone();
        moved.priority = -300;
        bad.chains.push(moved);
        let error = nftables.apply(&bad).unwrap_err();
        let super::super::super::Error::Nftables(Error::Rejected { at, source }) = &error else {
            panic!("{error}");
        };
        assert_eq!(at, "chain prerouting", "{error}");
        assert_ne!(*source, Errno::UnknownErrno);
        // All or nothing: the old table is untouched.
        assert_eq!(listing(ns), local.to_string());
        assert_eq!(nftables.check(&local).unwrap(), Check::Matches);
    });
}

/// The trial of the link-local fallback's rules leaves nothing on a kernel that takes them,
/// and sends nothing for a ruleset without a fallback. (A kernel without nft_tproxy refuses
/// the trial's first `tproxy` rule: `tests/e2e_vm.rs`, whose guest can lack the module. The
/// hooks a rule may run in are checked only at commit, for tables that remain: no trap here
/// can make a trial fail.)
#[test]
fn the_fallback_trial_leaves_nothing() {
    in_netns("nft", test_path!(), |ns| {
        let local = RuleSet::desired(&dual_stack(), Route::Local);
        let mut nftables = Nftables::new().unwrap();
        nftables.trial(&local).unwrap();
        assert_eq!(nft(ns, &["list", "ruleset"]), "", "the trial left something");
        let without = RuleSet::desired(&addrs(&[], &["10.96.0.10"]), Route::Local);
        nftables.trial(&without).unwrap();
        assert_eq!(nft(ns, &["list", "ruleset"]), "");
    });
}

#[test]
fn an_unstorable_comment_is_refused_before_sending() {
    in_netns("nft", test_path!(), |ns| {
        let mut rules = RuleSet::desired(&dual_stack(), Route::Upstream);
        rules.chains[1].rules[2].comment = "x".repeat(200);
        let mut nftables = Nftables::new().unwrap();
        let error = nftables.apply(&rules).unwrap_err();
        assert!(error.to_string().contains("must be under 128 bytes"), "{error}");
        assert_eq!(nft(ns, &["list", "tables"]), "");
    });
}

#[test]
fn a_table_written_by_nft_matches() {
    // nft generates the expressions; check() compares every value with rule_expressions().
    in_netns("nft", test_path!(), |ns| {
        let local = RuleSet::desired(&dual_stack(), Route::Local);
        nft_load(ns, &local.to_string());
        let mut nftables = Nftables::new().unwrap();
        assert_eq!(nftables.check(&local).unwrap(), Check::Matches);
        let upstream = RuleSet::desired(&dual_stack(), Route::Upstream);
        assert!(matches!(nftables.check(&upstream).unwrap(), Check::Differs(_)));
    });
}

#[test]
fn remove_twice_is_ok_and_leaves_nothing() {
    in_netns("nft", test_path!(), |ns| {
        let mut nftables = Nftables::new().unwrap();
        nftables.remove().unwrap();
        nftables.apply(&RuleSet::desired(&dual_stack(), Route::Local)).unwrap();
        nft(ns, &["add", "table", "inet", "other"]);
        nftables.remove().unwrap();
        nftables.remove().unwrap();
        assert_eq!(nft(ns, &["list", "tables"]), "table inet other\n");
        let upstream = RuleSet::desired(&dual_stack(), Route::Upstream);
        assert_eq!(nftables.check(&upstream).unwrap(), Check::Missing);
    });
}

#[test]
fn change_watch_hears_other_writers() {
    in_netns("nft", test_path!(), |ns| {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            const DEADLINE: Duration = Duration::from_secs(2);
            let mut nftables = Nftables::new().unwrap();
            let mut every_change = ChangeWatch::new().unwrap();
            let mut foreign_changes = nftables.change_watch().unwrap();

            nftables.apply(&RuleSet::desired(&dual_stack(), Route::Local)).unwrap();
            tokio::time::timeout(DEADLINE, every_change.changed())
                .await
                .expect("our apply is announced")
                .unwrap();
            // The kernel queues announcements before it acks the batch, so when apply()
            // returns they are all there: this one finds only ours and keeps waiting.
            let own = Duration::from_millis(100);
            assert!(
                tokio::time::timeout(own, foreign_changes.changed()).await.is_err(),
                "our own changes wake the watch"
            );

            nft(ns, &["add", "table", "inet", "other"]);
            tokio::time::timeout(DEADLINE, foreign_changes.changed())
                .await
                .expect("a change by nft is announced within 2 s")
                .unwrap();
        });
    });
}

/// What iptables-nft's ACCEPTs in the filter table are read back for: kube-proxy
/// rewriting its own chains there (every sync, on a node with endpoint churn) is announced
/// but concerns them not; a rule put in front of their jump, a built-in chain's policy or
/// their own chain flushed does.
#[test]
fn iptables_nft_read_backs_follow_only_their_chains() {
    use crate::dataplane::iptables::{Flavour, Iptables, Role};
    in_netns("nft", test_path!(), |ns| {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            const DEADLINE: Duration = Duration::from_secs(2);
            let ipv4 = addrs(&["169.254.20.10"], &["10.96.0.10"]);
            let rules = RuleSet::desired(&ipv4, Route::Local).with_accepts(&ipv4);
            let mut accepts = Iptables::new(Flavour::Nft, Role::Accepts, DEADLINE).unwrap();
            accepts.apply(&rules).unwrap();
            let watches = accepts.announced_tables().expect("iptables-nft is announced");
            let ipt =
                |args: &[&str]| run("ip", &[&["netns", "exec", ns, "iptables-nft"], args].concat());
            ipt(&["-N", "KUBE-FORWARD"]);
            let mut watch = ChangeWatch::new().unwrap();
            let mut next = async || {
                tokio::time::timeout(DEADLINE, watch.changed())
                    .await
                    .expect("a change is announced within 2 s")
                    .unwrap()
            };
            let concerned = |announced: &Announced| watches.iter().any(|w| announced.concerns(w));

            // kube-proxy's sync: `iptables-restore --noflush` of its chain, which flushes
            // and refills it.
            let mut restore = Command::new("ip")
                .args(["netns", "exec", ns, "iptables-nft-restore", "--noflush"])
                .stdin(Stdio::piped())
                .spawn()
                .unwrap();
            let script = "*filter\n:KUBE-FORWARD - [0:0]\n\
                          -A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n\
                          -A KUBE-FORWARD -j ACCEPT\nCOMMIT\n";
            restore.stdin.take().unwrap().write_all(script.as_bytes()).unwrap();
            assert!(restore.wait().unwrap().success());
            let churn = next().await;
            let filter = TableRef { family: libc::NFPROTO_IPV4 as u8, name: "filter".into() };
            assert!(churn.tables.contains(&filter), "{churn:?}");
            assert!(!concerned(&churn), "{churn:?}");

            ipt(&["-I", "INPUT", "1", "-j", "ACCEPT"]);
            assert!(concerned(&next().await), "a rule in front of the jump");
            ipt(&["-P", "INPUT", "DROP"]);
            assert!(concerned(&next().await), "the built-in chain's policy");
            ipt(&["-F", "NODELOCALDNS-HA-INPUT"]);
            assert!(concerned(&next().await), "the agent's chain flushed");
            assert!(matches!(accepts.check(&rules).unwrap(), Check::Differs(_)));
        });
    });
}

/// Real kube-proxy (iptables mode) rewrites `KUBE-SERVICES` whole on every sync, one rule per
/// Service: the change watch hears such a sync of 5,000 Services without losing any of it
/// (a loss would make the agent read everything back, on every sync), and it does not concern
/// the agent's chains.
#[test]
fn a_busy_kube_proxy_sync_is_heard_without_loss() {
    in_netns("nft", test_path!(), |ns| {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let restore = |services: u32| {
                let mut script = String::from("*nat\n:KUBE-SERVICES - [0:0]\n");
                for i in 0..services {
                    let _ = writeln!(
                        script,
                        "-A KUBE-SERVICES -d 10.96.{}.{}/32 -p tcp -m comment --comment \
                         \"busy/svc-{i}:http cluster IP\" -m tcp --dport 80 -j RETURN",
                        i / 250,
                        i % 250 + 1
                    );
                }
                script.push_str("COMMIT\n");
                let mut child = Command::new("ip")
                    .args(["netns", "exec", ns, "iptables-nft-restore", "--noflush"])
                    .stdin(Stdio::piped())
                    .spawn()
                    .unwrap();
                child.stdin.take().unwrap().write_all(script.as_bytes()).unwrap();
                assert!(child.wait().unwrap().success());
            };
            restore(5_000);
            let mut watch = ChangeWatch::new().unwrap();
            // The kernel queues a batch's announcements before iptables-nft-restore's batch is
            // acked: all of the sync's are waiting when it returns.
            restore(5_000);
            let sync = tokio::time::timeout(Duration::from_secs(2), watch.changed())
                .await
                .expect("the sync is announced within 2 s")
                .unwrap();
            assert!(!sync.unknown, "announcements lost");
            let nat = TableRef { family: libc::NFPROTO_IPV4 as u8, name: "nat".into() };
            assert_eq!(sync.tables, [nat]);
            let filter = TableRef { family: libc::NFPROTO_IPV4 as u8, name: "filter".into() };
            let watch = TableWatch { table: filter, chains: Some(vec!["INPUT"]) };
            assert!(!sync.concerns(&watch));
        });
    });
}

#[test]
fn host_firewall_reads_the_node_tables_only() {
    // The agent's, kube-proxy's and iptables-nft's tables are left out, and so is a table
    // without a filter chain on input or output; a node table comes whole, rules and all.
    in_netns("nft", test_path!(), |ns| {
        let mut nftables = Nftables::new().unwrap();
        nftables.apply(&RuleSet::desired(&dual_stack(), Route::Local)).unwrap();
        nft_load(
            ns,
            "table ip kube-proxy { chain filter-input { type filter hook input priority 0; }; }
             table ip filter { chain INPUT { type filter hook input priority 0; }; }
             table ip6 unhooked { chain helper { }; }
             table inet fw {
                 chain input { type filter hook input priority 0; policy drop; tcp dport 22 accept; };
                 chain helper { };
             }",
        );
        let tables = nftables.host_firewall().unwrap();
        let spelled: Vec<String> = tables.iter().map(|t| t.spelled()).collect();
        assert_eq!(spelled, ["inet fw"]);
        let mut chains: Vec<_> = tables[0].chains.iter().collect();
        chains.sort_by(|a, b| a.name.cmp(&b.name));
        assert_eq!(chains[0].name, "helper");
        assert_eq!((chains[0].hook, chains[0].rules.len()), (None, 0));
        assert_eq!(chains[1].name, "input");
        let input = (chains[1].hook, chains[1].policy, chains[1].rules.len());
        assert_eq!(input, (Some((crate::firewall::HOOK_INPUT, 0)), Some(0), 1));
    });
}

#[test]
fn socket_guard_follows_the_listening_socket() {
    // The kernel fast path: prerouting NOTRACKs the cluster-DNS IP only while a socket is
    // bound to it; the counter of that rule shows whether it matched.
    in_netns("nft", test_path!(), |ns| {
        run("ip", &["-n", ns, "link", "set", "lo", "up"]);
        run("ip", &["-n", ns, "addr", "add", "10.96.0.10/32", "dev", "lo"]);
        let rules = RuleSet::desired(&addrs(&["169.254.20.10"], &["10.96.0.10"]), Route::Local);
        Nftables::new().unwrap().apply(&rules).unwrap();
        let guarded = "ip daddr 10.96.0.10 udp dport 53 fib daddr type local socket";
        let timeout = Some(Duration::from_secs(2));

        let cache = std::net::UdpSocket::bind("10.96.0.10:53").unwrap();
        cache.set_read_timeout(timeout).unwrap();
        let client = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
        client.connect("10.96.0.10:53").unwrap();
        client.set_read_timeout(timeout).unwrap();
        let mut buf = [0; 16];

        client.send(b"query").unwrap();
        cache.recv(&mut buf).unwrap(); // it has been through prerouting
        assert_eq!(packets(ns, guarded), 1, "NOTRACK while the cache listens");

        drop(cache);
        client.send(b"query").unwrap();
        // The port unreachable error comes after the query went through prerouting.
        let refused = client.recv(&mut buf).unwrap_err();
        assert_eq!(refused.kind(), ErrorKind::ConnectionRefused);
        assert_eq!(packets(ns, guarded), 1, "no NOTRACK once the socket is gone");

        // Another DNS server of the node's, on the wildcard address, is not the cache: with
        // kube-proxy there the query would be DNATed to CoreDNS, not NOTRACKed to it.
        let other = std::net::UdpSocket::bind("0.0.0.0:53").unwrap();
        other.set_read_timeout(timeout).unwrap();
        client.send(b"query").unwrap();
        other.recv(&mut buf).unwrap();
        assert_eq!(packets(ns, guarded), 1, "no NOTRACK for a wildcard listener");
    });
}

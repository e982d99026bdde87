//! The netfilter state the agent wants installed, as plain data.
//!
//! A [`RuleSet`] is computed from the listen addresses and the current [`Route`]; it does no I/O.
//! Dataplane backends turn it into netlink messages, and [`RuleSet`]'s `Display` renders it as
//! the exact text `nft list table` prints for it (less counter values), which is what the golden
//! tests and `nodelocaldns-ha rules` show.
//!
//! One table, `inet nodelocaldns-ha`, with two base chains at `priority raw - 10` so they run
//! before every iptables raw chain (kube-proxy, CNI plugins):
//!
//! * always: NOTRACK for the link-local listen IP, both directions, as node-cache does;
//! * [`Route::Local`]: NOTRACK for the cluster-DNS IP too. In prerouting it is guarded by
//!   `fib daddr type local` and `socket transparent 0` (UDP: and `socket wildcard 0`): a
//!   socket bound to the address itself, not a TPROXY target, not another server's on 0.0.0.0.
//!   When the cache's socket is gone the rule stops matching and the very next packet is DNATed
//!   by kube-proxy to CoreDNS, with no agent involved. In output the socket guard cannot work
//!   (it sees the sending socket), so host clients rely on the agent's switch; the address guard
//!   still prevents a blackhole when the cache's teardown removes its addresses.
//! * [`Route::Upstream`]: no NOTRACK for queries to the cluster-DNS IP, so kube-proxy's DNAT
//!   takes them. The cache's own replies from that IP stay NOTRACKed in both routes: a late
//!   reply (after a hang) would otherwise leave a conntrack entry whose reverse tuple steers a
//!   later query from the same client port back to the cache, around the DNAT.
//! * both routes, after the NOTRACK of `Local`: every query to the cluster-DNS IP that the
//!   agent did not NOTRACK is pinned to conntrack ([`Action::Track`]), so that no NOTRACK after
//!   it (node-cache's own rules, re-inserted every minute when it runs without
//!   `-setupiptables=false`) can keep pods on a cache that is gone, hung or drained.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use serde::{Deserialize, Serialize};

/// The nftables table the agent owns. Nothing else in it is kept.
pub const TABLE: &str = "nodelocaldns-ha";
/// `raw - 10`: before conntrack (-200) and before every iptables raw chain (-300).
pub const PRIORITY: i32 = -310;
/// DNS.
pub const DNS_PORT: u16 = 53;
/// `mangle`: the link-local fallback chain's, after conntrack (-200), where TPROXY belongs.
pub const FALLBACK_PRIORITY: i32 = -150;
/// Where the agent's forwarder listens for the link-local IPv4 queries TPROXY hands it: an
/// address no other socket binds (`127.0.0.53` is systemd-resolved's).
pub const FORWARDER_V4: SocketAddr =
    SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 53, 0, 53)), DNS_PORT);
/// The same for IPv6: not an address of the node; the forwarder's transparent socket binds it
/// all the same, and TPROXY delivers to the socket, not to an address.
pub const FORWARDER_V6: SocketAddr =
    SocketAddr::new(IpAddr::V6(Ipv6Addr::new(0xfd00, 0x169, 0x254, 0, 0, 0, 0, 0x53)), DNS_PORT);

/// The comment of the rules that pin pods' queries for the cluster-DNS IP to conntrack
/// ([`Action::Track`]).
pub const TRACK_COMMENT: &str = "pods to CoreDNS, whatever NOTRACK follows";
/// The same for host-network clients' queries.
pub const HOST_TRACK_COMMENT: &str = "host to CoreDNS, whatever NOTRACK follows";

/// The comment of the rules that count the cache's replies from the cluster-DNS IP.
pub const REPLY_COMMENT: &str = "cache replies";
/// The same from the link-local IP, answers to the agent's probes included.
pub const LINK_LOCAL_REPLY_COMMENT: &str = "cache replies (link-local)";
/// The answers to the agent's probes alone, from the link-local IP.
pub const PROBE_REPLY_COMMENT: &str = "cache replies to the agent's probes";
/// The agent's forwarder's answers alone, from the link-local IP (the address its clients
/// asked).
pub const FORWARDER_REPLY_COMMENT: &str = "the forwarder's answers (link-local)";

/// The hop limit (IPv4 TTL) of every packet the forwarder sends its clients, so that a rule can
/// tell its answers from the cache's: they leave from the same address and port, and the
/// iptables backends have no match for the sending socket in output (xt_socket works in
/// prerouting and input only). The node's own default is 64 (`net.ipv4.ip_default_ttl`,
/// `net.ipv6.conf.*.hop_limit`), and an answer to a pod or a host client never crosses a router.
pub const FORWARDER_HOP_LIMIT: u8 = 255;

/// How a rule's packets count in the cache's replies a drain waits to go quiet: replies to
/// pods and host clients, from either IP (1); less the answers to the agent's probes (-1),
/// which go on as long as the agent runs, and the forwarder's answers from the link-local IP
/// (-1), which go on as long as pods query on `Upstream`; other rules (0).
pub fn reply_weight(comment: &str) -> i64 {
    match comment {
        REPLY_COMMENT | LINK_LOCAL_REPLY_COMMENT => 1,
        PROBE_REPLY_COMMENT | FORWARDER_REPLY_COMMENT => -1,
        _ => 0,
    }
}

/// The forwarder's address for queries to `ip`'s family.
pub fn forwarder_for(ip: IpAddr) -> SocketAddr {
    match ip {
        IpAddr::V4(_) => FORWARDER_V4,
        IpAddr::V6(_) => FORWARDER_V6,
    }
}

/// Where queries for the cluster-DNS IP go.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Route {
    /// To node-local-dns on this node (NOTRACK, no DNAT).
    Local,
    /// Through kube-proxy's DNAT to CoreDNS.
    Upstream,
}

impl Route {
    /// The other route.
    pub fn other(self) -> Route {
        match self {
            Route::Local => Route::Upstream,
            Route::Upstream => Route::Local,
        }
    }

    /// Lower-case name, as used on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Route::Local => "local",
            Route::Upstream => "upstream",
        }
    }
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The netfilter hook a base chain is attached to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hook {
    /// Packets arriving from pods (and from the network).
    Prerouting,
    /// Packets sent by host-network processes, the cache's replies among them.
    Output,
}

impl Hook {
    /// The nft keyword, also used as the chain's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Hook::Prerouting => "prerouting",
            Hook::Output => "output",
        }
    }
}

/// Transport protocol matched by a rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proto {
    Udp,
    Tcp,
}

impl Proto {
    /// The nft keyword.
    pub fn as_str(self) -> &'static str {
        match self {
            Proto::Udp => "udp",
            Proto::Tcp => "tcp",
        }
    }

    /// The IP protocol number.
    pub fn number(self) -> u8 {
        match self {
            Proto::Udp => 17,
            Proto::Tcp => 6,
        }
    }
}

/// Which end of the packet a rule matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// `daddr` and `dport`: queries to the address.
    Destination,
    /// `saddr` and `sport`: replies from the address.
    Source,
}

/// Extra conditions that make a NOTRACK rule stop matching when the cache is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Guard {
    /// Unconditional.
    None,
    /// `fib daddr type local`: the address is still on the node.
    LocalAddress,
    /// `fib daddr type local socket transparent 0 [socket wildcard 0]`: and a socket bound to
    /// the address itself is there to take the packet. (`wildcard` for UDP only: the kernel has
    /// none for TCP's request and TIME_WAIT sockets, and the rule would miss a handshake's ACK.)
    LocalSocket,
    /// `ip saddr 127.0.0.1` (`ip6 saddr ::1`): sent from the loopback address, as the agent's
    /// own probes of the cache are, so they reach the cache itself and never the fallback.
    FromLoopback,
    /// `ip daddr 127.0.0.1` (`ip6 daddr ::1`): sent to the loopback address, as the cache's
    /// answers to the agent's probes are.
    ToLoopback,
    /// `iif "lo"` (`-i lo`): arrived on the loopback interface, so sent by a process of the node
    /// itself. A packet from a pod or from the network arrives on another interface, whatever
    /// source address it claims.
    OnLoopback,
    /// `ip ttl 255` (`ip6 hoplimit 255`): sent by the agent's forwarder, whose packets carry
    /// [`FORWARDER_HOP_LIMIT`].
    FromForwarder,
    /// `ct state != untracked` (`-m conntrack ! --ctstate UNTRACKED`): not NOTRACKed by a rule
    /// before it. Before conntrack has seen a packet its state reads `invalid`, so in the raw
    /// hook this is every packet the agent's own NOTRACK left alone.
    NotUntracked,
}

/// What a rule does with the packets it matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// `notrack`: conntrack ignores the packet, so kube-proxy's DNAT never sees it.
    Notrack,
    /// `accept`: the packet leaves the fallback chain and goes to the socket it is addressed to.
    Accept,
    /// `tproxy ip to A:P`: the packet goes to the agent's forwarder socket at A:P, whatever its
    /// destination address says.
    Tproxy(SocketAddr),
    /// `ct zone set 0` (`-j CT`): conntrack's template for its default zone on the packet, so
    /// that it is tracked, and kube-proxy's DNAT takes it, whatever NOTRACK comes after it: a
    /// NOTRACK (`notrack`, `-j NOTRACK`, `-j CT --notrack`) leaves a packet that already has a
    /// conntrack attached as it is. Zone 0 is the one every packet is tracked in anyway.
    Track,
}

/// One `… counter <action>` rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    pub addr: IpAddr,
    pub side: Side,
    pub proto: Proto,
    pub port: u16,
    pub guard: Guard,
    pub action: Action,
    /// Why the rule exists; stored with the rule and compared on read-back.
    pub comment: String,
}

impl Rule {
    /// A NOTRACK rule for DNS (port 53) to or from `addr`.
    pub fn dns(addr: IpAddr, side: Side, proto: Proto, guard: Guard, comment: &str) -> Rule {
        Rule::queries(addr, proto, guard, Action::Notrack, comment).on_side(side)
    }

    /// A rule for DNS queries (port 53) to `addr`.
    pub fn queries(
        addr: IpAddr,
        proto: Proto,
        guard: Guard,
        action: Action,
        comment: &str,
    ) -> Rule {
        let (side, port, comment) = (Side::Destination, DNS_PORT, comment.to_owned());
        Rule { addr, side, proto, port, guard, action, comment }
    }

    fn on_side(self, side: Side) -> Rule {
        Rule { side, ..self }
    }
}

/// A base chain of the agent's table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    /// `prerouting` and `output` (the NOTRACK chains) or `fallback`.
    pub name: &'static str,
    pub hook: Hook,
    pub priority: i32,
    pub rules: Vec<Rule>,
}

impl Chain {
    /// The chain's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Whether this is the link-local fallback chain (TPROXY), not a NOTRACK one.
    pub fn is_fallback(&self) -> bool {
        self.priority == FALLBACK_PRIORITY
    }
}

/// A filter-table hook an ACCEPT rule goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FilterHook {
    /// Queries arriving for the cache.
    Input,
    /// The cache's replies.
    Output,
}

/// An ACCEPT in the filter table for DNS to or from a listen address, as node-cache installs:
/// needed wherever a host firewall may stop them (NOTRACKed packets are neither NEW nor
/// ESTABLISHED to conntrack, so "allow established" rules do not let them through).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Accept {
    pub hook: FilterHook,
    /// The match; its guard is `Guard::None`, or `Guard::OnLoopback` for the replies to host
    /// clients.
    pub rule: Rule,
}

/// Everything the agent installs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleSet {
    /// The NOTRACK chains that switch the route (one `inet` table in nftables).
    pub chains: Vec<Chain>,
    /// Filter ACCEPTs, route-independent; empty where the node has no iptables in use.
    pub accepts: Vec<Accept>,
}

/// The addresses node-local-dns listens on, at most one per family in each list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListenAddrs {
    /// The link-local IP(s), e.g. 169.254.20.10.
    pub local: Vec<IpAddr>,
    /// The kube-dns ClusterIP(s), e.g. 10.96.0.10.
    pub cluster_dns: Vec<IpAddr>,
}

impl RuleSet {
    /// The ruleset for `route`.
    pub fn desired(addrs: &ListenAddrs, route: Route) -> RuleSet {
        let mut prerouting = Vec::new();
        let mut output = Vec::new();
        for &ip in &addrs.local {
            for proto in [Proto::Udp, Proto::Tcp] {
                let rule = |side, comment: &str| Rule::dns(ip, side, proto, Guard::None, comment);
                prerouting.push(rule(Side::Destination, "pods to cache (link-local)"));
                output.push(rule(Side::Destination, "host to cache (link-local)"));
                output.push(rule(Side::Source, LINK_LOCAL_REPLY_COMMENT));
                // Counts the answers to the agent's own probes, which a drain leaves out of the
                // replies it waits to go quiet (NOTRACK does not end the chain: both count).
                let probes =
                    Rule::dns(ip, Side::Source, proto, Guard::ToLoopback, PROBE_REPLY_COMMENT);
                output.push(probes);
                // And the forwarder's answers, which leave from the same address and port as the
                // cache's and are not the cache's.
                let forwarded = Rule::dns(
                    ip,
                    Side::Source,
                    proto,
                    Guard::FromForwarder,
                    FORWARDER_REPLY_COMMENT,
                );
                output.push(forwarded);
            }
        }
        for &ip in &addrs.cluster_dns {
            for proto in [Proto::Udp, Proto::Tcp] {
                let rule = |side, guard, comment: &str| Rule::dns(ip, side, proto, guard, comment);
                if route == Route::Local {
                    prerouting.push(rule(
                        Side::Destination,
                        Guard::LocalSocket,
                        "pods to cache while it listens",
                    ));
                    output.push(rule(Side::Destination, Guard::LocalAddress, "host to cache"));
                }
                // Whatever the agent did not NOTRACK goes to kube-proxy's DNAT, whatever
                // NOTRACK of others' comes after (node-cache's own rules): the rules of a cache
                // that is gone or hung keep no pod on it.
                let track =
                    |comment| Rule::queries(ip, proto, Guard::NotUntracked, Action::Track, comment);
                prerouting.push(track(TRACK_COMMENT));
                output.push(track(HOST_TRACK_COMMENT));
                // In both routes: a reply the cache sends (a late one, after a hang) must not
                // leave a conntrack entry that would steer a later query back to it.
                output.push(rule(Side::Source, Guard::None, REPLY_COMMENT));
            }
        }
        let mut chains = vec![
            Chain {
                name: "prerouting",
                hook: Hook::Prerouting,
                priority: PRIORITY,
                rules: prerouting,
            },
            Chain { name: "output", hook: Hook::Output, priority: PRIORITY, rules: output },
        ];
        if !addrs.local.is_empty() {
            chains.push(fallback(&addrs.local, route));
        }
        RuleSet { accepts: Vec::new(), chains }
    }

    /// This ruleset with filter ACCEPTs for DNS to and from every listen address (both routes:
    /// a query DNATed to CoreDNS is forwarded, not input, so the ACCEPTs never steer anything).
    pub fn with_accepts(mut self, addrs: &ListenAddrs) -> RuleSet {
        let listen = addrs.local.iter().chain(&addrs.cluster_dns);
        for &ip in listen {
            for proto in [Proto::Udp, Proto::Tcp] {
                // Untracked packets are neither NEW nor ESTABLISHED, so a host firewall's
                // "accept established" lets none of them through: queries in, replies out, and
                // for host-network clients (over lo) the replies in and the queries out too.
                // The replies coming in are the cache's only if they come in on lo: anyone can
                // claim a listen IP's port 53 as a source, and an INPUT ACCEPT of that alone
                // would let such a packet through the host firewall to any port.
                for (hook, side, guard, comment) in [
                    (FilterHook::Input, Side::Destination, Guard::None, "queries to cache"),
                    (
                        FilterHook::Input,
                        Side::Source,
                        Guard::OnLoopback,
                        "cache replies to host clients",
                    ),
                    (FilterHook::Output, Side::Source, Guard::None, "cache replies"),
                    (FilterHook::Output, Side::Destination, Guard::None, "host queries to cache"),
                ] {
                    let rule = Rule::dns(ip, side, proto, guard, comment);
                    self.accepts.push(Accept { hook, rule });
                }
            }
        }
        self
    }

    /// This ruleset without the kernel fast path: pods' queries to the cluster-DNS IP are
    /// NOTRACKed whether or not a socket is there, and only the agent's switch moves them (what
    /// node-cache's static rules do, with an agent on top). For comparisons; not a default.
    pub fn without_fast_path(mut self) -> RuleSet {
        for rule in self.chains.iter_mut().flat_map(|c| c.rules.iter_mut()) {
            if rule.guard == Guard::LocalSocket {
                rule.guard = Guard::LocalAddress;
                rule.comment = "pods to cache (no fast path)".to_owned();
            }
        }
        self
    }

    /// Whether pods' queries to the cluster-DNS IP are NOTRACKed to the cache: the `Local`
    /// route's ruleset. (Those are the only address-guarded rules; `Upstream` has none.) Such a
    /// ruleset must never be in the kernel without its ACCEPTs: on a host whose firewall
    /// rejects what it has not accepted, NOTRACKed queries would meet the REJECT instead of
    /// kube-proxy's DNAT.
    pub fn steers_to_cache(&self) -> bool {
        self.rules().any(|(chain, rule)| {
            chain.hook == Hook::Prerouting
                && !chain.is_fallback()
                && matches!(rule.guard, Guard::LocalAddress | Guard::LocalSocket)
        })
    }

    /// This ruleset less what steers queries for the cluster-DNS IP (and the link-local IP) to
    /// the cache: the `Upstream` route's ruleset, when this is the `Local` one.
    pub fn without_cache_steering(mut self) -> RuleSet {
        for chain in &mut self.chains {
            chain
                .rules
                .retain(|rule| !matches!(rule.guard, Guard::LocalAddress | Guard::LocalSocket));
        }
        self
    }

    /// Every rule, with the chain it belongs to.
    pub fn rules(&self) -> impl Iterator<Item = (&Chain, &Rule)> {
        self.chains.iter().flat_map(|chain| chain.rules.iter().map(move |rule| (chain, rule)))
    }
}

/// The link-local fallback chain, at priority mangle on prerouting, where pods' packets and host
/// clients' (which come back in on `lo`, the link-local IP being local) both pass:
///
/// * the agent's own probes (from the loopback address) always go to the cache itself;
/// * [`Route::Local`]: a query goes to the cache while a socket of its own is bound to the
///   address (the same kernel fast path as the cluster-DNS IP's; a transparent socket is the
///   forwarder's, a wildcard one another server's);
/// * otherwise, and always in [`Route::Upstream`] (a hung cache still has its socket), TPROXY
///   hands it to the agent's forwarder, which sends it on to CoreDNS and answers from the
///   link-local IP. No NAT and no conntrack entry anywhere: the NOTRACK of the link-local IP in
///   raw stays as it is.
fn fallback(local: &[IpAddr], route: Route) -> Chain {
    let mut rules = Vec::new();
    for &ip in local {
        for proto in [Proto::Udp, Proto::Tcp] {
            let rule = |guard, action, comment| Rule::queries(ip, proto, guard, action, comment);
            rules.push(rule(
                Guard::FromLoopback,
                Action::Accept,
                "the agent's probes to the cache",
            ));
            if route == Route::Local {
                rules.push(rule(Guard::LocalSocket, Action::Accept, "to cache while it listens"));
            }
            let to_forwarder = Action::Tproxy(forwarder_for(ip));
            rules.push(rule(Guard::None, to_forwarder, "to the agent's forwarder"));
        }
    }
    Chain { name: "fallback", hook: Hook::Prerouting, priority: FALLBACK_PRIORITY, rules }
}

/// nft's spelling of a priority: named relative to `raw` (-300) when close to it.
fn priority_text(priority: i32) -> String {
    const RAW: i32 = -300;
    if priority == FALLBACK_PRIORITY {
        return "mangle".to_owned();
    }
    match priority - RAW {
        0 => "raw".to_owned(),
        d if (1..=10).contains(&d) => format!("raw + {d}"),
        d if (-10..0).contains(&d) => format!("raw - {}", -d),
        _ => priority.to_string(),
    }
}

impl fmt::Display for Rule {
    /// The rule as `nft list` prints it, without counter values.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let family = match self.addr {
            IpAddr::V4(_) => "ip",
            IpAddr::V6(_) => "ip6",
        };
        let (addr, port) = match self.side {
            Side::Destination => ("daddr", "dport"),
            Side::Source => ("saddr", "sport"),
        };
        write!(f, "{family} {addr} {} {} {port} {}", self.addr, self.proto.as_str(), self.port)?;
        match self.guard {
            Guard::None => {}
            Guard::LocalAddress => f.write_str(" fib daddr type local")?,
            Guard::LocalSocket => {
                f.write_str(" fib daddr type local socket transparent 0")?;
                if self.proto == Proto::Udp {
                    f.write_str(" socket wildcard 0")?;
                }
            }
            Guard::FromLoopback => match self.addr {
                IpAddr::V4(_) => f.write_str(" ip saddr 127.0.0.1")?,
                IpAddr::V6(_) => f.write_str(" ip6 saddr ::1")?,
            },
            Guard::ToLoopback => match self.addr {
                IpAddr::V4(_) => f.write_str(" ip daddr 127.0.0.1")?,
                IpAddr::V6(_) => f.write_str(" ip6 daddr ::1")?,
            },
            Guard::OnLoopback => f.write_str(" iif \"lo\"")?,
            Guard::FromForwarder => match self.addr {
                IpAddr::V4(_) => write!(f, " ip ttl {FORWARDER_HOP_LIMIT}")?,
                IpAddr::V6(_) => write!(f, " ip6 hoplimit {FORWARDER_HOP_LIMIT}")?,
            },
            Guard::NotUntracked => f.write_str(" ct state != untracked")?,
        }
        f.write_str(" counter ")?;
        match self.action {
            Action::Notrack => f.write_str("notrack")?,
            Action::Accept => f.write_str("accept")?,
            Action::Tproxy(to @ SocketAddr::V4(_)) => write!(f, "tproxy ip to {to}")?,
            Action::Tproxy(to @ SocketAddr::V6(_)) => write!(f, "tproxy ip6 to {to}")?,
            Action::Track => f.write_str("ct zone set 0")?,
        }
        write!(f, " comment \"{}\"", self.comment)
    }
}

impl fmt::Display for RuleSet {
    /// The table as `nft list table inet nodelocaldns-ha` prints it, without counter values.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "table inet {TABLE} {{")?;
        for (i, chain) in self.chains.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            writeln!(f, "\tchain {} {{", chain.name())?;
            writeln!(
                f,
                "\t\ttype filter hook {} priority {}; policy accept;",
                chain.hook.as_str(),
                priority_text(chain.priority)
            )?;
            for rule in &chain.rules {
                writeln!(f, "\t\t{rule}")?;
            }
            writeln!(f, "\t}}")?;
        }
        writeln!(f, "}}")
    }
}

#[cfg(test)]
mod tests;

//! Would the node's own nftables firewall let pods reach the cache?
//!
//! A NOTRACKed query is neither NEW nor ESTABLISHED, and an `accept` in the agent's table ends
//! only the agent's chain: every other base chain on the `input` hook (and, for the replies, on
//! `output`) still judges the packet, and one that drops or rejects it wins. firewalld's
//! nftables backend and many `/etc/nftables.conf` end their input chain with a `reject`. The
//! agent cannot override such a chain; what it can do is not steer pods into it: while one
//! would stop pods' queries to the cluster-DNS IP (or the cache's replies to them), the route
//! stays `Upstream`, and `status` names the chain and the rule that lets DNS through.
//!
//! This module evaluates decoded nftables chains ([`Table`]) for the packets that matter, with
//! what is known of them: their family, protocol, the listen address and port 53, a `ct state`
//! of `untracked`, and where they come from: each place pods live on the node ([`PodSource`]:
//! an interface and the addresses routed to it, as `pods.rs` reads them from the node's routes),
//! judged one at a time, so that firewalld's trusted zone for the pod CIDR (`ip saddr
//! 10.244.0.0/16 goto filter_IN_trusted`) or the CNI's interface (`iifname "cni0" …`) is seen to
//! let them through. Without a known place, the interface is only known
//! not to be `lo`. Anything else (a port of the pod's, a set, an expression this module does
//! not model) is unknown, and an unknown match is taken both ways: a chain that *may* drop the
//! packet counts as dropping it, and only an `accept` that surely matches counts as letting it
//! through. No I/O: the tables come from `dataplane::nftables::Nftables::host_firewall`, and
//! `dataplane::nftables::watch_firewall` reads them again whenever they may have changed, for
//! the control loop.

use std::fmt;
use std::net::IpAddr;

mod pods;
pub use pods::{pod_sources, read_pod_sources, PodSource};

/// `NF_INET_LOCAL_IN`.
pub const HOOK_INPUT: u32 = 1;
/// `NF_INET_LOCAL_OUT`.
pub const HOOK_OUTPUT: u32 = 3;
/// `NF_DROP` / `NF_ACCEPT`, also a base chain's policy.
pub const NF_DROP: u32 = 0;
pub const NF_ACCEPT: u32 = 1;

/// nftables chains nest at most this deep (the kernel's `NFT_JUMP_STACK_SIZE`).
const MAX_DEPTH: usize = 16;

/// `enum nft_meta_keys`.
const META_IIFNAME: u32 = 6;
const META_OIFNAME: u32 = 7;
const META_NFPROTO: u32 = 15;
const META_L4PROTO: u32 = 16;
/// `enum nft_ct_keys`: the state; for an untracked packet every other key stops the rule.
const CT_STATE: u32 = 0;
/// `NF_CT_STATE_UNTRACKED_BIT`.
const CT_STATE_UNTRACKED: u32 = 1 << 6;
/// `enum nft_payload_bases`.
const PAYLOAD_NETWORK: u32 = 1;
const PAYLOAD_TRANSPORT: u32 = 2;
/// `enum nft_cmp_ops`.
const CMP_EQ: u32 = 0;
const CMP_NEQ: u32 = 1;

/// One expression of a rule, as far as the evaluation needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expr {
    /// `meta load <key> => reg`.
    Meta { key: u32, dreg: u32 },
    /// `payload load <len>b @ <base> + <offset> => reg`.
    Payload { base: u32, offset: u32, len: u32, dreg: u32 },
    /// `cmp <op> reg <data>`.
    Cmp { sreg: u32, op: u32, data: Vec<u8> },
    /// `bitwise reg = (reg & mask) ^ xor`.
    Bitwise { sreg: u32, dreg: u32, mask: Vec<u8>, xor: Vec<u8> },
    /// `ct load <key> => reg`.
    Ct { key: u32, dreg: u32 },
    /// `immediate` into the verdict register.
    Verdict(Verdict),
    /// `reject`: the packet is dropped (with an ICMP error or a TCP reset).
    Reject,
    /// `counter`, `log`: no effect on the verdict or the match.
    Passive,
    /// Anything else (`lookup`, `range`, `limit`, …): its match is unknown.
    Other(String),
}

/// A verdict an `immediate` sets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Accept,
    Drop,
    Continue,
    Return,
    Jump(String),
    Goto(String),
    /// `queue` and the like: the packet leaves for somewhere this module cannot follow.
    Other(i32),
}

/// One rule: its expressions in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    pub exprs: Vec<Expr>,
}

/// A chain; base chains have a hook and a policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    pub name: String,
    /// `NF_INET_*` and the priority, for a base chain.
    pub hook: Option<(u32, i32)>,
    pub policy: Option<u32>,
    pub rules: Vec<Rule>,
}

/// A table of another owner than the agent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    /// `NFPROTO_*`: 1 inet, 2 ip, 10 ip6.
    pub family: u8,
    pub name: String,
    pub chains: Vec<Chain>,
}

impl Table {
    /// `inet firewalld`, as `nft` names a table.
    pub fn spelled(&self) -> String {
        let family = match self.family {
            1 => "inet",
            2 => "ip",
            10 => "ip6",
            3 => "arp",
            5 => "netdev",
            7 => "bridge",
            other => return format!("family-{other} {}", self.name),
        };
        format!("{family} {}", self.name)
    }

    fn chain(&self, name: &str) -> Option<&Chain> {
        self.chains.iter().find(|c| c.name == name)
    }
}

/// Which way a packet the cache needs goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// A pod's query to a listen address, port 53 (the `input` hook).
    Query,
    /// The cache's reply from a listen address, port 53 (the `output` hook).
    Reply,
}

/// A chain that would (or may) drop DNS between pods and the cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Blocking {
    /// e.g. `inet firewalld`.
    pub table: String,
    pub chain: String,
    pub direction: Direction,
    /// The listen address whose traffic it stops.
    pub addr: IpAddr,
    /// The pods it stops, when known: the first place of theirs it stops.
    pub pods: Option<PodSource>,
    /// Whether it surely drops (no unknown on the way) or only may.
    pub surely: bool,
}

impl Blocking {
    /// The hook its chain is on.
    pub fn hook(&self) -> &'static str {
        match self.direction {
            Direction::Query => "input",
            Direction::Reply => "output",
        }
    }

    /// The rule that lets the traffic through, as an `nft` command.
    pub fn fix(&self) -> String {
        let family = if self.addr.is_ipv4() { "ip" } else { "ip6" };
        let (addr, port) = match self.direction {
            Direction::Query => ("daddr", "dport"),
            Direction::Reply => ("saddr", "sport"),
        };
        format!(
            "nft insert rule {} {} {family} {addr} {} th {port} 53 accept",
            self.table, self.chain, self.addr
        )
    }
}

impl fmt::Display for Blocking {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hook = self.hook();
        let mut what = match self.direction {
            Direction::Query => format!("pods' DNS queries to {}", self.addr),
            Direction::Reply => format!("the cache's DNS replies from {}", self.addr),
        };
        if let Some(pods) = &self.pods {
            what += &format!(" (pods on {pods})");
        }
        let verb = if self.surely { "drops or rejects" } else { "may drop or reject" };
        write!(
            f,
            "nftables chain {} {} (hook {hook}) {verb} {what}; to let them through, add `{}`",
            self.table,
            self.chain,
            self.fix()
        )
    }
}

/// The chains of `tables` that would stop DNS between pods and the cache for any of `addrs`, in
/// either direction, over UDP or TCP, for the pods of any of `pods` (of the address's family;
/// pods from anywhere but `lo` when none is).
pub fn blocking(tables: &[Table], addrs: &[IpAddr], pods: &[PodSource]) -> Vec<Blocking> {
    let mut found = Vec::new();
    for table in tables {
        for chain in &table.chains {
            let Some((hook, _)) = chain.hook else { continue };
            let direction = match hook {
                HOOK_INPUT => Direction::Query,
                HOOK_OUTPUT => Direction::Reply,
                _ => continue,
            };
            for &addr in addrs {
                if !family_sees(table.family, addr) {
                    continue;
                }
                let places: Vec<_> =
                    pods.iter().filter(|p| p.net.is_ipv4() == addr.is_ipv4()).map(Some).collect();
                let places = if places.is_empty() { vec![None] } else { places };
                // The first place it stops, the one it surely stops if any.
                let mut worst: Option<(bool, Option<&PodSource>)> = None;
                for source in places {
                    for l4proto in [UDP, TCP] {
                        let packet = Packet { direction, addr, l4proto, source };
                        let out = evaluate(table, chain, &packet, 0);
                        let policy_drops = chain.policy == Some(NF_DROP) && (out.fall || out.ret);
                        if out.drop || policy_drops {
                            let surely = !out.accept && !out.unknown;
                            if worst.is_none_or(|(was, _)| surely && !was) {
                                worst = Some((surely, source));
                            }
                        }
                    }
                }
                if let Some((surely, pods)) = worst {
                    found.push(Blocking {
                        table: table.spelled(),
                        chain: chain.name.clone(),
                        direction,
                        addr,
                        pods: pods.cloned(),
                        surely,
                    });
                }
            }
        }
    }
    found
}

/// Whether a table of `family` sees packets of `addr`'s family.
fn family_sees(family: u8, addr: IpAddr) -> bool {
    match family {
        1 => true,
        2 => addr.is_ipv4(),
        10 => addr.is_ipv6(),
        _ => false,
    }
}

const UDP: u8 = 17;
const TCP: u8 = 6;

/// The packet judged: what is known of it.
struct Packet<'a> {
    direction: Direction,
    addr: IpAddr,
    l4proto: u8,
    /// Where the pod is, when known.
    source: Option<&'a PodSource>,
}

/// What a register holds.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Value {
    /// Bytes of which the bits set in `known` are known (a pod's address: its prefix's).
    Bits {
        value: Vec<u8>,
        known: Vec<u8>,
    },
    /// An interface name that is not `lo` (pods' traffic never arrives on it).
    NotLo,
    Unknown,
}

impl Value {
    fn known(value: Vec<u8>) -> Value {
        let known = vec![0xff; value.len()];
        Value::Bits { value, known }
    }
}

impl Packet<'_> {
    fn meta(&self, key: u32) -> Value {
        let pods_side = match (key, self.direction) {
            (META_IIFNAME, Direction::Query) | (META_OIFNAME, Direction::Reply) => true,
            (META_IIFNAME | META_OIFNAME, _) => return Value::Unknown,
            _ => false,
        };
        match key {
            META_NFPROTO => Value::known(vec![if self.addr.is_ipv4() { 2 } else { 10 }]),
            META_L4PROTO => Value::known(vec![self.l4proto]),
            _ if pods_side => match self.source {
                // As the kernel loads it: IFNAMSIZ bytes, the name and zeros.
                Some(pods) => {
                    let mut name = pods.iface.as_bytes().to_vec();
                    name.resize(16, 0);
                    Value::known(name)
                }
                None => Value::NotLo,
            },
            _ => Value::Unknown,
        }
    }

    /// `payload load`: the bytes of the header `base` at `offset`, as far as they are known,
    /// whatever part of a field they are (nft loads two bytes of `ip saddr 10.244.0.0/16`).
    fn payload(&self, base: u32, offset: u32, len: u32) -> Value {
        let (mut value, mut known) = match base {
            PAYLOAD_NETWORK if self.addr.is_ipv4() => (vec![0; 20], vec![0; 20]),
            PAYLOAD_NETWORK => (vec![0; 40], vec![0; 40]),
            PAYLOAD_TRANSPORT => (vec![0; 4], vec![0; 4]),
            _ => return Value::Unknown,
        };
        let mut put = |at: usize, field: Value| {
            if let Value::Bits { value: v, known: k } = field {
                value[at..at + v.len()].copy_from_slice(&v);
                known[at..at + k.len()].copy_from_slice(&k);
            }
        };
        let ours = Value::known(match self.addr {
            IpAddr::V4(a) => a.octets().to_vec(),
            IpAddr::V6(a) => a.octets().to_vec(),
        });
        let pods = self.source.map_or(Value::Unknown, PodSource::bits);
        // A query goes from the pod to ours, port 53; a reply the other way.
        let (from, to) = match self.direction {
            Direction::Query => (pods, ours),
            Direction::Reply => (ours, pods),
        };
        let port = Value::known(53u16.to_be_bytes().to_vec());
        match (base, self.addr.is_ipv4()) {
            (PAYLOAD_NETWORK, true) => {
                put(9, Value::known(vec![self.l4proto]));
                put(12, from);
                put(16, to);
            }
            (PAYLOAD_NETWORK, false) => {
                put(6, Value::known(vec![self.l4proto]));
                put(8, from);
                put(24, to);
            }
            _ => match self.direction {
                Direction::Query => put(2, port),
                Direction::Reply => put(0, port),
            },
        }
        let (at, len) = (offset as usize, len as usize);
        if at + len > value.len() {
            return Value::Unknown;
        }
        Value::Bits { value: value[at..at + len].to_vec(), known: known[at..at + len].to_vec() }
    }
}

/// Three-valued truth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Truth {
    True,
    False,
    Unknown,
}

/// What evaluating a chain can come to, each possibly.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Outcomes {
    accept: bool,
    drop: bool,
    /// Fell off the end (or `continue` past it): on to the caller's next rule.
    fall: bool,
    /// `return`, or a `goto` target that fell off: back to the caller of this chain.
    ret: bool,
    /// An unknown match was taken both ways somewhere.
    unknown: bool,
}

fn evaluate(table: &Table, chain: &Chain, packet: &Packet, depth: usize) -> Outcomes {
    let mut out = Outcomes::default();
    if depth >= MAX_DEPTH {
        out.drop = true;
        out.unknown = true;
        return out;
    }
    for rule in &chain.rules {
        let (truth, verdict) = run_rule(rule, packet);
        if truth == Truth::False {
            continue;
        }
        out.unknown |= truth == Truth::Unknown;
        // Where the verdict takes the packet: terminal outcomes, and whether this chain goes on.
        let (effect, goes_on) = match verdict {
            None | Some(Verdict::Continue) => (Outcomes::default(), true),
            Some(Verdict::Accept) => (Outcomes { accept: true, ..Outcomes::default() }, false),
            Some(Verdict::Drop) | Some(Verdict::Other(_)) => {
                (Outcomes { drop: true, ..Outcomes::default() }, false)
            }
            Some(Verdict::Return) => (Outcomes { ret: true, ..Outcomes::default() }, false),
            Some(Verdict::Jump(target)) => follow(table, &target, packet, depth, true),
            Some(Verdict::Goto(target)) => follow(table, &target, packet, depth, false),
        };
        out.accept |= effect.accept;
        out.drop |= effect.drop;
        out.ret |= effect.ret;
        out.unknown |= effect.unknown;
        if !(goes_on || truth == Truth::Unknown) {
            return out;
        }
    }
    out.fall = true;
    out
}

/// A `jump` (or `goto`) to `target`: what it can come to, and whether the calling chain goes
/// on after it (a jump whose target falls off or returns; a goto's does not come back here).
fn follow(
    table: &Table,
    target: &str,
    packet: &Packet,
    depth: usize,
    jump: bool,
) -> (Outcomes, bool) {
    let sub = match table.chain(target) {
        Some(c) => evaluate(table, c, packet, depth + 1),
        None => Outcomes { drop: true, unknown: true, ..Outcomes::default() },
    };
    let back = sub.fall || sub.ret;
    let effect = Outcomes {
        accept: sub.accept,
        drop: sub.drop,
        ret: !jump && back,
        unknown: sub.unknown,
        fall: false,
    };
    (effect, jump && back)
}

/// Whether the rule matches the packet, and its verdict (`None`: it only counts or logs).
fn run_rule(rule: &Rule, packet: &Packet) -> (Truth, Option<Verdict>) {
    let mut regs: Vec<(u32, Value)> = Vec::new();
    let get = |regs: &[(u32, Value)], r: u32| {
        regs.iter().rev().find(|(n, _)| *n == r).map_or(Value::Unknown, |(_, v)| v.clone())
    };
    let mut truth = Truth::True;
    let mut verdict = None;
    for expr in &rule.exprs {
        match expr {
            Expr::Meta { key, dreg } => regs.push((*dreg, packet.meta(*key))),
            Expr::Payload { base, offset, len, dreg } => {
                regs.push((*dreg, packet.payload(*base, *offset, *len)))
            }
            Expr::Ct { key, dreg } => {
                if *key != CT_STATE {
                    // An untracked packet has no conntrack entry: the rule stops here.
                    return (Truth::False, None);
                }
                regs.push((*dreg, Value::known(CT_STATE_UNTRACKED.to_ne_bytes().to_vec())));
            }
            Expr::Bitwise { sreg, dreg, mask, xor } => {
                let value = match get(&regs, *sreg) {
                    Value::Bits { value, known }
                        if value.len() == mask.len() && value.len() == xor.len() =>
                    {
                        // A bit masked out is known (zero, then xor's).
                        let bytes = value.iter().zip(mask).zip(xor);
                        Value::Bits {
                            value: bytes.map(|((b, m), x)| (b & m) ^ x).collect(),
                            known: known.iter().zip(mask).map(|(k, m)| k | !m).collect(),
                        }
                    }
                    _ => Value::Unknown,
                };
                regs.push((*dreg, value));
            }
            Expr::Cmp { sreg, op, data } => {
                let t = compare(&get(&regs, *sreg), *op, data);
                match t {
                    Truth::False => return (Truth::False, None),
                    Truth::Unknown => truth = Truth::Unknown,
                    Truth::True => {}
                }
            }
            Expr::Verdict(v) => verdict = Some(v.clone()),
            Expr::Reject => verdict = Some(Verdict::Drop),
            Expr::Passive => {}
            Expr::Other(_) => truth = Truth::Unknown,
        }
    }
    (truth, verdict)
}

/// `cmp`: the register's first `data.len()` bytes against `data`, as the kernel's memcmp (an
/// interface name is loaded whole and compared with a prefix for `iifname "cali*"`).
fn compare(value: &Value, op: u32, data: &[u8]) -> Truth {
    let n = data.len();
    let equal = match value {
        Value::Bits { value, known } if value.len() >= n => {
            let differs = (0..n).any(|i| (value[i] ^ data[i]) & known[i] != 0);
            let whole = known[..n].iter().all(|&k| k == 0xff);
            if differs {
                Some(false)
            } else {
                whole.then_some(true)
            }
        }
        Value::NotLo => {
            let lo = data.starts_with(b"lo\0") || data == b"lo";
            lo.then_some(false)
        }
        _ => None,
    };
    match (equal, op) {
        (Some(eq), CMP_EQ) => truth(eq),
        (Some(eq), CMP_NEQ) => truth(!eq),
        (Some(_), _) => match value {
            // Orderings compare bytes, like the kernel's memcmp, when all are known.
            Value::Bits { value: v, known } if known[..n].iter().all(|&k| k == 0xff) => {
                let ord = v[..n].cmp(data);
                truth(match op {
                    2 => ord.is_lt(),
                    3 => ord.is_le(),
                    4 => ord.is_gt(),
                    5 => ord.is_ge(),
                    _ => return Truth::Unknown,
                })
            }
            _ => Truth::Unknown,
        },
        (None, _) => Truth::Unknown,
    }
}

fn truth(b: bool) -> Truth {
    if b {
        Truth::True
    } else {
        Truth::False
    }
}

#[cfg(test)]
mod tests;

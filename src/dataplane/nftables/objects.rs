//! nf_tables objects (tables, chains, rules and their expressions) as netlink messages carry
//! them: the requests that list them, and the parsers of the kernel's answers, which read them as
//! the backend compares them (its own table) and as [`crate::firewall`] judges them (the node's).
//!
//! Pure and safe: it works on byte slices that [`crate::netlink`] has cut into messages and
//! attributes, and never panics on malformed input (a bad length or value is a [`ParseError`]).
//! It knows only the attributes it is asked about. Numbers are from
//! `linux/netfilter/nf_tables.h` and `linux/netfilter/nfnetlink.h`: nf_tables attribute values
//! are big-endian.

use super::expr::{Expr, Found, NFT_REG_1, NFT_REG_2, NFT_REG_VERDICT, NF_ACCEPT};
use crate::firewall;
use crate::netlink::{
    attribute_table, attributes, be_u32, be_u64, put_attr, required, string, Message, ParseError,
    Result,
};

/// The nfnetlink subsystem of nf_tables, the high byte of the message type.
pub const NFNL_SUBSYS_NFTABLES: u16 = 10;
/// A table (the low byte of the type of a reply or notification).
pub const NFT_MSG_NEWTABLE: u16 = 0;
/// Get one table by name.
pub const NFT_MSG_GETTABLE: u16 = 1;
/// A chain.
pub const NFT_MSG_NEWCHAIN: u16 = 3;
/// Dump the chains.
pub const NFT_MSG_GETCHAIN: u16 = 4;
/// A rule.
pub const NFT_MSG_NEWRULE: u16 = 6;
/// Dump the rules (of one table, given `NFTA_RULE_TABLE`).
pub const NFT_MSG_GETRULE: u16 = 7;
/// Get the ruleset's generation.
pub const NFT_MSG_GETGEN: u16 = libc::NFT_MSG_GETGEN as u16;
/// `NFTA_GEN_ID`, in the answer to [`NFT_MSG_GETGEN`].
pub const NFTA_GEN_ID: u16 = 1;
/// The name in a table request.
pub const NFTA_TABLE_NAME: u16 = table::NAME;
/// The table filter of a rule dump.
pub const NFTA_RULE_TABLE: u16 = rule::TABLE;
/// A rule's chain.
pub const NFTA_RULE_CHAIN: u16 = rule::CHAIN;

const NFGENMSG_LEN: usize = 4;
/// `NFTNL_UDATA_RULE_COMMENT`: the comment in a rule's userdata.
const UDATA_RULE_COMMENT: u8 = 0;

/// Attributes of tables (`enum nft_table_attributes`).
mod table {
    pub const NAME: u16 = 1;
    pub const FLAGS: u16 = 2;
    pub const MAX: usize = 3;
}

/// Attributes of chains (`enum nft_chain_attributes`, `enum nft_hook_attributes`).
mod chain {
    pub const TABLE: u16 = 1;
    pub const NAME: u16 = 3;
    pub const HOOK: u16 = 4;
    pub const POLICY: u16 = 5;
    pub const TYPE: u16 = 7;
    pub const MAX: usize = 8;
    pub const HOOK_HOOKNUM: u16 = 1;
    pub const HOOK_PRIORITY: u16 = 2;
    pub const HOOK_MAX: usize = 3;
}

/// Attributes of rules and expressions (`enum nft_rule_attributes`, `enum nft_expr_attributes`,
/// `enum nft_list_attributes`).
mod rule {
    pub const TABLE: u16 = 1;
    pub const CHAIN: u16 = 2;
    pub const HANDLE: u16 = 3;
    pub const EXPRESSIONS: u16 = 4;
    pub const USERDATA: u16 = 7;
    pub const MAX: usize = 8;
    pub const LIST_ELEM: u16 = 1;
    pub const EXPR_NAME: u16 = 1;
    pub const EXPR_DATA: u16 = 2;
    pub const EXPR_MAX: usize = 3;
}

/// The nf_tables message type of `message` (`NFT_MSG_*`), if it is an nf_tables message.
pub fn nft_type(message: &Message<'_>) -> Option<u16> {
    (message.kind >> 8 == NFNL_SUBSYS_NFTABLES).then_some(message.kind & 0xff)
}

/// The ruleset generation (low 16 bits, from `nfgenmsg.res_id`) and the attributes of an
/// nf_tables message.
pub fn nft_body<'a>(message: &Message<'a>) -> Result<(u16, &'a [u8])> {
    let header = message.payload.get(..NFGENMSG_LEN).ok_or(ParseError::Truncated {
        what: "nfgenmsg header",
        have: message.payload.len(),
        need: NFGENMSG_LEN,
    })?;
    let generation = u16::from_be_bytes([header[2], header[3]]);
    Ok((generation, &message.payload[NFGENMSG_LEN..]))
}

/// A table, as `NFT_MSG_NEWTABLE` describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    /// The table's name.
    pub name: String,
    /// `NFT_TABLE_F_*`; e.g. 1 is dormant (its chains see no packets).
    pub flags: u32,
}

/// Parses the attributes of an `NFT_MSG_NEWTABLE` message.
pub fn parse_table(attrs: &[u8]) -> Result<Table> {
    let a = attribute_table::<{ table::MAX }>(attrs)?;
    Ok(Table {
        name: string(required(a[table::NAME as usize], "table name")?),
        flags: a[table::FLAGS as usize].map(|v| be_u32(v, "table flags")).transpose()?.unwrap_or(0),
    })
}

/// The hook of a base chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChainHook {
    /// `NF_INET_*`.
    pub hooknum: u32,
    /// Lower runs first; raw is -300.
    pub priority: i32,
}

/// A chain, as `NFT_MSG_NEWCHAIN` describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    /// The table's name.
    pub table: String,
    /// The chain's name.
    pub name: String,
    /// `None` for a regular chain.
    pub hook: Option<ChainHook>,
    /// `filter`, `nat`, `route`; base chains only.
    pub chain_type: Option<String>,
    /// `NF_ACCEPT` or `NF_DROP`; base chains only.
    pub policy: Option<u32>,
}

/// Parses the attributes of an `NFT_MSG_NEWCHAIN` message.
pub fn parse_chain(attrs: &[u8]) -> Result<Chain> {
    let a = attribute_table::<{ chain::MAX }>(attrs)?;
    let hook = match a[chain::HOOK as usize] {
        None => None,
        Some(nested) => {
            let h = attribute_table::<{ chain::HOOK_MAX }>(nested)?;
            let hooknum = required(h[chain::HOOK_HOOKNUM as usize], "chain hook number")?;
            let priority = required(h[chain::HOOK_PRIORITY as usize], "chain priority")?;
            Some(ChainHook {
                hooknum: be_u32(hooknum, "chain hook number")?,
                priority: be_u32(priority, "chain priority")? as i32,
            })
        }
    };
    Ok(Chain {
        table: string(required(a[chain::TABLE as usize], "chain table")?),
        name: string(required(a[chain::NAME as usize], "chain name")?),
        hook,
        chain_type: a[chain::TYPE as usize].map(string),
        policy: a[chain::POLICY as usize].map(|v| be_u32(v, "chain policy")).transpose()?,
    })
}

/// A rule, as `NFT_MSG_NEWRULE` describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// The table's name.
    pub table: String,
    /// The chain's name.
    pub chain: String,
    /// The rule's handle, unique in its table.
    pub handle: u64,
    /// The expressions, in order.
    pub exprs: Vec<Found>,
    /// The comment from the rule's userdata.
    pub comment: Option<String>,
    /// Packets counted by the rule's `counter`, if it has one.
    pub packets: Option<u64>,
}

impl Rule {
    /// The expressions' names, in order.
    pub fn expr_names(&self) -> Vec<String> {
        self.exprs
            .iter()
            .map(|found| match found {
                Found::Known(expr) => expr.name().to_owned(),
                Found::Other(name) => name.clone(),
            })
            .collect()
    }
}

/// Parses the attributes of an `NFT_MSG_NEWRULE` message.
pub fn parse_rule(attrs: &[u8]) -> Result<Rule> {
    let a = attribute_table::<{ rule::MAX }>(attrs)?;
    let mut exprs = Vec::new();
    let mut packets = None;
    each_expression(a[rule::EXPRESSIONS as usize], |name, data| {
        if name == "counter" {
            // NFTA_COUNTER_BYTES 1, NFTA_COUNTER_PACKETS 2.
            let c = attribute_table::<3>(data)?;
            packets = c[2].map(|v| be_u64(v, "counter packets")).transpose()?;
        }
        exprs.push(parse_expr(name, data)?);
        Ok(())
    })?;
    Ok(Rule {
        table: string(required(a[rule::TABLE as usize], "rule table")?),
        chain: string(required(a[rule::CHAIN as usize], "rule chain")?),
        handle: be_u64(required(a[rule::HANDLE as usize], "rule handle")?, "rule handle")?,
        exprs,
        comment: a[rule::USERDATA as usize].and_then(parse_comment),
        packets,
    })
}

/// Reads a rule of another owner's table for [`crate::firewall`]: its chain and what its
/// expressions do. Expressions that write (a `meta set`, a payload mangle, a `ct set`) or only
/// count are passive; those it does not model are [`firewall::Expr::Other`], an unknown match.
pub fn parse_foreign_rule(attrs: &[u8]) -> Result<(String, firewall::Rule)> {
    let a = attribute_table::<{ rule::MAX }>(attrs)?;
    let chain = string(required(a[rule::CHAIN as usize], "rule chain")?);
    let mut exprs = Vec::new();
    each_expression(a[rule::EXPRESSIONS as usize], |name, data| {
        decode_expr(name, data, &mut exprs)
    })?;
    Ok((chain, firewall::Rule { exprs }))
}

/// Calls `f` with the name and `NFTA_EXPR_DATA` of each expression in a rule's
/// `NFTA_RULE_EXPRESSIONS` list, in order.
fn each_expression(
    list: Option<&[u8]>,
    mut f: impl FnMut(&str, &[u8]) -> Result<()>,
) -> Result<()> {
    for elem in attributes(list.unwrap_or_default()) {
        let elem = elem?;
        if elem.kind != rule::LIST_ELEM {
            continue;
        }
        let e = attribute_table::<{ rule::EXPR_MAX }>(elem.value)?;
        let name = string(required(e[rule::EXPR_NAME as usize], "expression name")?);
        f(&name, e[rule::EXPR_DATA as usize].unwrap_or_default())?;
    }
    Ok(())
}

/// `NFTA_DATA_VALUE` of a nested `nft_data_attributes`.
fn data_value(nested: &[u8], what: &'static str) -> Result<Vec<u8>> {
    let d = attribute_table::<3>(nested)?;
    Ok(required(d[1], what)?.to_vec())
}

/// Appends what expression `name` with `NFTA_EXPR_DATA` `data` does.
fn decode_expr(name: &str, data: &[u8], out: &mut Vec<firewall::Expr>) -> Result<()> {
    use firewall::{Expr, Verdict};
    let a = attribute_table::<9>(data)?;
    let u32_at = |kind: usize, what| required(a[kind], what).and_then(|v| be_u32(v, what));
    let expr = match name {
        // DREG 1, KEY 2, SREG 3 (a `meta set`).
        "meta" if a[3].is_some() => Expr::Passive,
        "meta" => Expr::Meta { key: u32_at(2, "meta key")?, dreg: u32_at(1, "meta register")? },
        // DREG 1, BASE 2, OFFSET 3, LEN 4, SREG 5 (a payload write).
        "payload" if a[5].is_some() => Expr::Passive,
        "payload" => Expr::Payload {
            base: u32_at(2, "payload base")?,
            offset: u32_at(3, "payload offset")?,
            len: u32_at(4, "payload length")?,
            dreg: u32_at(1, "payload register")?,
        },
        // SREG 1, OP 2, DATA 3.
        "cmp" => Expr::Cmp {
            sreg: u32_at(1, "cmp register")?,
            op: u32_at(2, "cmp operator")?,
            data: data_value(required(a[3], "cmp data")?, "cmp data value")?,
        },
        // SREG 1, DREG 2, LEN 3, MASK 4, XOR 5, DATA 6, OP 7: only the boolean form (OP 0).
        "bitwise" if a[7].is_some_and(|op| be_u32(op, "bitwise op").ok() != Some(0)) => {
            Expr::Other("bitwise shift".to_owned())
        }
        "bitwise" => Expr::Bitwise {
            sreg: u32_at(1, "bitwise source")?,
            dreg: u32_at(2, "bitwise destination")?,
            mask: data_value(required(a[4], "bitwise mask")?, "bitwise mask value")?,
            xor: data_value(required(a[5], "bitwise xor")?, "bitwise xor value")?,
        },
        // DREG 1, KEY 2, DIRECTION 3, SREG 4 (a `ct set`).
        "ct" if a[4].is_some() => Expr::Passive,
        "ct" => Expr::Ct { key: u32_at(2, "ct key")?, dreg: u32_at(1, "ct register")? },
        // DREG 1, DATA 2: a verdict when DREG is the verdict register (0).
        "immediate" if u32_at(1, "immediate register")? == 0 => {
            let d = attribute_table::<3>(required(a[2], "immediate data")?)?;
            let v = attribute_table::<3>(required(d[2], "immediate verdict")?)?;
            let code = be_u32(required(v[1], "verdict code")?, "verdict code")? as i32;
            let target = || v[2].map(string).unwrap_or_default();
            Expr::Verdict(match code {
                0 => Verdict::Drop,
                1 => Verdict::Accept,
                -1 => Verdict::Continue,
                -3 => Verdict::Jump(target()),
                -4 => Verdict::Goto(target()),
                -5 => Verdict::Return,
                other => Verdict::Other(other),
            })
        }
        // A verdict map (`vmap`, DREG 3 = the verdict register): a verdict this module cannot
        // read, which may be a drop.
        "lookup" if a[3].and_then(|r| be_u32(r, "lookup register").ok()) == Some(0) => {
            out.push(Expr::Other("vmap".to_owned()));
            Expr::Verdict(Verdict::Other(0))
        }
        "reject" => Expr::Reject,
        "counter" | "log" | "notrack" => Expr::Passive,
        other => Expr::Other(other.to_owned()),
    };
    out.push(expr);
    Ok(())
}

/// Reads an expression's `NFTA_EXPR_DATA`. Attribute numbers are those of `enum nft_meta_attributes`,
/// `nft_payload_attributes`, `nft_cmp_attributes` (+ `nft_data_attributes`), `nft_fib_attributes`
/// `nft_socket_attributes`, `nft_ct_attributes`, `nft_immediate_attributes` and
/// `nft_tproxy_attributes`; the first of each is 1.
pub fn parse_expr(name: &str, data: &[u8]) -> Result<Found> {
    let a = attribute_table::<9>(data)?;
    let u32_at = |kind: usize, what| required(a[kind], what).and_then(|v| be_u32(v, what));
    let other = || Ok(Found::Other(name.to_owned()));
    let expr = match name {
        "meta" => {
            // DREG 1, KEY 2, SREG 3 (a `meta set`).
            if a[3].is_some() || u32_at(1, "meta register")? != NFT_REG_1 {
                return other();
            }
            Expr::Meta { key: u32_at(2, "meta key")? }
        }
        "payload" => {
            // DREG 1, BASE 2, OFFSET 3, LEN 4, SREG 5 (a payload write).
            if a[5].is_some() || u32_at(1, "payload register")? != NFT_REG_1 {
                return other();
            }
            Expr::Payload {
                base: u32_at(2, "payload base")?,
                offset: u32_at(3, "payload offset")?,
                len: u32_at(4, "payload length")?,
            }
        }
        "cmp" => {
            // SREG 1, OP 2, DATA 3 = nested NFTA_DATA_VALUE 1 (or a verdict).
            if u32_at(1, "cmp register")? != NFT_REG_1 {
                return other();
            }
            let nested = attribute_table::<2>(required(a[3], "cmp data")?)?;
            Expr::Cmp {
                op: u32_at(2, "cmp operator")?,
                data: required(nested[1], "cmp data value")?.to_vec(),
            }
        }
        "fib" => {
            // DREG 1, RESULT 2, FLAGS 3.
            if u32_at(1, "fib register")? != NFT_REG_1 {
                return other();
            }
            Expr::Fib { flags: u32_at(3, "fib flags")?, result: u32_at(2, "fib result")? }
        }
        "socket" => {
            // KEY 1, DREG 2, LEVEL 3.
            if u32_at(2, "socket register")? != NFT_REG_1 {
                return other();
            }
            Expr::Socket { key: u32_at(1, "socket key")? }
        }
        // DREG 1, KEY 2, DIRECTION 3, SREG 4 (a `ct set`).
        "ct" => {
            let key = u32_at(2, "ct key")?;
            match (a[1], a[3], a[4]) {
                (Some(_), None, None) if u32_at(1, "ct register")? == NFT_REG_1 => Expr::Ct { key },
                (None, None, Some(_)) if u32_at(4, "ct register")? == NFT_REG_1 => {
                    Expr::CtSet { key }
                }
                _ => return other(),
            }
        }
        "counter" => Expr::Counter,
        "notrack" => Expr::Notrack,
        // DREG 1, DATA 2 = nested NFTA_DATA_VALUE 1, or NFTA_DATA_VERDICT 2 = nested CODE 1.
        "immediate" if a[1].is_none() => return other(),
        "immediate" if u32_at(1, "immediate register")? == NFT_REG_VERDICT => {
            let data = attribute_table::<3>(required(a[2], "immediate data")?)?;
            let verdict = attribute_table::<3>(required(data[2], "immediate verdict")?)?;
            match be_u32(required(verdict[1], "verdict code")?, "verdict code")? {
                NF_ACCEPT if verdict[2].is_none() => Expr::Accept,
                _ => return other(),
            }
        }
        "immediate" => {
            let data = attribute_table::<3>(required(a[2], "immediate data")?)?;
            Expr::Immediate {
                dreg: u32_at(1, "immediate register")?,
                data: required(data[1], "immediate value")?.to_vec(),
            }
        }
        // FAMILY 1, REG_ADDR 2, REG_PORT 3.
        "tproxy" => {
            let registers =
                (u32_at(2, "tproxy address register")?, u32_at(3, "tproxy port register")?);
            if registers != (NFT_REG_1, NFT_REG_2) {
                return other();
            }
            Expr::Tproxy { family: u32_at(1, "tproxy family")? }
        }
        _ => return other(),
    };
    Ok(Found::Known(expr))
}

/// The comment in a rule's userdata: TLVs of a type byte, a length byte and the value; the
/// comment is type 0, NUL-terminated. `None` when absent or malformed.
pub fn parse_comment(udata: &[u8]) -> Option<String> {
    let mut rest = udata;
    while let [kind, len, tail @ ..] = rest {
        let value = tail.get(..usize::from(*len))?;
        if *kind == UDATA_RULE_COMMENT {
            return Some(string(value));
        }
        rest = &tail[value.len()..];
    }
    None
}

/// A request for the nf_tables subsystem: `nlmsghdr`, `nfgenmsg` and attributes (values are
/// given encoded, strings with their NUL).
pub fn request(msg: u16, flags: u16, seq: u32, family: u8, attrs: &[(u16, &[u8])]) -> Vec<u8> {
    // nfgenmsg: family, version NFNETLINK_V0, res_id 0.
    let mut payload = vec![family, 0, 0, 0];
    for (kind, value) in attrs {
        put_attr(&mut payload, *kind, value);
    }
    let kind = (NFNL_SUBSYS_NFTABLES << 8) | msg;
    Message { kind, flags, seq, portid: 0, payload: &payload }.encode()
}

#[cfg(test)]
mod tests;

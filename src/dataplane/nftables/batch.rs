//! The batches that change the agent's table: the whole table replaced (create-if-absent,
//! delete, create, base chains, rules), its chains refilled (each flushed and given its rules,
//! the base chains and their hooks left in place), or deleted. Built with nftnl from
//! [`rule_expressions`], which the read-back compares with too; each message is described for
//! error messages.

use std::ffi::{CStr, CString};

use nftnl::{Batch, FinalizedBatch, MsgType, ProtoFamily};

use super::expr::rule_expressions;
use super::{Error, TABLE_NAME, TRIAL_TABLE_NAME};
use crate::ruleset::{self, Hook, RuleSet};

/// The batch that replaces the table with `rules`, and a description of each of its messages.
pub(super) fn replacing(rules: &RuleSet) -> Result<(FinalizedBatch, Vec<String>), Error> {
    let table = nftnl::Table::new(TABLE_NAME, ProtoFamily::Inet);
    let mut batch = Batch::new();
    let mut described = Vec::new();
    // Creating the table first makes the delete succeed when it is absent.
    for (msg_type, what) in [
        (MsgType::Add, "table (create if absent)"),
        (MsgType::Del, "table (delete)"),
        (MsgType::Add, "table (create)"),
    ] {
        batch.add(&table, msg_type);
        described.push(what.to_owned());
    }
    let chains: Vec<nftnl::Chain<'_>> =
        rules.chains.iter().map(|chain| base_chain(chain, &table)).collect();
    for (nft_chain, chain) in chains.iter().zip(&rules.chains) {
        add_chain(&mut batch, &mut described, nft_chain, chain, "chain")?;
    }
    Ok((batch.finalize(), described))
}

/// The batch that puts `rules` into the base chains already in place: each chain flushed and
/// given its rules, the table and the chains themselves (their hooks) left as they are. A route
/// switch changes rules only, and unregistering and registering hooks is most of what a table's
/// replacement costs the kernel beyond its commit. Refused as a whole (nothing changed) when a
/// chain is missing; a table someone else changed otherwise shows in the read-back.
pub(super) fn refilling(rules: &RuleSet) -> Result<(FinalizedBatch, Vec<String>), Error> {
    let table = nftnl::Table::new(TABLE_NAME, ProtoFamily::Inet);
    let mut batch = Batch::new();
    let mut described = Vec::new();
    let chains: Vec<nftnl::Chain<'_>> =
        rules.chains.iter().map(|chain| named(chain, &table)).collect();
    for (nft_chain, chain) in chains.iter().zip(&rules.chains) {
        // A rule without a handle deletes every rule of its chain.
        batch.add(&nftnl::Rule::new(nft_chain), MsgType::Del);
        described.push(format!("chain {} (flush)", chain.name()));
        add_rules(&mut batch, &mut described, nft_chain, chain, "chain")?;
    }
    Ok((batch.finalize(), described))
}

/// Whether `a` and `b` have the same base chains (names, hooks, priorities, in order), so that
/// one replaces the other by [`refilling`] them.
pub(super) fn same_chains(a: &RuleSet, b: &RuleSet) -> bool {
    let shape = |c: &ruleset::Chain| (c.name(), c.hook, c.priority);
    a.chains.iter().map(shape).eq(b.chains.iter().map(shape))
}

/// The batch that tries `rules`' link-local fallback chains on the kernel and leaves nothing:
/// a table of their own ([`TRIAL_TABLE_NAME`]) created, each fallback chain in it as a regular
/// chain (hooked to nothing, so no packet meets it) with its rules, and the table deleted, in
/// one transaction. The kernel loads and checks every expression of a rule as it takes it, so
/// a kernel without nft_tproxy or nft_socket refuses the batch, and nothing happened. `None`
/// when the ruleset has no fallback.
pub(super) fn trial(rules: &RuleSet) -> Result<Option<(FinalizedBatch, Vec<String>)>, Error> {
    let fallback: Vec<&ruleset::Chain> = rules.chains.iter().filter(|c| c.is_fallback()).collect();
    if fallback.is_empty() {
        return Ok(None);
    }
    let table = nftnl::Table::new(TRIAL_TABLE_NAME, ProtoFamily::Inet);
    let mut batch = Batch::new();
    let mut described = Vec::new();
    batch.add(&table, MsgType::Add);
    described.push("trial table (create)".to_owned());
    let chains: Vec<nftnl::Chain<'_>> = fallback.iter().map(|chain| named(chain, &table)).collect();
    for (nft_chain, chain) in chains.iter().zip(&fallback) {
        add_chain(&mut batch, &mut described, nft_chain, chain, "trial chain")?;
    }
    batch.add(&table, MsgType::Del);
    described.push("trial table (delete)".to_owned());
    Ok(Some((batch.finalize(), described)))
}

/// The least real transaction: a table of its own ([`TRIAL_TABLE_NAME`]) created and deleted.
/// An empty batch is no yardstick (the kernel returns before its commit when there is nothing
/// to commit); this one pays what every writer's commit pays in the namespace.
pub(super) fn floor() -> (FinalizedBatch, Vec<String>) {
    created_and_deleted(TRIAL_TABLE_NAME, ["trial table (create)", "trial table (delete)"])
}

/// The batch that deletes the table, a no-op when it is absent.
pub(super) fn deleting() -> (FinalizedBatch, Vec<String>) {
    created_and_deleted(TABLE_NAME, ["table (create if absent)", "table (delete)"])
}

/// The batch that creates table `name` (if absent) and deletes it, each message `described`.
fn created_and_deleted(name: &CStr, described: [&str; 2]) -> (FinalizedBatch, Vec<String>) {
    let table = nftnl::Table::new(name, ProtoFamily::Inet);
    let mut batch = Batch::new();
    batch.add(&table, MsgType::Add);
    batch.add(&table, MsgType::Del);
    (batch.finalize(), described.map(String::from).into())
}

/// Adds `nft_chain` and `chain`'s rules to `batch`, the chain described as `<what> <name>`.
fn add_chain(
    batch: &mut Batch,
    described: &mut Vec<String>,
    nft_chain: &nftnl::Chain<'_>,
    chain: &ruleset::Chain,
    what: &str,
) -> Result<(), Error> {
    batch.add(nft_chain, MsgType::Add);
    described.push(format!("{what} {}", chain.name()));
    add_rules(batch, described, nft_chain, chain, what)
}

/// Adds `chain`'s rules to `nft_chain` in `batch`, each with its comment, described as
/// `<what> <name>: rule <n> (<rule>)`.
fn add_rules(
    batch: &mut Batch,
    described: &mut Vec<String>,
    nft_chain: &nftnl::Chain<'_>,
    chain: &ruleset::Chain,
    what: &str,
) -> Result<(), Error> {
    for (index, rule) in chain.rules.iter().enumerate() {
        let mut nft_rule = nftnl::Rule::new(nft_chain);
        for expr in rule_expressions(rule) {
            nft_rule.add_expr(&expr);
        }
        let comment_error = || Error::Comment(rule.comment.clone());
        let comment = CString::new(rule.comment.as_str()).map_err(|_| comment_error())?;
        nft_rule.set_comment(comment).map_err(|_| comment_error())?;
        batch.add(&nft_rule, MsgType::Add);
        described.push(format!("{what} {}: rule {} ({rule})", chain.name(), index + 1));
    }
    Ok(())
}

/// `chain` as `type filter hook <hook> priority <priority>; policy accept;`.
fn base_chain<'a>(chain: &ruleset::Chain, table: &'a nftnl::Table) -> nftnl::Chain<'a> {
    let hook = match chain.hook {
        Hook::Prerouting => nftnl::Hook::PreRouting,
        Hook::Output => nftnl::Hook::Out,
    };
    let mut nft_chain = named(chain, table);
    nft_chain.set_hook(hook, chain.priority);
    nft_chain.set_type(nftnl::ChainType::Filter);
    nft_chain.set_policy(nftnl::Policy::Accept);
    nft_chain
}

/// `chain` as a chain of `table` named by one of the ruleset's constants (which hold no NUL),
/// hooked to nothing until a caller says so.
fn named<'a>(chain: &ruleset::Chain, table: &'a nftnl::Table) -> nftnl::Chain<'a> {
    nftnl::Chain::new(CString::new(chain.name()).unwrap_or_default(), table)
}

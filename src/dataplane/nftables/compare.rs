//! The read-back judged: what the kernel reports of the table against the [`RuleSet`] that should
//! be installed, to the last expression value, with the first difference in words. Pure; its
//! tests are with the backend's (`tests.rs`), which build what the kernel would report.

use super::expr::{rule_expressions, Found};
use super::objects;
use crate::dataplane::Check;
use crate::ruleset::{Hook, RuleSet};

/// What is installed, as read back.
#[derive(Debug, Default)]
pub(super) struct Installed {
    pub table: Option<objects::Table>,
    pub chains: Vec<objects::Chain>,
    pub rules: Vec<objects::Rule>,
}

/// `NF_INET_*`, as nftnl and the kernel number hooks.
pub(super) fn hook_number(hook: Hook) -> u32 {
    match hook {
        Hook::Prerouting => libc::NF_INET_PRE_ROUTING as u32,
        Hook::Output => libc::NF_INET_LOCAL_OUT as u32,
    }
}

fn hook_name(number: u32) -> String {
    match number as i32 {
        libc::NF_INET_PRE_ROUTING => "prerouting".to_owned(),
        libc::NF_INET_LOCAL_IN => "input".to_owned(),
        libc::NF_INET_FORWARD => "forward".to_owned(),
        libc::NF_INET_LOCAL_OUT => "output".to_owned(),
        libc::NF_INET_POST_ROUTING => "postrouting".to_owned(),
        _ => format!("hook {number}"),
    }
}

/// Compares what is installed with `want`.
pub(super) fn compare(want: &RuleSet, installed: &Installed) -> Check {
    let Some(table) = &installed.table else {
        return Check::Missing;
    };
    match first_difference(want, table, &installed.chains, &installed.rules) {
        None => Check::Matches,
        Some(difference) => Check::Differs(difference),
    }
}

/// The first way the installed table differs from `want`, in words.
fn first_difference(
    want: &RuleSet,
    table: &objects::Table,
    chains: &[objects::Chain],
    rules: &[objects::Rule],
) -> Option<String> {
    if table.flags != 0 {
        return Some(format!(
            "table flags are {:#x}, want 0 (0x1 is dormant: its chains see no packets)",
            table.flags
        ));
    }
    for wanted in &want.chains {
        let name = wanted.name();
        let Some(chain) = chains.iter().find(|chain| chain.name == name) else {
            return Some(format!("chain {name} is missing"));
        };
        let hook =
            objects::ChainHook { hooknum: hook_number(wanted.hook), priority: wanted.priority };
        match chain.hook {
            None => return Some(format!("chain {name} is not a base chain")),
            Some(got) if got != hook => {
                return Some(format!(
                    "chain {name} hooks {} at priority {}, want {} at priority {}",
                    hook_name(got.hooknum),
                    got.priority,
                    hook_name(hook.hooknum),
                    hook.priority
                ))
            }
            Some(_) => {}
        }
        if chain.chain_type.as_deref() != Some("filter") {
            return Some(format!(
                "chain {name} has type {}, want filter",
                chain.chain_type.as_deref().unwrap_or("none")
            ));
        }
        if chain.policy != Some(libc::NF_ACCEPT as u32) {
            let policy = match chain.policy {
                Some(p) if p == libc::NF_DROP as u32 => "drop".to_owned(),
                Some(p) => p.to_string(),
                None => "none".to_owned(),
            };
            return Some(format!("chain {name} has policy {policy}, want accept"));
        }
        let got: Vec<&objects::Rule> = rules.iter().filter(|rule| rule.chain == name).collect();
        if got.len() != wanted.rules.len() {
            return Some(format!("chain {name}: {} rules, want {}", got.len(), wanted.rules.len()));
        }
        for (number, (got, wanted)) in (1..).zip(got.iter().zip(&wanted.rules)) {
            if got.comment.as_deref() != Some(wanted.comment.as_str()) {
                return Some(match &got.comment {
                    Some(comment) => format!(
                        "chain {name}: rule {number} has comment {comment:?}, want {:?}",
                        wanted.comment
                    ),
                    None => format!(
                        "chain {name}: rule {number} has no comment, want {:?}",
                        wanted.comment
                    ),
                });
            }
            let exprs = rule_expressions(wanted);
            if got.exprs.len() != exprs.len() {
                return Some(format!(
                    "chain {name}: rule {number} has {} expressions ({}), want {} ({wanted})",
                    got.exprs.len(),
                    got.expr_names().join(" "),
                    exprs.len()
                ));
            }
            for (index, (got, want)) in (1..).zip(got.exprs.iter().zip(exprs)) {
                if *got != Found::Known(want.clone()) {
                    return Some(format!(
                        "chain {name}: rule {number} expression {index} is `{got}`, want `{want}` \
                         ({wanted})"
                    ));
                }
            }
        }
    }
    if let Some(extra) =
        chains.iter().find(|chain| !want.chains.iter().any(|wanted| wanted.name() == chain.name))
    {
        return Some(format!("extra chain {}", extra.name));
    }
    None
}

//! The pure half of the iptables backend: the agent's rules as `iptables-save` lines, a parser
//! for `iptables-save` output, the comparison of the two, and the `iptables-restore`
//! transactions that install or remove them. No I/O.
//!
//! Rules are rendered exactly as `iptables-save` 1.8 prints them back (legacy and nft alike):
//! `[-s 127.0.0.1/32] -d A/32 -p udp -m udp --dport 53 [-m addrtype --dst-type LOCAL [-m
//! socket]] [-m recent …] -m comment --comment "…" -j <target>`, the target `NOTRACK`, `ACCEPT`,
//! `CT` or `TPROXY --on-port 53 --on-ip 127.53.0.53 --tproxy-mark 0x0/0x0` (whose rule has the
//! forwarder's lease, `-m recent`), so read-back compares text lines, and the same lines are fed
//! to `iptables-restore`. One file past 600 lines: rendering, parsing, comparing and the scripts
//! all speak that one line format, and are read together.

use super::lease_rules::{heartbeat, recent};
use super::table::{Family, Table};
use crate::forwarder::lease;
use crate::ruleset::{Action, FilterHook, Guard, Hook, Rule, RuleSet, Side};

/// The comment on the agent's jumps.
pub(super) const JUMP_COMMENT: &str = "nodelocaldns-ha";

/// A built-in chain and the agent's chain it jumps to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Hooked {
    pub builtin: &'static str,
    pub own: &'static str,
}

impl Hooked {
    /// `-m comment --comment nodelocaldns-ha -j <own>`.
    fn jump_spec(self) -> String {
        format!("-m comment --comment {} -j {}", save_string(JUMP_COMMENT), self.own)
    }

    /// The jump as `iptables-save` prints it.
    pub(super) fn jump(self) -> String {
        format!("-A {} {}", self.builtin, self.jump_spec())
    }
}

/// One of the agent's chains with the rule lines it should hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct WantedChain {
    pub hooked: Hooked,
    /// `-A <own> …` lines, in order.
    pub rules: Vec<String>,
}

/// What one family's table should hold of the agent's: both of its chains, each with its jump.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Wanted {
    pub chains: Vec<WantedChain>,
}

/// The rules of `rules` that `table` holds, in order, each with the built-in chain whose jump
/// leads to it and its target.
fn entries(rules: &RuleSet, table: Table) -> Vec<(&'static str, &Rule, String)> {
    let builtin = |hook| match hook {
        Hook::Prerouting => "PREROUTING",
        Hook::Output => "OUTPUT",
    };
    match table {
        // The NOTRACK chains in raw, the link-local fallback (TPROXY) in mangle.
        Table::Raw | Table::Mangle => rules
            .rules()
            .filter(|(chain, _)| chain.is_fallback() == (table == Table::Mangle))
            .map(|(chain, rule)| (builtin(chain.hook), rule, target(rule.action)))
            .collect(),
        Table::Filter => rules
            .accepts
            .iter()
            .map(|accept| {
                let builtin = match accept.hook {
                    FilterHook::Input => "INPUT",
                    FilterHook::Output => "OUTPUT",
                };
                (builtin, &accept.rule, "ACCEPT".to_owned())
            })
            .collect(),
    }
}

/// A rule's target as `iptables-save` prints it. TPROXY without `--tproxy-mark` is printed
/// with `--tproxy-mark 0x0/0x0`: the packet's mark is left as it is. No mark is needed, since
/// no policy routing is: the packet's destination, the link-local IP, is local already, and
/// TPROXY hands it to the forwarder's socket whatever that socket's address.
fn target(action: Action) -> String {
    match action {
        Action::Notrack => "NOTRACK".to_owned(),
        Action::Accept => "ACCEPT".to_owned(),
        Action::Tproxy(to) => {
            format!("TPROXY --on-port {} --on-ip {} --tproxy-mark 0x0/0x0", to.port(), to.ip())
        }
        // `--zone 0` is the default, which iptables-save leaves out.
        Action::Track => "CT".to_owned(),
    }
}

/// The share of `rules` that `table` holds for `family`; `None` when it has no rules there (the
/// family's table must then hold nothing of the agent's).
pub(super) fn wanted(rules: &RuleSet, table: Table, family: Family) -> Option<Wanted> {
    let mut chains: Vec<WantedChain> =
        table.hooks().iter().map(|&hooked| WantedChain { hooked, rules: Vec::new() }).collect();
    let mut any = false;
    for (builtin, rule, target) in entries(rules, table) {
        if Family::of(rule.addr) != family {
            continue;
        }
        // Every chain of a ruleset hangs from a built-in chain of its table's (the fallback from
        // mangle PREROUTING, the only hook TPROXY works in).
        let chain = chains
            .iter_mut()
            .find(|c| c.hooked.builtin == builtin)
            .expect("a built-in chain of the table");
        if let Action::Tproxy(_) = rule.action {
            let comment = save_string("the forwarder's lease");
            let beat = heartbeat(chain.hooked.own, rule.addr, &comment);
            if !chain.rules.contains(&beat) {
                chain.rules.insert(0, beat);
            }
        }
        chain.rules.push(format!("-A {} {} -j {target}", chain.hooked.own, rule_spec(rule)));
        any = true;
    }
    any.then_some(Wanted { chains })
}

/// The longest comment xt_comment stores; iptables 1.8.9 cuts longer ones short silently.
pub(super) const MAX_COMMENT_BYTES: usize = 255;

/// The first comment of `table`'s share of `rules` that iptables cannot store as it is: too
/// long, or with a control character (a newline would end the restore line).
pub(super) fn unstorable_comment(rules: &RuleSet, table: Table) -> Option<&str> {
    entries(rules, table)
        .into_iter()
        .map(|(_, rule, _)| rule.comment.as_str())
        .find(|comment| comment.len() > MAX_COMMENT_BYTES || comment.chars().any(char::is_control))
}

/// A rule's matches as `iptables-save` prints them.
fn rule_spec(rule: &Rule) -> String {
    let (addr, port) = match rule.side {
        Side::Destination => ("-d", "--dport"),
        Side::Source => ("-s", "--sport"),
    };
    let proto = rule.proto.as_str();
    let family = Family::of(rule.addr);
    let bits = family.host_bits();
    // iptables-save prints the source before the destination.
    let mut spec = match (rule.guard, family) {
        (Guard::FromLoopback, Family::V4) => "-s 127.0.0.1/32 ".to_owned(),
        (Guard::FromLoopback, Family::V6) => "-s ::1/128 ".to_owned(),
        _ => String::new(),
    };
    spec.push_str(&format!("{addr} {}/{bits} ", rule.addr));
    match (rule.guard, family) {
        (Guard::ToLoopback, Family::V4) => spec.push_str("-d 127.0.0.1/32 "),
        (Guard::ToLoopback, Family::V6) => spec.push_str("-d ::1/128 "),
        _ => {}
    }
    if rule.guard == Guard::OnLoopback {
        // iptables-save prints the interface after the addresses, before the protocol.
        spec.push_str("-i lo ");
    }
    spec.push_str(&format!("-p {proto} -m {proto} {port} {}", rule.port));
    // xt_socket ignores sockets bound to 0.0.0.0 / :: (unless `--nowildcard`), as the nftables
    // rule's `socket wildcard 0` does: another DNS server of the node's on the wildcard address
    // must not take pods' queries for the cluster-DNS IP when the cache is gone.
    //
    // Unlike nftables' `socket transparent 0`, xt_socket cannot leave out transparent sockets
    // (`--transparent` keeps only those). That changes nothing. The forwarder's own sockets are
    // bound to 127.53.0.53 and fd00:169:254::53, which no lookup for a packet to a listen IP
    // finds; a transparent socket the lookup does find is one the forwarder accepted from a
    // TPROXYed SYN (local address A:53), and a segment to it is then ACCEPTed and delivered by
    // the ordinary lookup to that same connection, where nftables' TPROXY rule would have
    // assigned it (TPROXY looks for an established socket first). So a TCP connection that
    // began at the forwarder stays there when the cache comes back, in both backends (kernel
    // test: `an_established_forwarder_connection_stays_when_the_cache_returns`). A SYN that
    // meets a TIME_WAIT socket of the dead cache's is ACCEPTed too (the lookup finds it): the
    // TIME_WAIT answers with an ACK, the client resets it and (Linux, at once) sends its SYN
    // again, which TPROXY takes (measured: 10 ms).
    match (rule.guard, family) {
        (Guard::None | Guard::FromLoopback | Guard::ToLoopback | Guard::OnLoopback, _) => {}
        (Guard::LocalAddress, _) => spec.push_str(" -m addrtype --dst-type LOCAL"),
        (Guard::LocalSocket, _) => spec.push_str(" -m addrtype --dst-type LOCAL -m socket"),
        (Guard::FromForwarder, Family::V4) => {
            spec.push_str(&format!(" -m ttl --ttl-eq {}", crate::ruleset::FORWARDER_HOP_LIMIT))
        }
        (Guard::FromForwarder, Family::V6) => {
            spec.push_str(&format!(" -m hl --hl-eq {}", crate::ruleset::FORWARDER_HOP_LIMIT))
        }
        (Guard::NotUntracked, _) => spec.push_str(" -m conntrack ! --ctstate UNTRACKED"),
    }
    // xt_TPROXY drops a packet no socket takes (nftables' `tproxy` lets it go on): TPROXY only
    // while the forwarder holds its lease (`forwarder::lease`), so that a fallback chain left
    // by an agent that is gone hands the queries to the cache a second later.
    if let Action::Tproxy(_) = rule.action {
        spec.push_str(&recent(family, &format!("--rcheck --seconds {}", lease::LEASE_SECONDS)));
    }
    spec.push_str(" -m comment --comment ");
    spec.push_str(&save_string(&rule.comment));
    spec
}

/// A string as `iptables-save` prints it (libxtables' `xtables_save_string`): bare when it is
/// only `[A-Za-z0-9_-]`, else in double quotes with `"`, `\` and `'` escaped by a backslash.
/// `iptables-restore` reads either form back.
pub(super) fn save_string(value: &str) -> String {
    let bare = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    if !value.is_empty() && value.chars().all(bare) {
        return value.to_owned();
    }
    let mut quoted = String::with_capacity(value.len() + 2);
    quoted.push('"');
    for c in value.chars() {
        if matches!(c, '"' | '\\' | '\'') {
            quoted.push('\\');
        }
        quoted.push(c);
    }
    quoted.push('"');
    quoted
}

/// The family's share as `iptables-save -t <table>` prints it where nothing else is in the
/// table (built-in chains aside): user chains sorted by name, jumps in built-in chain order,
/// then each user chain's rules.
pub(super) fn render_family(table: Table, wanted: &Wanted) -> String {
    let mut chains: Vec<&WantedChain> = wanted.chains.iter().collect();
    chains.sort_by_key(|chain| chain.hooked.own);
    let mut text = format!("*{}\n", table.as_str());
    for chain in &chains {
        text.push_str(&format!(":{} - [0:0]\n", chain.hooked.own));
    }
    for chain in &wanted.chains {
        text.push_str(&chain.hooked.jump());
        text.push('\n');
    }
    for chain in &chains {
        for rule in &chain.rules {
            text.push_str(rule);
            text.push('\n');
        }
    }
    text.push_str("COMMIT\n");
    text
}

/// Output of `iptables-save` that this parser does not understand.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: {reason}: `{text}`")]
pub struct ParseError {
    /// 1-based.
    line: usize,
    reason: &'static str,
    text: String,
}

/// One table as `iptables-save` printed it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Saved {
    /// In the order printed (built-in chains first).
    pub chains: Vec<SavedChain>,
}

/// A chain and its rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct SavedChain {
    pub name: String,
    /// `-A <name> …` lines, in order.
    pub rules: Vec<String>,
}

impl Saved {
    fn chain(&self, name: &str) -> Option<&SavedChain> {
        self.chains.iter().find(|chain| chain.name == name)
    }

    /// A chain's rules; none when it does not exist.
    fn rules(&self, name: &str) -> &[String] {
        self.chain(name).map_or(&[], |chain| chain.rules.as_slice())
    }
}

/// Parses `iptables-save` output and keeps `table` (empty when it is not printed). Comments
/// (`# …`, also iptables-nft's warnings) are skipped; a table without `COMMIT` is an error, so a
/// truncated output is never taken for a short table.
pub(super) fn parse_save(text: &str, table: &str) -> Result<Saved, ParseError> {
    let mut saved = Saved::default();
    let mut current: Option<&str> = None;
    let error =
        |line: usize, reason, text: &str| ParseError { line, reason, text: text.to_owned() };
    for (number, line) in (1..).zip(text.lines()) {
        let line = line.trim_end();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(name) = line.strip_prefix('*') {
            if current.is_some() {
                return Err(error(number, "a table starts before the last one's COMMIT", line));
            }
            current = Some(name);
            continue;
        }
        let Some(name) = current else {
            return Err(error(number, "outside a table", line));
        };
        let ours = name == table;
        if line == "COMMIT" {
            current = None;
        } else if let Some(declaration) = line.strip_prefix(':') {
            let chain = declaration.split(' ').next().unwrap_or_default();
            if chain.is_empty() {
                return Err(error(number, "a chain without a name", line));
            }
            if ours {
                saved.chains.push(SavedChain { name: chain.to_owned(), rules: Vec::new() });
            }
        } else if let Some(rule) = line.strip_prefix("-A ") {
            if ours {
                let chain = rule.split(' ').next().unwrap_or_default();
                let Some(entry) = saved.chains.iter_mut().find(|c| c.name == chain) else {
                    return Err(error(number, "a rule in an undeclared chain", line));
                };
                entry.rules.push(line.to_owned());
            }
        } else {
            return Err(error(number, "not a chain, a rule or COMMIT", line));
        }
    }
    match current {
        Some(name) => Err(error(text.lines().count(), "no COMMIT at the end of table", name)),
        None => Ok(saved),
    }
}

/// Chain-scoped listings (`iptables -t <table> -S <chain>`, one after the other) read as one
/// table: `-P <chain> <policy>` and `-N <chain>` declare a chain, `-A` lines are its rules,
/// printed as `iptables-save` prints them.
pub(super) fn parse_listing(text: &str, table: &str) -> Result<Saved, ParseError> {
    let mut save = format!("*{table}\n");
    for (number, line) in (1..).zip(text.lines()) {
        let line = line.trim_end();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(chain) = line.strip_prefix("-P ").or_else(|| line.strip_prefix("-N ")) {
            let name = chain.split(' ').next().unwrap_or_default();
            save.push_str(&format!(":{name} - [0:0]\n"));
        } else if line.starts_with("-A ") {
            save.push_str(line);
            save.push('\n');
        } else {
            return Err(ParseError {
                line: number,
                reason: "not a chain or a rule",
                text: line.to_owned(),
            });
        }
    }
    save.push_str("COMMIT\n");
    parse_save(&save, table)
}

/// Whether `iptables -S <chain>` failed because the chain does not exist: iptables-legacy says
/// "No chain/target/match by that name", iptables-nft 1.8.9 "chain `<chain>' in table `<table>'
/// is incompatible" (its cache holds no such chain). A chain of the agent's that iptables-nft
/// calls incompatible for another reason (someone wrote nft rules into it) is thus taken for
/// absent, and the next apply declares it anew.
pub(super) fn no_such_chain(stderr: &str, chain: &str) -> bool {
    stderr.contains("No chain/target/match by that name")
        || stderr.contains(&format!("chain `{chain}' in table"))
}

/// Whether a saved rule jumps (or goes) to `chain`: a jump to a user chain has no target
/// options, so `-j <chain>` ends the line (a comment ending so would end with a quote).
fn targets(line: &str, chain: &str) -> bool {
    line.strip_suffix(chain).is_some_and(|head| head.ends_with(" -j ") || head.ends_with(" -g "))
}

/// `-A <chain> <spec>` as the `-D <chain> <spec>` that deletes it.
fn delete_line(line: &str) -> String {
    format!("-D {}", line.strip_prefix("-A ").unwrap_or(line))
}

/// How one family's table compares with its share of the ruleset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum State {
    /// Nothing of the agent's is there.
    Nothing,
    /// Exactly the share wanted.
    Matches,
    /// Something else; what differs first.
    Differs(String),
}

/// The first of the agent's objects found in `saved`, in words.
fn leftover(table: Table, saved: &Saved) -> Option<String> {
    let hooks = table.hooks();
    if let Some(hooked) = hooks.iter().find(|h| saved.chain(h.own).is_some()) {
        return Some(format!("chain {} exists", hooked.own));
    }
    saved.chains.iter().flat_map(|chain| &chain.rules).find_map(|rule| {
        hooks.iter().any(|h| targets(rule, h.own)).then(|| format!("`{rule}` is there"))
    })
}

/// Compares one family's table with `wanted` (`None`: the ruleset has no rules there).
pub(super) fn compare(
    table: Table,
    family: Family,
    saved: &Saved,
    wanted: Option<&Wanted>,
) -> State {
    let place = |chain: &str| format!("{} {} {chain}", family.label(), table.as_str());
    let Some(wanted) = wanted else {
        return match leftover(table, saved) {
            None => State::Nothing,
            Some(what) => State::Differs(format!(
                "{} {}: {what}, but the ruleset has no {} rules",
                family.label(),
                table.as_str(),
                family.label()
            )),
        };
    };
    if leftover(table, saved).is_none() {
        return State::Nothing;
    }
    for chain in &wanted.chains {
        let hooked = chain.hooked;
        let Some(own) = saved.chain(hooked.own) else {
            return State::Differs(format!("{}: the chain is missing", place(hooked.own)));
        };
        let builtin = saved.rules(hooked.builtin);
        let jump = hooked.jump();
        let copies = builtin.iter().filter(|rule| targets(rule, hooked.own)).count();
        match builtin.first() {
            None => {
                return State::Differs(format!(
                    "{}: no rules, want the agent's jump `{jump}` first",
                    place(hooked.builtin)
                ))
            }
            Some(first) if *first != jump => {
                return State::Differs(if copies == 0 {
                    format!(
                        "{}: no jump to {}, want `{jump}` first",
                        place(hooked.builtin),
                        hooked.own
                    )
                } else {
                    format!(
                        "{}: first rule is `{first}`, not the agent's jump",
                        place(hooked.builtin)
                    )
                })
            }
            Some(_) if copies > 1 => {
                return State::Differs(format!(
                    "{}: {copies} jumps to {}, want 1",
                    place(hooked.builtin),
                    hooked.own
                ))
            }
            Some(_) => {}
        }
        if own.rules.len() != chain.rules.len() {
            return State::Differs(format!(
                "{}: {} rules, want {}",
                place(hooked.own),
                own.rules.len(),
                chain.rules.len()
            ));
        }
        if let Some((number, (got, want))) =
            (1..).zip(own.rules.iter().zip(&chain.rules)).find(|(_, (got, want))| got != want)
        {
            return State::Differs(format!(
                "{}: rule {number} is `{got}`, want `{want}`",
                place(hooked.own)
            ));
        }
    }
    State::Matches
}

/// One [`Check`](super::Check) from the states of every family's tables (`(family, table,
/// wanted, state)`): the first difference; `Missing` when nothing of the agent's is anywhere; a
/// wanted table with nothing while another has its share differs (an agent that wrote raw but
/// not mangle, say).
pub(super) fn combine(states: Vec<(Family, Table, bool, State)>) -> super::Check {
    use super::Check;
    if let Some(difference) = states.iter().find_map(|(_, _, _, state)| match state {
        State::Differs(difference) => Some(difference.clone()),
        _ => None,
    }) {
        return Check::Differs(difference);
    }
    if states.iter().all(|(_, _, _, state)| *state == State::Nothing) {
        return Check::Missing;
    }
    match states.iter().find(|(_, _, wanted, state)| *wanted && *state == State::Nothing) {
        Some((family, table, _, _)) => Check::Differs(format!(
            "{} {}: nothing of the agent's is installed",
            family.label(),
            table.as_str()
        )),
        None => Check::Matches,
    }
}

/// The start of a transaction on `table` that declares the agent's chains (which creates or
/// flushes them) and appends their rules.
fn chains_section(table: Table, wanted: &Wanted) -> String {
    let mut script = format!("*{}\n", table.as_str());
    for chain in &wanted.chains {
        script.push_str(&format!(":{} - [0:0]\n", chain.hooked.own));
    }
    for rule in wanted.chains.iter().flat_map(|chain| &chain.rules) {
        script.push_str(rule);
        script.push('\n');
    }
    script
}

/// The `iptables-restore --noflush` transaction that makes `saved` hold `wanted`: declaring the
/// agent's chains creates or flushes them; their rules follow; each jump that is not already
/// the first rule and the only copy is deleted (every copy) and inserted at position 1.
pub(super) fn apply_script(table: Table, saved: &Saved, wanted: &Wanted) -> String {
    let mut script = chains_section(table, wanted);
    for chain in &wanted.chains {
        let hooked = chain.hooked;
        let builtin = saved.rules(hooked.builtin);
        let copies: Vec<&String> =
            builtin.iter().filter(|rule| targets(rule, hooked.own)).collect();
        if copies.len() == 1 && builtin.first() == Some(&hooked.jump()) {
            continue;
        }
        for copy in copies {
            script.push_str(&delete_line(copy));
            script.push('\n');
        }
        script.push_str(&format!("-I {} 1 {}\n", hooked.builtin, hooked.jump_spec()));
    }
    script.push_str("COMMIT\n");
    script
}

/// The `iptables-restore --noflush` transaction that refills the agent's chains with `wanted`
/// (declaring a chain creates or flushes it) and leaves every jump as it is: enough when the
/// jumps are known to be in place.
pub(super) fn fill_script(table: Table, wanted: &Wanted) -> String {
    let mut script = chains_section(table, wanted);
    script.push_str("COMMIT\n");
    script
}

/// The `iptables-restore --noflush` input that tries `wanted`'s rules in `table` in a chain no
/// rule jumps to, and deletes it: two commits, as the kernel checks (and loads the modules of)
/// targets and matches when it takes the table. Declaring the chain flushes a leftover trial's.
pub(super) fn trial_script(table: Table, wanted: &Wanted) -> String {
    let (name, trial) = (table.as_str(), "NODELOCALDNS-HA-TRIAL");
    let mut script = format!("*{name}\n:{trial} - [0:0]\n");
    for chain in &wanted.chains {
        let own = format!("-A {} ", chain.hooked.own);
        for rule in &chain.rules {
            let spec = rule.strip_prefix(&own).unwrap_or(rule);
            script.push_str(&format!("-A {trial} {spec}\n"));
        }
    }
    script.push_str(&format!("COMMIT\n*{name}\n-F {trial}\n-X {trial}\nCOMMIT\n"));
    script
}

/// The transaction that removes everything of the agent's from `saved`: every rule in another
/// chain that jumps to one of its chains, then the chains (flushed, then deleted). `None` when
/// nothing is there.
pub(super) fn remove_script(table: Table, saved: &Saved) -> Option<String> {
    let own: Vec<&str> = table.hooks().iter().map(|h| h.own).collect();
    let mut deletes = Vec::new();
    for chain in saved.chains.iter().filter(|c| !own.contains(&c.name.as_str())) {
        for rule in chain.rules.iter().filter(|r| own.iter().any(|o| targets(r, o))) {
            deletes.push(delete_line(rule));
        }
    }
    let present: Vec<&str> =
        own.iter().copied().filter(|name| saved.chain(name).is_some()).collect();
    if deletes.is_empty() && present.is_empty() {
        return None;
    }
    let mut script = format!("*{}\n", table.as_str());
    for line in deletes {
        script.push_str(&line);
        script.push('\n');
    }
    for name in &present {
        script.push_str(&format!("-F {name}\n"));
    }
    for name in &present {
        script.push_str(&format!("-X {name}\n"));
    }
    script.push_str("COMMIT\n");
    Some(script)
}

//! What the webhook reads of a pod, and nothing more: whether it has a spec and annotations (what
//! the patch adds to), its mark and opt-outs, `hostNetwork`, `dnsPolicy`, and its own
//! `dnsConfig`, as far as a pod's resolver could take it.
//!
//! A review comes from the API server, but anything that reaches the port can send one, and the
//! pod is most of it. So the pod's JSON is read once, straight into a [`PodDns`] ([`PodDns::from_json`]):
//! every other member is walked past without being built (serde's `IgnoredAny`, one byte of
//! bookkeeping per level of nesting), labels and annotations are compared with the few keys the
//! webhook knows without being kept, and the pod's own `dnsConfig` is kept only while it could
//! still fit ([`OwnDnsConfig`]): at most 4 nameservers, 33 search domains in 2048 characters,
//! 33 options, each entry at most [`MAX_OWN_ENTRY`] bytes, whatever the size of the pod.
//! Duplicate members count as the last one, as `k8s-openapi` reads them.

use std::fmt;

use k8s_openapi::api::core::v1::Pod;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::mutate::{MARK, MARKED, MAX_NAMESERVERS, MAX_SEARCHES, MAX_SEARCH_CHARS, OPT_OUT};

/// The longest entry of a pod's own `dnsConfig` kept (a nameserver, a search domain, an option's
/// name or value): a domain name's longest. The API server refuses longer nameservers and search
/// domains; no resolver knows an option that long.
pub const MAX_OWN_ENTRY: usize = 253;
/// The most options of a pod's own `dnsConfig` taken, by distinct name: resolvers know about a
/// dozen.
pub const MAX_OWN_OPTIONS: usize = 32;

/// What the webhook reads of a pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodDns {
    /// The pod has a spec, for the patch to add to.
    pub has_spec: bool,
    /// The pod has annotations, for the patch to add the mark to.
    pub has_annotations: bool,
    /// Marked by an earlier pass ([`MARK`]).
    pub marked: bool,
    /// Opted out by a label or an annotation ([`OPT_OUT`]).
    pub opted_out: bool,
    /// `spec.hostNetwork`.
    pub host_network: bool,
    /// `spec.dnsPolicy`.
    pub dns_policy: Option<String>,
    /// `spec.dnsConfig`.
    pub own: OwnDnsConfig,
}

/// A pod's own `dnsConfig`, its entries in order, duplicates dropped, as kubelet merges them:
/// kept while they could fit in what the webhook writes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OwnDnsConfig {
    /// Its nameservers; past [`MAX_NAMESERVERS`] distinct ones it cannot fit.
    pub nameservers: Entries,
    /// Its search domains; past [`MAX_SEARCHES`] distinct ones or [`MAX_SEARCH_CHARS`]
    /// characters it cannot fit.
    pub searches: Entries,
    /// Its options, one per name, the last value given; past [`MAX_OWN_OPTIONS`] names it is
    /// not taken.
    pub options: Vec<(Option<String>, Option<String>)>,
    /// More options than [`MAX_OWN_OPTIONS`].
    pub too_many_options: bool,
    /// An entry longer than [`MAX_OWN_ENTRY`].
    pub too_long: bool,
}

/// Distinct entries of a list, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Entries {
    /// The entries kept.
    pub items: Vec<String>,
    /// Their characters, with a separator between each two.
    chars: usize,
    /// More entries, or characters, than could fit: those past the limit are not kept.
    pub overflow: bool,
}

impl Entries {
    /// Adds `entry` unless it is there already, or the list is past `max` entries or
    /// `max_chars` characters (then marked overflowing).
    fn push(&mut self, entry: &str, max: usize, max_chars: usize) {
        if self.overflow || self.items.iter().any(|i| i == entry) {
            return;
        }
        let chars = self.chars + usize::from(!self.items.is_empty()) + entry.len();
        if self.items.len() == max || chars > max_chars {
            self.overflow = true;
            return;
        }
        self.items.push(entry.to_owned());
        self.chars = chars;
    }
}

impl OwnDnsConfig {
    /// Adds a nameserver.
    pub fn push_nameserver(&mut self, server: &str) {
        if self.fits(server) {
            self.nameservers.push(server, MAX_NAMESERVERS, usize::MAX);
        }
    }

    /// Adds a search domain.
    pub fn push_search(&mut self, search: &str) {
        if self.fits(search) {
            self.searches.push(search, MAX_SEARCHES, MAX_SEARCH_CHARS);
        }
    }

    /// Adds an option: a later one of the same name gives it its value.
    pub fn push_option(&mut self, name: Option<&str>, value: Option<&str>) {
        if !(self.fits(name.unwrap_or_default()) && self.fits(value.unwrap_or_default())) {
            return;
        }
        let value = value.map(str::to_owned);
        if let Some(option) = self.options.iter_mut().find(|(n, _)| n.as_deref() == name) {
            option.1 = value;
        } else if self.options.len() == MAX_OWN_OPTIONS {
            self.too_many_options = true;
        } else {
            self.options.push((name.map(str::to_owned), value));
        }
    }

    /// Whether `entry` is short enough to be kept; marks the config if not.
    fn fits(&mut self, entry: &str) -> bool {
        self.too_long |= entry.len() > MAX_OWN_ENTRY;
        entry.len() <= MAX_OWN_ENTRY
    }
}

impl From<&Pod> for PodDns {
    fn from(pod: &Pod) -> PodDns {
        let meta = &pod.metadata;
        let is = |map: &Option<std::collections::BTreeMap<String, String>>, key: &str, value| {
            map.as_ref().and_then(|m| m.get(key)).is_some_and(|v| v == value)
        };
        let spec = pod.spec.as_ref();
        let mut own = OwnDnsConfig::default();
        if let Some(config) = spec.and_then(|s| s.dns_config.as_ref()) {
            config.nameservers.iter().flatten().for_each(|s| own.push_nameserver(s));
            config.searches.iter().flatten().for_each(|s| own.push_search(s));
            for option in config.options.iter().flatten() {
                own.push_option(option.name.as_deref(), option.value.as_deref());
            }
        }
        PodDns {
            has_spec: spec.is_some(),
            has_annotations: meta.annotations.is_some(),
            marked: is(&meta.annotations, MARK, MARKED),
            opted_out: OPT_OUT
                .iter()
                .any(|k| is(&meta.labels, k, "disabled") || is(&meta.annotations, k, "disabled")),
            host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
            dns_policy: spec.and_then(|s| s.dns_policy.clone()),
            own,
        }
    }
}

impl PodDns {
    /// Reads a pod's JSON (a review's `object`): what the webhook needs of it, or why it is no
    /// pod (not an object, `apiVersion` or `kind` not a pod's, a member the webhook reads of
    /// the wrong type).
    pub fn from_json(json: &str) -> Result<PodDns, serde_json::Error> {
        let mut de = serde_json::Deserializer::from_str(json);
        let pod = de.deserialize_map(PodVisitor)?;
        de.end()?;
        Ok(pod)
    }
}

/// Calls `f` with each key of a map, as a string, and the map to read its value from.
fn each_entry<'de, A: MapAccess<'de>>(
    mut map: A,
    mut f: impl FnMut(&str, &mut A) -> Result<(), A::Error>,
) -> Result<(), A::Error> {
    while let Some(key) = map.next_key_seed(Str(|key: &str| key.to_owned()))? {
        f(&key, &mut map)?;
    }
    Ok(())
}

/// A string, handed to a function as a `&str` without being kept.
struct Str<F>(F);

impl<'de, T, F: FnOnce(&str) -> T> DeserializeSeed<'de> for Str<F> {
    type Value = T;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<T, D::Error> {
        de.deserialize_str(self)
    }
}

impl<'de, T, F: FnOnce(&str) -> T> Visitor<'de> for Str<F> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<T, E> {
        Ok((self.0)(s))
    }
}

/// `null`, or what `seed` reads.
struct Nullable<S>(S);

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for Nullable<S> {
    type Value = Option<S::Value>;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Self::Value, D::Error> {
        de.deserialize_option(self)
    }
}

impl<'de, S: DeserializeSeed<'de>> Visitor<'de> for Nullable<S> {
    type Value = Option<S::Value>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("null or a value")
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, de: D) -> Result<Self::Value, D::Error> {
        self.0.deserialize(de).map(Some)
    }
}

/// A value read by a visitor `V` (a map or a list of the pod's).
struct Seed<V>(V);

impl<'de, V: Visitor<'de>> DeserializeSeed<'de> for Seed<V> {
    type Value = V::Value;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<V::Value, D::Error> {
        de.deserialize_any(self.0)
    }
}

/// Skips a value.
fn skip<'de, A: MapAccess<'de>>(map: &mut A) -> Result<(), A::Error> {
    map.next_value::<IgnoredAny>().map(drop)
}

/// A string value that must be `expected`, as `k8s-openapi` checks a pod's `apiVersion` and
/// `kind`.
fn expect<'de, A: MapAccess<'de>>(map: &mut A, expected: &'static str) -> Result<(), A::Error> {
    let found = map.next_value_seed(Str(|s: &str| (s != expected).then(|| s.to_owned())))?;
    match found {
        None => Ok(()),
        Some(s) => Err(de::Error::invalid_value(de::Unexpected::Str(&s), &expected)),
    }
}

/// Writes a visitor's `expecting`.
macro_rules! expecting {
    ($what:literal) => {
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str($what)
        }
    };
}

struct PodVisitor;

impl<'de> Visitor<'de> for PodVisitor {
    type Value = PodDns;
    expecting!("a pod");

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<PodDns, A::Error> {
        let mut pod = PodDns::default();
        let mut meta = Meta::default();
        let mut spec = None;
        each_entry(map, |key, map| match key {
            "apiVersion" => expect(map, "v1"),
            "kind" => expect(map, "Pod"),
            "metadata" => {
                meta = map.next_value_seed(Nullable(Seed(MetaVisitor)))?.unwrap_or_default();
                Ok(())
            }
            "spec" => {
                spec = map.next_value_seed(Nullable(Seed(SpecVisitor)))?;
                Ok(())
            }
            _ => skip(map),
        })?;
        pod.has_annotations = meta.annotations.is_some();
        let annotations = meta.annotations.unwrap_or_default();
        let labels = meta.labels.unwrap_or_default();
        pod.marked = annotations.marked;
        pod.opted_out = (0..OPT_OUT.len()).any(|i| labels.opted_out[i] || annotations.opted_out[i]);
        if let Some(spec) = spec {
            pod.has_spec = true;
            pod.host_network = spec.host_network.unwrap_or(false);
            pod.dns_policy = spec.dns_policy;
            pod.own = spec.dns_config.unwrap_or_default();
        }
        Ok(pod)
    }
}

/// What the webhook reads of a pod's metadata.
#[derive(Default)]
struct Meta {
    labels: Option<Marks>,
    annotations: Option<Marks>,
}

/// What a map of labels or annotations says to the webhook.
#[derive(Default)]
struct Marks {
    /// [`MARK`] is [`MARKED`].
    marked: bool,
    /// Each key of [`OPT_OUT`] is `disabled`.
    opted_out: [bool; OPT_OUT.len()],
}

struct MetaVisitor;

impl<'de> Visitor<'de> for MetaVisitor {
    type Value = Meta;
    expecting!("an object's metadata");

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Meta, A::Error> {
        let mut meta = Meta::default();
        each_entry(map, |key, map| {
            match key {
                "labels" => meta.labels = map.next_value_seed(Nullable(Seed(MarksVisitor)))?,
                "annotations" => {
                    meta.annotations = map.next_value_seed(Nullable(Seed(MarksVisitor)))?
                }
                _ => skip(map)?,
            }
            Ok(())
        })?;
        Ok(meta)
    }
}

struct MarksVisitor;

impl<'de> Visitor<'de> for MarksVisitor {
    type Value = Marks;
    expecting!("a map of strings");

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Marks, A::Error> {
        let mut marks = Marks::default();
        each_entry(map, |key, map| {
            // Every value must be a string, as in a pod; only the webhook's keys' are looked at.
            let value = |wanted: &'static str| Str(move |v: &str| v == wanted);
            if key == MARK {
                marks.marked = map.next_value_seed(value(MARKED))?;
            } else if let Some(i) = OPT_OUT.iter().position(|k| *k == key) {
                marks.opted_out[i] = map.next_value_seed(value("disabled"))?;
            } else {
                map.next_value_seed(Str(|_: &str| ()))?;
            }
            Ok(())
        })?;
        Ok(marks)
    }
}

/// What the webhook reads of a pod's spec.
struct Spec {
    host_network: Option<bool>,
    dns_policy: Option<String>,
    dns_config: Option<OwnDnsConfig>,
}

struct SpecVisitor;

impl<'de> Visitor<'de> for SpecVisitor {
    type Value = Spec;
    expecting!("a pod's spec");

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Spec, A::Error> {
        let mut spec = Spec { host_network: None, dns_policy: None, dns_config: None };
        each_entry(map, |key, map| {
            match key {
                "hostNetwork" => spec.host_network = map.next_value()?,
                "dnsPolicy" => spec.dns_policy = map.next_value()?,
                "dnsConfig" => {
                    spec.dns_config = map.next_value_seed(Nullable(Seed(DnsConfigVisitor)))?
                }
                _ => skip(map)?,
            }
            Ok(())
        })?;
        Ok(spec)
    }
}

struct DnsConfigVisitor;

impl<'de> Visitor<'de> for DnsConfigVisitor {
    type Value = OwnDnsConfig;
    expecting!("a pod's dnsConfig");

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<OwnDnsConfig, A::Error> {
        // Each list as its last member says: read into a config of its own, then taken.
        let mut own = OwnDnsConfig::default();
        each_entry(map, |key, map| {
            let mut list = OwnDnsConfig::default();
            match key {
                "nameservers" => {
                    map.next_value_seed(Nullable(Seed(ListVisitor(&mut list, List::Nameservers))))?;
                    own.nameservers = list.nameservers;
                }
                "searches" => {
                    map.next_value_seed(Nullable(Seed(ListVisitor(&mut list, List::Searches))))?;
                    own.searches = list.searches;
                }
                "options" => {
                    map.next_value_seed(Nullable(Seed(ListVisitor(&mut list, List::Options))))?;
                    (own.options, own.too_many_options) = (list.options, list.too_many_options);
                }
                _ => return skip(map),
            }
            own.too_long |= list.too_long;
            Ok(())
        })?;
        Ok(own)
    }
}

/// Which list of a `dnsConfig`.
#[derive(Clone, Copy)]
enum List {
    Nameservers,
    Searches,
    Options,
}

/// Reads a list of a `dnsConfig` into a config, entry by entry.
struct ListVisitor<'a>(&'a mut OwnDnsConfig, List);

impl<'de> Visitor<'de> for ListVisitor<'_> {
    type Value = ();
    expecting!("a list");

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let ListVisitor(own, list) = self;
        loop {
            let more = match list {
                List::Nameservers => {
                    seq.next_element_seed(Str(|s: &str| own.push_nameserver(s)))?
                }
                List::Searches => seq.next_element_seed(Str(|s: &str| own.push_search(s)))?,
                List::Options => seq.next_element_seed(Seed(OptionVisitor(&mut *own)))?,
            };
            if more.is_none() {
                return Ok(());
            }
        }
    }
}

/// Reads one option (`name`, `value`) into a config.
struct OptionVisitor<'a>(&'a mut OwnDnsConfig);

impl<'de> Visitor<'de> for OptionVisitor<'_> {
    type Value = ();
    expecting!("a dnsConfig option");

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<(), A::Error> {
        let (mut name, mut value) = (None, None);
        let mut too_long = false;
        each_entry(map, |key, map| {
            let field = match key {
                "name" => &mut name,
                "value" => &mut value,
                _ => return skip(map),
            };
            // Kept only if short enough: a long one is marked, not copied.
            *field = match map.next_value_seed(Nullable(Str(short)))? {
                Some(Ok(s)) => Some(s),
                Some(Err(())) => {
                    too_long = true;
                    None
                }
                None => None,
            };
            Ok(())
        })?;
        if too_long {
            self.0.too_long = true;
        } else {
            self.0.push_option(name.as_deref(), value.as_deref());
        }
        Ok(())
    }
}

/// `s`, if it is short enough to be kept.
fn short(s: &str) -> Result<String, ()> {
    (s.len() <= MAX_OWN_ENTRY).then(|| s.to_owned()).ok_or(())
}

#[cfg(test)]
mod tests;

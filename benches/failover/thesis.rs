//! The thesis's table, reproduced and extended (issue 32): a pod whose DNS the admission webhook
//! set, its resolv.conf as kubelet writes it from the webhook's mutation (the search list,
//! `options ndots:3 attempts:2 timeout:1`), resolving `who.test.` for A and AAAA (AF_UNSPEC)
//! with glibc's and musl's getaddrinfo, across a kill and a hang of the cache:
//!
//! * a. node-local-dns alone (the pod's one nameserver, the link-local IP)
//! * b. the webhook's two nameservers alone (the link-local IP, then kube-dns; no NOTRACK)
//! * c. the agent in the link-local shape, one nameserver
//! * d. both: the agent, two nameservers
//! * e. d with the agent SIGKILLed before the fault (its rules left as they were)

use std::fmt::Write as _;

use k8s_openapi::api::core::v1::{Pod, PodSpec};
use nodelocaldns_ha_webhook::mutate::{self, Settings};

use super::{ms, Arrangement, ArrangementResult, Client, Setup, Shape};

/// A pod's DNS as the webhook sets it.
pub(super) struct PodDns {
    /// Its nameservers, in order.
    nameservers: &'static [&'static str],
    /// The name its clients look up.
    pub(super) name: &'static str,
    /// Whether they ask for both families (AF_UNSPEC).
    pub(super) both_families: bool,
}

impl PodDns {
    /// The resolv.conf kubelet writes for the pod the webhook mutated (namespace `shop`).
    pub(super) fn resolv_conf(&self) -> String {
        let settings = Settings::ack(self.nameservers);
        let pod = Pod { spec: Some(PodSpec::default()), ..Pod::default() };
        let mutation = mutate::mutate(&pod, "shop", &settings).expect("the webhook mutates it");
        mutate::resolv_conf(&mutation.dns_config)
    }
}

static ONE: PodDns =
    PodDns { nameservers: &["169.254.20.10"], name: "who.test.", both_families: true };
static TWO: PodDns = PodDns {
    nameservers: &["169.254.20.10", "10.96.0.10"],
    name: "who.test.",
    both_families: true,
};

macro_rules! rows {
    ($($key:literal, $label:literal, $setup:expr, $pod:expr;)*) => {
        pub(super) const ARRANGEMENTS: &[Arrangement] = &[$(
            Arrangement {
                key: concat!("thesis-", $key, "-glibc"),
                label: concat!($label, ", glibc"),
                shape: Shape::LinkLocal,
                setup: $setup,
                client: Client::Glibc,
                pod: Some($pod),
            },
            Arrangement {
                key: concat!("thesis-", $key, "-musl"),
                label: concat!($label, ", musl"),
                shape: Shape::LinkLocal,
                setup: $setup,
                client: Client::Musl,
                pod: Some($pod),
            },
        )*];
    };
}

rows! {
    "node-cache", "a. node-local-dns alone", Setup::NodeCacheRules, &ONE;
    "two-nameservers", "b. the webhook's two nameservers alone", Setup::TwoNameservers, &TWO;
    "agent", "c. the agent (link-local shape)", Setup::Agent(&[]), &ONE;
    "both", "d. both", Setup::Agent(&[]), &TWO;
    "both-agent-gone", "e. both, the agent gone", Setup::AgentGone(&[]), &TWO;
}

/// The thesis's table, from the results of its rows (none: empty).
pub(super) fn table(results: &[ArrangementResult]) -> String {
    let rows: Vec<&ArrangementResult> =
        results.iter().filter(|r| r.arrangement.pod.is_some()).collect();
    if rows.is_empty() {
        return String::new();
    }
    let mut t = format!(
        "\nThe thesis's table: a pod the admission webhook mutated, its resolv.conf as kubelet \
         writes it (`{}`), A and AAAA (getaddrinfo AF_UNSPEC) of `who.test.`; the link-local \
         shape. Paid a timeout: lookups of the fault window that took over 1 s (the resolvers' \
         `timeout:1`).\n\n\
         | arrangement | fault | lookups failed | paid a timeout | fault-window latency p50 / p99 / max |\n\
         |---|---|---|---|---|\n",
        TWO.resolv_conf().trim_end().replace('\n', "` / `"),
    );
    for r in rows {
        if let Some(why) = &r.skipped {
            let _ = writeln!(t, "| {} | – | not measured: {why} | | |", r.arrangement.label);
        }
        for run in &r.runs {
            let f = run.figures();
            let w = &f["fault_window"];
            let _ = writeln!(
                t,
                "| {} | {} | {} of {} | {} of {} | {} / {} / {} |",
                r.arrangement.label,
                run.fault.name(),
                f["failed"],
                f["sent"],
                w["over_1s"],
                w["lookups"],
                ms(&w["latency_ms_p50"]),
                ms(&w["latency_ms_p99"]),
                ms(&w["latency_ms_max"]),
            );
        }
    }
    t
}

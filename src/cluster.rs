//! The agent seen from the cluster: its node condition and Events, through the API server, and
//! never in the way of the failover: the API server may be slow, down or hostile, and probing,
//! deciding and switching go on regardless.
//!
//! The control loop hands the reporter each state it writes ([`Reporter::submit`]: a
//! `watch` channel, so it never blocks and only the latest state waits); the reporter, a task of
//! its own, turns it into the node condition [`report::CONDITION`] (server-side apply on the
//! node's status, only when it changed, at most once a second) and one Event on the Node for the
//! route changes since its last report ([`report::event`]: aggregated, so a flapping cache makes
//! no storm). The API down, slow or refusing changes nothing but the reports: each failure is
//! logged once per outage, retried with backoff (1 s doubling to 30 s; a report the API server
//! does not answer within 5 s has failed), and the condition caught up when the API answers
//! again; memory stays bounded (one state, no queue). Events fail on their own (a policy may
//! refuse them alone): a refused Event holds back neither the condition nor the startup taint.
//!
//! The same client follows the upstream Service when no flag fixes its address ([`follow`],
//! [`crate::upstream`]), and tells at SIGTERM the agent's removal from a restart ([`removal`]).
//!
//! On with `--node-name` (the DaemonSet sets it from the downward API) and a client: the
//! kubeconfig of `--kubeconfig`, or the pod's service account. Off otherwise: the agent works
//! from its flags alone.

mod follow;
pub mod removal;
pub mod report;

pub use follow::{follow, Follower};
pub use removal::{uninstall, Removal, Uninstalled, Verdict};

use std::path::PathBuf;
use std::time::Duration;

use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::state::State;
use report::{Condition, CONDITION};

/// The field manager of the agent's patches, and the Events' source.
pub const MANAGER: &str = "nodelocaldns-ha";
/// The least time between two condition patches.
const MIN_SPACING: Duration = Duration::from_secs(1);
/// How long one report may take: an API server that hangs is a failed report, retried.
const REPORT_TIMEOUT: Duration = Duration::from_secs(5);
/// Retry backoff after a failed report: from the first, doubling, to the last.
const BACKOFF: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(30));

/// Where the reports go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// The node the agent runs on (its Node object).
    pub node_name: String,
    /// A kubeconfig; `None`: the pod's service account.
    pub kubeconfig: Option<PathBuf>,
    /// The startup taint's key, removed from the node once the state says it may go.
    pub startup_taint: Option<String>,
    /// The longest the startup taint stays, whatever DNS does (`--startup-taint-timeout`).
    pub startup_taint_bound: Duration,
    /// The upstream Service followed ([`follow`]), in the client's namespace (the pod's); `None`
    /// when `--upstream-ip` fixes the upstream.
    pub upstream_svc: Option<String>,
    /// The agent's own DaemonSet, in the client's namespace (the pod's), asked at SIGTERM
    /// ([`removal`]); `None`: every SIGTERM is a restart.
    pub daemonset: Option<String>,
}

/// Why the reports cannot start (the agent runs without them, and says so).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("reading the kubeconfig {}: {source}", .path.display())]
    Kubeconfig { path: PathBuf, source: kube::config::KubeconfigError },
    #[error("no in-cluster configuration (give --kubeconfig, or run as a pod): {0}")]
    InCluster(#[source] kube::config::InClusterError),
    #[error("configuring the API client: {0}")]
    Client(#[source] kube::Error),
}

/// The control loop's end of the reports.
#[derive(Clone)]
pub struct Reporter {
    latest: watch::Sender<Option<State>>,
}

impl Reporter {
    /// Hands the reporter `state`; never blocks, replaces any not yet reported.
    pub fn submit(&self, state: &State) {
        self.latest.send_replace(Some(state.clone()));
    }
}

/// The API client `settings` name: the kubeconfig's, or the pod's service account.
pub async fn client(settings: &Settings) -> Result<kube::Client, Error> {
    client_of(settings.kubeconfig.as_ref()).await
}

/// The API client of `kubeconfig`, or of the pod's service account.
pub async fn client_of(kubeconfig: Option<&PathBuf>) -> Result<kube::Client, Error> {
    let config = match kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .map_err(|source| Error::Kubeconfig { path: path.clone(), source })?;
            let options = kube::config::KubeConfigOptions::default();
            kube::Config::from_custom_kubeconfig(kubeconfig, &options)
                .await
                .map_err(|source| Error::Kubeconfig { path: path.clone(), source })?
        }
        None => kube::Config::incluster().map_err(Error::InCluster)?,
    };
    kube::Client::try_from(config).map_err(Error::Client)
}

/// The loop's end of the reports, and the reporting task.
pub fn reports(
    client: kube::Client,
    settings: &Settings,
) -> (Reporter, impl std::future::Future<Output = ()>) {
    let (latest, rx) = watch::channel(None);
    let task = report_forever(client, settings.node_name.clone(), rx);
    (Reporter { latest }, task)
}

/// What has been reported.
#[derive(Default)]
struct Reported {
    condition: Option<Condition>,
    /// The route changes counted by the last Event recorded (the first state's: the agent's
    /// start is no change).
    transitions: Option<u64>,
    /// Whether the startup taint is off the node.
    taint_removed: bool,
}

/// The Events' own outage: a refused Event (RBAC without `create events`, an EventRateLimit)
/// is said once and tried again with backoff, on a later state, while the condition and the
/// taint go on being reported; the route changes it would have told are counted into the next.
#[derive(Default)]
struct Events {
    outage: Outage,
    /// No Event before this, after a failed one.
    not_before: Option<tokio::time::Instant>,
}

async fn report_forever(
    client: kube::Client,
    node: String,
    mut rx: watch::Receiver<Option<State>>,
) {
    let nodes = Api::all_with(client.clone(), &core_v1("Node", "nodes"));
    // Node Events go to `default`, as kubelet's do; `kubectl describe node` finds them there.
    let events = Api::namespaced_with(client, "default", &core_v1("Event", "events"));
    let mut reported = Reported::default();
    let mut outage = Outage::default();
    let mut event_outage = Events::default();
    loop {
        if rx.changed().await.is_err() {
            return std::future::pending().await;
        }
        loop {
            let Some(state) = rx.borrow_and_update().clone() else { break };
            // Counted from the first state, whatever the API server does meanwhile.
            reported.transitions.get_or_insert(state.transitions);
            let reporting = report(&nodes, &node, &state, &mut reported);
            match within(REPORT_TIMEOUT, reporting).await {
                Ok(()) => {
                    if outage.ended() {
                        info!(node = %node, "reporting to the API server again");
                    }
                    record_event(&events, &node, &state, &mut reported, &mut event_outage).await;
                    tokio::time::sleep(MIN_SPACING).await;
                    if !rx.has_changed().unwrap_or(false) {
                        break;
                    }
                }
                Err(said) => {
                    // Said once per outage; the next state, or the retry, tries again.
                    if outage.began() {
                        warn!(node = %node, error = %said, "reporting to the API server failed; retrying with backoff (the failover does not depend on it)");
                    }
                    outage.back_off().await;
                }
            }
        }
    }
}

/// The API server's outage as one task meets it: said when it begins and when it ends, each
/// request retried meanwhile with backoff ([`BACKOFF`]).
struct Outage {
    failing: bool,
    backoff: Duration,
}

impl Default for Outage {
    fn default() -> Outage {
        Outage { failing: false, backoff: BACKOFF.0 }
    }
}

impl Outage {
    /// How long to wait before the next retry: each time twice as long, up to the longest.
    fn next_delay(&mut self) -> Duration {
        let delay = self.backoff;
        self.backoff = (self.backoff * 2).min(BACKOFF.1);
        delay
    }

    /// A request failed: whether that begins an outage (to be said).
    fn began(&mut self) -> bool {
        !std::mem::replace(&mut self.failing, true)
    }

    /// A request succeeded: whether that ends an outage (to be said); the backoff starts over.
    fn ended(&mut self) -> bool {
        self.backoff = BACKOFF.0;
        std::mem::take(&mut self.failing)
    }

    /// Waits before the retry, each time twice as long, up to the longest.
    async fn back_off(&mut self) {
        tokio::time::sleep(self.next_delay()).await;
    }
}

/// `request`, failed when the API server has not answered within `limit`.
async fn within<T>(
    limit: Duration,
    request: impl std::future::Future<Output = Result<T, kube::Error>>,
) -> Result<T, String> {
    match tokio::time::timeout(limit, request).await {
        Ok(result) => result.map_err(|e| e.to_string()),
        Err(_) => Err(format!("no answer within {limit:?}")),
    }
}

/// Records the Event for the route changes since the last one, if there were any and no
/// earlier failure holds it off. Its failure is its own: said once per outage, retried with
/// backoff on a later state, never in the way of the condition and the taint.
async fn record_event(
    events: &Api<DynamicObject>,
    node: &str,
    state: &State,
    reported: &mut Reported,
    outage: &mut Events,
) {
    let since = reported.transitions.unwrap_or(state.transitions);
    let Some(event) = report::event(since, state) else { return };
    if outage.not_before.is_some_and(|at| tokio::time::Instant::now() < at) {
        return;
    }
    match within(REPORT_TIMEOUT, create_event(events, node, &event)).await {
        Ok(()) => {
            reported.transitions = Some(state.transitions);
            outage.not_before = None;
            if outage.outage.ended() {
                info!(node = %node, "recording Events on the node again");
            }
        }
        Err(said) => {
            outage.not_before = Some(tokio::time::Instant::now() + outage.outage.next_delay());
            if outage.outage.began() {
                warn!(node = %node, error = %said, "recording an Event on the node failed; retrying with backoff, the route changes counted into the next one (the condition and the startup taint do not wait for it)");
            }
        }
    }
}

/// Creates `event` on the Node, in `default`.
async fn create_event(
    events: &Api<DynamicObject>,
    node: &str,
    event: &report::Event,
) -> Result<(), kube::Error> {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let body = json!({
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": format!("{node}.nodelocaldns-ha."), "namespace": "default"},
        // kubelet's own reference to the node: its name as the uid.
        "involvedObject": {"kind": "Node", "name": node, "uid": node, "apiVersion": "v1"},
        "reason": event.reason,
        "message": event.message,
        "type": event.kind,
        "count": event.count,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "source": {"component": MANAGER, "host": node},
        "reportingComponent": MANAGER,
        "reportingInstance": node,
    });
    let event: DynamicObject = serde_json::from_value(body).map_err(kube::Error::SerdeError)?;
    events.create(&PostParams::default(), &event).await?;
    Ok(())
}

/// Reports `state`: the condition if it changed, then the startup taint's removal once it may
/// go. The Event is [`record_event`]'s: a refused one holds back neither.
async fn report(
    nodes: &Api<DynamicObject>,
    node: &str,
    state: &State,
    reported: &mut Reported,
) -> Result<(), kube::Error> {
    let condition = report::condition(state);
    if reported.condition.as_ref() != Some(&condition) {
        let since = k8s_openapi::jiff::Timestamp::from_millisecond(condition.since_unix_ms as i64)
            .map(|t| t.to_string())
            .unwrap_or_default();
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let status = json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": node},
            "status": {"conditions": [{
                "type": CONDITION,
                "status": condition.status,
                "reason": condition.reason,
                "message": condition.message,
                "lastTransitionTime": since,
                "lastHeartbeatTime": now,
            }]},
        });
        let params = PatchParams::apply(MANAGER).force();
        nodes.patch_status(node, &params, &Patch::Apply(&status)).await?;
        reported.condition = Some(condition);
    }
    if let Some(taint) = state.startup_taint.as_ref().filter(|t| t.kept.is_none()) {
        if !reported.taint_removed {
            remove_taint(nodes, node, &taint.key).await?;
            reported.taint_removed = true;
            let why = taint.goes.as_deref().unwrap_or("it may go");
            if taint.overdue {
                let now = report::condition(state).message;
                warn!(node, key = %taint.key, "removed the startup taint: {why} (the node's condition: {now})");
            } else {
                info!(node, key = %taint.key, "removed the startup taint: {why}");
            }
        }
    }
    Ok(())
}

/// Removes the taints with `key` from `node`: the node's taints read, then written back without
/// them, on the condition that nobody changed the node in between (its resourceVersion; a
/// conflict fails the report, which is retried). Whether there was one to remove.
async fn remove_taint(
    nodes: &Api<DynamicObject>,
    node: &str,
    key: &str,
) -> Result<bool, kube::Error> {
    let current = nodes.get(node).await?;
    let taints = current.data["spec"]["taints"].as_array().cloned().unwrap_or_default();
    let kept: Vec<_> = taints.iter().filter(|t| t["key"] != key).collect();
    if kept.len() == taints.len() {
        return Ok(false);
    }
    let patch = json!({
        "metadata": {"resourceVersion": current.metadata.resource_version},
        "spec": {"taints": kept},
    });
    nodes.patch(node, &PatchParams::default(), &Patch::Merge(&patch)).await?;
    Ok(true)
}

/// A core (`v1`) resource, read and written as JSON: the agent reads a few fields of Nodes and
/// Services, and decoding them whole into their types would keep a megabyte more of code
/// resident in every node's agent.
fn core_v1(kind: &str, plural: &str) -> ApiResource {
    ApiResource {
        group: String::new(),
        version: "v1".into(),
        api_version: "v1".into(),
        kind: kind.into(),
        plural: plural.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn an_outage_is_said_once_each_way_and_backs_off_to_the_longest() {
        let mut outage = Outage::default();
        assert!(!outage.ended(), "no outage to end");
        assert!(outage.began());
        assert!(!outage.began(), "said once");
        let mut waits = Vec::new();
        for _ in 0..7 {
            let start = tokio::time::Instant::now();
            outage.back_off().await;
            waits.push(start.elapsed().as_secs());
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30]);
        assert!(outage.ended());
        assert!(!outage.ended());
        assert_eq!(outage.backoff, BACKOFF.0, "starts over");
    }
}

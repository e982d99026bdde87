//! A SIGTERM told apart: the agent's removal from the node, or a restart.
//!
//! A restart (a rolling update, the pod deleted, the node drained) must leave the rules in, so
//! the next agent adopts them with no flip; a removal (the DaemonSet deleted: `helm uninstall`,
//! `kubectl delete`) must put the node back as it was before the install. The agent's own
//! DaemonSet says which: gone, or being deleted (a `deletionTimestamp`: foreground deletion,
//! which waits for its pods), is a removal; there, it is a restart. The API server that cannot
//! be asked within [`ASK_TIMEOUT`] (down, slow, refusing) is a restart too: the rules left in
//! are the state that needs nothing of the agent (the kernel's fast path falls through to
//! kube-proxy while the cache is dead), where a wrong teardown would flip every node of a
//! rolling update.
//!
//! On a removal, once the agent's rules are gone, [`Removal::clean_node`] takes off what the
//! agent put on its Node: the condition [`super::report::CONDITION`] and the startup taint.
//!
//! An uninstall deletes the agent's RBAC and ServiceAccount with its DaemonSet, at once: by the
//! time a pod gets its SIGTERM, its token may no longer be taken, and the agent could not tell
//! (a restart, then) nor clean its Node. So the chart's pre-delete hook runs [`uninstall`]
//! first: the DaemonSet deleted with foreground propagation (it stays, being deleted, until its
//! pods are gone) and waited for, before anything else of the release is deleted.

use std::time::Duration;

use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use serde_json::json;

use super::report::CONDITION;
use super::within;

/// How long the agent asks its DaemonSet at SIGTERM: well inside the pod's
/// `terminationGracePeriodSeconds`, which must leave time for the teardown after it.
pub const ASK_TIMEOUT: Duration = Duration::from_secs(3);
/// How long the Node's clean-up may take, after the teardown.
pub const CLEAN_TIMEOUT: Duration = Duration::from_secs(5);

/// Who asks: the agent's client, its DaemonSet (in the client's namespace, the pod's) and its
/// node.
#[derive(Clone)]
pub struct Removal {
    client: kube::Client,
    daemonset: String,
    node: String,
    startup_taint: Option<String>,
}

/// What the SIGTERM is, and why (said in the agent's last lines).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The DaemonSet is gone or being deleted: tear down.
    Removal(String),
    /// The DaemonSet is there, or it cannot be told: leave the rules in.
    Restart(String),
}

impl std::fmt::Debug for Removal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Removal")
            .field("daemonset", &self.daemonset_ref())
            .field("node", &self.node)
            .field("startup_taint", &self.startup_taint)
            .finish()
    }
}

impl Removal {
    pub fn new(
        client: kube::Client,
        daemonset: String,
        node: String,
        startup_taint: Option<String>,
    ) -> Removal {
        Removal { client, daemonset, node, startup_taint }
    }

    /// `namespace/name` of the agent's DaemonSet.
    fn daemonset_ref(&self) -> String {
        format!("{}/{}", self.client.default_namespace(), self.daemonset)
    }

    /// Asks the API server whether the agent's DaemonSet is still there, within
    /// [`ASK_TIMEOUT`].
    pub async fn ask(&self) -> Verdict {
        let daemonsets: Api<DynamicObject> =
            Api::default_namespaced_with(self.client.clone(), &daemonset_resource());
        let ds = self.daemonset_ref();
        match tokio::time::timeout(ASK_TIMEOUT, daemonsets.get(&self.daemonset)).await {
            Ok(Ok(found)) => match found.metadata.deletion_timestamp {
                Some(since) => {
                    Verdict::Removal(format!("DaemonSet {ds} is being deleted (since {})", since.0))
                }
                None => Verdict::Restart(format!(
                    "DaemonSet {ds} is still there: a restart (a rolling update, the pod deleted \
                     or evicted); the next agent adopts the rules"
                )),
            },
            Ok(Err(kube::Error::Api(status))) if status.is_not_found() => {
                Verdict::Removal(format!("DaemonSet {ds} is gone"))
            }
            Ok(Err(e)) => Verdict::Restart(format!(
                "cannot tell whether DaemonSet {ds} is being removed ({e}); the rules stay \
                 (`nodelocaldns-ha teardown` on the node removes them)"
            )),
            Err(_) => Verdict::Restart(format!(
                "the API server did not say within {ASK_TIMEOUT:?} whether DaemonSet {ds} is \
                 being removed; the rules stay (`nodelocaldns-ha teardown` on the node removes \
                 them)"
            )),
        }
    }

    /// Takes the agent's condition off its Node's status, and its startup taint off the Node
    /// (if it has one), within [`CLEAN_TIMEOUT`]; what it did, or what failed.
    pub async fn clean_node(&self) -> Result<Vec<String>, String> {
        let nodes: Api<DynamicObject> =
            Api::all_with(self.client.clone(), &super::core_v1("Node", "nodes"));
        let node = &self.node;
        let clean = async {
            let mut done = Vec::new();
            // A strategic merge patch deletes the condition by its key, whoever last wrote it.
            let gone = json!({"status": {"conditions": [{"type": CONDITION, "$patch": "delete"}]}});
            nodes.patch_status(node, &PatchParams::default(), &Patch::Strategic(&gone)).await?;
            done.push(format!("removed the condition {CONDITION} from Node {node}"));
            if let Some(key) = &self.startup_taint {
                if super::remove_taint(&nodes, node, key).await? {
                    done.push(format!("removed the startup taint {key} from Node {node}"));
                }
            }
            Ok::<_, kube::Error>(done)
        };
        within(CLEAN_TIMEOUT, clean).await
    }
}

/// `apps/v1` DaemonSets, read as JSON (only the metadata is looked at).
fn daemonset_resource() -> ApiResource {
    ApiResource {
        group: "apps".into(),
        version: "v1".into(),
        api_version: "apps/v1".into(),
        kind: "DaemonSet".into(),
        plural: "daemonsets".into(),
    }
}

/// How [`uninstall`] ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Uninstalled {
    /// The DaemonSet was not there.
    NotThere,
    /// It is gone, its pods with it.
    Gone,
    /// It is still there (being deleted) after the timeout: pods on nodes that are down, or
    /// agents that did not stop.
    StillThere,
}

/// Deletes the agents' DaemonSet `name` (in the client's namespace) with foreground
/// propagation, and waits up to `timeout` until it is gone, which is when its pods are.
pub async fn uninstall(
    client: kube::Client,
    name: &str,
    timeout: Duration,
) -> Result<Uninstalled, kube::Error> {
    let daemonsets: Api<DynamicObject> =
        Api::default_namespaced_with(client, &daemonset_resource());
    match daemonsets.delete(name, &kube::api::DeleteParams::foreground()).await {
        Err(kube::Error::Api(status)) if status.is_not_found() => return Ok(Uninstalled::NotThere),
        Err(e) => return Err(e),
        Ok(_) => {}
    }
    let deadline = tokio::time::Instant::now() + timeout;
    let mut every = tokio::time::interval(Duration::from_secs(1));
    loop {
        every.tick().await;
        match daemonsets.get_opt(name).await? {
            None => return Ok(Uninstalled::Gone),
            Some(_) if tokio::time::Instant::now() >= deadline => {
                return Ok(Uninstalled::StillThere)
            }
            Some(_) => {}
        }
    }
}

//! The agent from its image: the image `ci/image/build.sh` built from the Dockerfile,
//! run by podman as the DaemonSet's pod runs it, in the node's network namespace.

use std::ops::Deref;
use std::path::Path;
use std::process::Command;

use crate::agent::Agent;
use crate::simnode::{repo, SimNode};

/// The agent in a container; the container is removed when this is dropped.
pub struct ContainerAgent {
    agent: Option<Agent>,
    name: String,
}

impl Deref for ContainerAgent {
    type Target = Agent;
    fn deref(&self) -> &Agent {
        self.agent.as_ref().expect("the agent")
    }
}

impl Drop for ContainerAgent {
    fn drop(&mut self) {
        // The podman client first (the Agent's handle), then the container it ran, by name.
        drop(self.agent.take());
        let _ = podman().args(["rm", "--force", "--time", "0", &self.name]).output();
    }
}

/// podman with ci/image/'s configuration (the storage the image was built into).
pub fn podman() -> Command {
    Command::new(repo().join("ci/image/podman"))
}

impl SimNode {
    /// Starts the agent from `image` (v4, the ClusterIP shape when `cluster_dns` is not empty,
    /// nftables unless `extra` names a backend) with what the DaemonSet gives its container:
    /// the node's network namespace, capabilities NET_ADMIN, NET_RAW and NET_BIND_SERVICE and no
    /// other, a read-only root file system with nothing written over it, no privilege
    /// escalation, the runtime's default seccomp profile, and the mounts of
    /// manifests/base/daemonset.yaml: the state directory and the host's xtables lock.
    pub fn agent_from_image(
        &self,
        image: &str,
        cluster_dns: &str,
        upstream: &str,
        extra: &[&str],
    ) -> ContainerAgent {
        let name = format!("{}-agent", self.prefix);
        let state_dir = self.dir.join("agent-state");
        std::fs::create_dir_all(&state_dir).expect("the agent's state directory");
        // The host's lock where it exists (the node's iptables-legacy users take it); where it
        // does not, one of the node's own, as the DaemonSet's FileOrCreate would make it.
        let host_lock = Path::new("/run/xtables.lock");
        let lock = if host_lock.exists() {
            host_lock.to_path_buf()
        } else {
            let own = self.dir.join("xtables.lock");
            std::fs::write(&own, "").expect("the node's xtables lock");
            own
        };
        let mut launch = podman();
        launch
            .args(["run", "--rm", "--pull=never", "--name", &name])
            .arg(format!("--network=ns:/run/netns/{}", self.ns("node")))
            .args(["--cap-drop=all", "--cap-add=NET_ADMIN,NET_RAW,NET_BIND_SERVICE"])
            .args(["--read-only", "--read-only-tmpfs=false"])
            .args(["--security-opt=no-new-privileges"])
            .arg(format!("--volume={0}:{0}", state_dir.display()))
            .arg(format!("--volume={}:/run/xtables.lock", lock.display()))
            .args(["--env=NODELOCALDNS_HA_LOG", image]);
        let local = crate::simnode::LOCAL_IP;
        let agent = self.spawn_agent(launch, local, cluster_dns, upstream, extra, &[], true);
        ContainerAgent { agent: Some(agent), name }
    }
}

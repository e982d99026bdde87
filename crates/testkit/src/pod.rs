//! The agent as its pod runs it on the real parts' node: in-cluster configuration, with a
//! service-account token the real API server issued.

use std::path::PathBuf;

use crate::agent::Agent;
use crate::binaries::agent_exe;
use crate::simnode::{describe, SimNode, CLUSTER_DNS_IP, LOCAL_IP, UPSTREAM_IP};

/// Runs `"$@"` in a mount namespace of its own, where `/run` is a fresh tmpfs holding the
/// service account's files (`$1`) and the host's xtables lock (from the host's `/run`, bound at
/// `$2` first), as a container's `/run` would: nothing is created on the host.
const POD_MOUNTS: &str = r#"set -e
sa=$1 host=$2
shift 2
mount --bind /run "$host"
mount -t tmpfs -o mode=755 pod-run /run
if [ -e "$host/xtables.lock" ]; then
    touch /run/xtables.lock
    mount --bind "$host/xtables.lock" /run/xtables.lock
fi
mkdir -p /run/secrets/kubernetes.io/serviceaccount
mount --bind -o ro "$sa" /run/secrets/kubernetes.io/serviceaccount
exec "$@""#;

impl SimNode {
    /// Starts the agent (v4, nftables unless `extra` says otherwise) as the DaemonSet's pod on
    /// the real parts' node (`--kube-proxy real-*`): the service account kube-system/
    /// nodelocaldns-ha and a token the API server issued for it where a pod has them, the API
    /// server at `KUBERNETES_SERVICE_HOST:PORT` (the `kubernetes` Service, through kube-proxy),
    /// the upstream from `KUBE_DNS_UPSTREAM_SERVICE_HOST`; no `--kubeconfig`, no
    /// `--upstream-ip`. The account gets no rights here: the test grants them.
    pub fn agent_in_pod(&self, extra: &[&str]) -> Agent {
        self.agent_in_pod_env(extra, &[])
    }

    /// [`SimNode::agent_in_pod`] with extra environment variables.
    pub fn agent_in_pod_env(&self, extra: &[&str], env: &[(&str, &str)]) -> Agent {
        let sa = self.service_account();
        let host = self.dir.join("pod-host-run");
        std::fs::create_dir_all(&host).expect("the host /run's mount point");
        let mut launch = self.cmd("node", "unshare");
        launch.args(["--mount", "--propagation", "private", "sh", "-c", POD_MOUNTS, "pod"]);
        launch.arg(&sa).arg(&host).arg(agent_exe());
        let mut env = env.to_vec();
        env.extend([
            ("KUBERNETES_SERVICE_HOST", "10.96.0.1"),
            ("KUBERNETES_SERVICE_PORT", "443"),
            ("KUBE_DNS_UPSTREAM_SERVICE_HOST", UPSTREAM_IP),
        ]);
        self.spawn_agent(launch, LOCAL_IP, CLUSTER_DNS_IP, "", extra, &env, true)
    }

    /// The service account kube-system/nodelocaldns-ha (created if need be) and its files: a
    /// token the API server issued, its CA, its namespace.
    fn service_account(&self) -> PathBuf {
        let run = |args: &[&str]| {
            let out = self.kubectl().args(args).output().expect("kubectl");
            let text = describe(&out);
            assert!(
                out.status.success() || text.contains("already exists"),
                "kubectl {args:?}: {text}"
            );
            out.stdout
        };
        run(&["-n", "kube-system", "create", "serviceaccount", "nodelocaldns-ha"]);
        let token =
            run(&["-n", "kube-system", "create", "token", "nodelocaldns-ha", "--duration=1h"]);
        let dir = self.dir.join("serviceaccount");
        std::fs::create_dir_all(&dir).expect("the service account's directory");
        std::fs::write(dir.join("token"), token).expect("the token");
        std::fs::copy(self.dir.join("pki/ca.crt"), dir.join("ca.crt")).expect("the CA");
        std::fs::write(dir.join("namespace"), "kube-system").expect("the namespace");
        dir
    }
}

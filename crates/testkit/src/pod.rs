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

/// The agent's pod in kube-system, as the API server knows it (nothing runs it): its token is
/// bound to it, as the kubelet's tokens are to their pods.
pub const POD: &str = "nodelocaldns-ha-agent";

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

    /// [`SimNode::agent_in_pod`] with extra environment variables; they replace the pod's own,
    /// and an empty value takes the variable away (`("KUBE_DNS_UPSTREAM_SERVICE_HOST", "")`: a
    /// pod started before that Service existed).
    pub fn agent_in_pod_env(&self, extra: &[&str], env: &[(&str, &str)]) -> Agent {
        let sa = self.service_account();
        let host = self.dir.join("pod-host-run");
        std::fs::create_dir_all(&host).expect("the host /run's mount point");
        let mut launch = self.cmd("node", "unshare");
        launch.args(["--mount", "--propagation", "private", "sh", "-c", POD_MOUNTS, "pod"]);
        launch.arg(&sa).arg(&host).arg(agent_exe());
        let pods = [
            ("KUBERNETES_SERVICE_HOST", "10.96.0.1"),
            ("KUBERNETES_SERVICE_PORT", "443"),
            ("KUBE_DNS_UPSTREAM_SERVICE_HOST", UPSTREAM_IP),
        ];
        let given = |name: &str| env.iter().any(|(n, _)| *n == name);
        let mut all: Vec<(&str, &str)> = pods.into_iter().filter(|(n, _)| !given(n)).collect();
        all.extend(env.iter().copied().filter(|(_, value)| !value.is_empty()));
        self.spawn_agent(launch, LOCAL_IP, CLUSTER_DNS_IP, "", extra, &all, true)
    }

    /// The agent's pod as the API server knows it ([`POD`], on this node; nothing runs it):
    /// what its token is bound to.
    fn agent_pod(&self) -> String {
        let pod = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": POD, "namespace": "kube-system"},
            "spec": {
                "nodeName": self.ns("node"),
                "serviceAccountName": "nodelocaldns-ha",
                "containers": [{"name": "agent", "image": "nodelocaldns-ha"}],
            },
        });
        pod.to_string()
    }

    /// A token of the agent's service account as the kubelet gets one for its pod: bound to
    /// the pod ([`POD`], on this node), so that it names the node
    /// (`authentication.kubernetes.io/node-name`), as the admission policy of
    /// manifests/cluster-reports requires.
    pub fn agent_pod_token(&self) -> String {
        self.service_account();
        self.agent_token(&["--bound-object-kind", "Pod", "--bound-object-name", POD])
    }

    /// A token of the agent's service account, issued with `args` (e.g. bound to an object).
    pub fn agent_token(&self, args: &[&str]) -> String {
        let mut cmd = self.kubectl();
        cmd.args(["-n", "kube-system", "create", "token", "nodelocaldns-ha", "--duration=1h"]);
        let out = cmd.args(args).output().expect("kubectl");
        assert!(out.status.success(), "kubectl create token {args:?}: {}", describe(&out));
        String::from_utf8(out.stdout).expect("a token").trim().to_owned()
    }

    /// The service account kube-system/nodelocaldns-ha and the agent's pod (created if need
    /// be) and its files: a token the API server issued for the pod, its CA, its namespace.
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
        let out = self.kubectl_input(&["apply", "-f", "-"], self.agent_pod().as_bytes());
        assert!(out.status.success(), "the agent's pod: {}", describe(&out));
        let token = run(&[
            "-n",
            "kube-system",
            "create",
            "token",
            "nodelocaldns-ha",
            "--duration=1h",
            "--bound-object-kind",
            "Pod",
            "--bound-object-name",
            POD,
        ]);
        let dir = self.dir.join("serviceaccount");
        std::fs::create_dir_all(&dir).expect("the service account's directory");
        std::fs::write(dir.join("token"), token).expect("the token");
        std::fs::copy(self.dir.join("pki/ca.crt"), dir.join("ca.crt")).expect("the CA");
        std::fs::write(dir.join("namespace"), "kube-system").expect("the namespace");
        dir
    }
}

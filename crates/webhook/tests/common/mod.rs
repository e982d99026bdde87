//! What the webhook's tests and benchmark share: a CA and the serving certificates it signs,
//! written as a Secret volume holds them; on the simulated node with the real control plane,
//! the webhook binary, kubectl, and the project's MutatingWebhookConfiguration.

#![allow(dead_code)] // Each test uses its part.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair, SanType};
use rustls::pki_types::CertificateDer;
use serde_json::{json, Value};
use testkit::{describe, wait_for, SimNode};

/// A CA, and the serving certificates it signs.
pub struct Ca(CertifiedIssuer<'static, KeyPair>);

impl Ca {
    pub fn new() -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        Ca(CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap())
    }

    /// The CA's certificate, PEM.
    pub fn pem(&self) -> String {
        self.0.pem()
    }

    /// A new serving certificate for `san`: (certificate PEM, its DER, key PEM).
    pub fn leaf(&self, san: SanType) -> (String, CertificateDer<'static>, String) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.subject_alt_names = vec![san];
        let cert = params.signed_by(&key, &self.0).unwrap();
        (cert.pem(), cert.der().clone(), key.serialize_pem())
    }

    /// A TLS client trusting this CA alone, resuming no session (every handshake shows the
    /// server's current certificate).
    pub fn client(&self) -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.0.der().clone()).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.resumption = rustls::client::Resumption::disabled();
        Arc::new(config)
    }
}

/// Writes a certificate and key into `dir` as kubelet updates a Secret volume: into a new
/// directory, then `..data` flipped to it by a rename, `tls.crt` and `tls.key` being links
/// through it.
pub fn publish(dir: &Path, generation: u32, cert: &str, key: &str) {
    let data = dir.join(format!("..gen{generation}"));
    fs::create_dir_all(&data).unwrap();
    fs::write(data.join("tls.crt"), cert).unwrap();
    fs::write(data.join("tls.key"), key).unwrap();
    let tmp = dir.join("..data_tmp");
    let _ = fs::remove_file(&tmp);
    std::os::unix::fs::symlink(data.file_name().unwrap(), &tmp).unwrap();
    fs::rename(&tmp, dir.join("..data")).unwrap();
    for file in ["tls.crt", "tls.key"] {
        if !dir.join(file).exists() {
            std::os::unix::fs::symlink(format!("..data/{file}"), dir.join(file)).unwrap();
        }
    }
}

/// The node's address on its link to the control plane: where the API server reaches the
/// webhook.
pub const WEBHOOK_IP: &str = "10.240.0.1";
pub const WEBHOOK_ADDR: &str = "10.240.0.1:18443";
const MANIFEST: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../manifests/webhook/mutatingwebhookconfiguration.yaml"
);

/// The webhook binary in the node's namespace, its log in a file.
pub struct Webhook {
    child: Child,
    pub log: PathBuf,
}

impl Webhook {
    pub fn start(node: &SimNode, tls: &Path, nameservers: &str) -> Self {
        Webhook::start_with(node, tls, nameservers, "127.0.0.1:19254", None)
    }

    /// Like [`Webhook::start`], its metrics port on `metrics`, and with `address_space` bytes
    /// of address space at most (`prlimit --as`), if given: a webhook whose memory runs away
    /// then fails its allocations and aborts, instead of taking the machine's memory.
    pub fn start_with(
        node: &SimNode,
        tls: &Path,
        nameservers: &str,
        metrics: &str,
        address_space: Option<u64>,
    ) -> Self {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log = node.dir.join(format!("webhook.{n}.log"));
        let mut cmd = match address_space {
            Some(bytes) => {
                let mut cmd = node.cmd("node", "prlimit");
                cmd.arg(format!("--as={bytes}")).arg("--").arg(webhook_exe());
                cmd
            }
            None => node.cmd("node", webhook_exe()),
        };
        let child = cmd
            .args(["--listen", WEBHOOK_ADDR, "--metrics-listen", metrics])
            .args(["--nameserver", nameservers])
            .arg("--tls-cert-file")
            .arg(tls.join("tls.crt"))
            .arg("--tls-key-file")
            .arg(tls.join("tls.key"))
            .stderr(Stdio::from(fs::File::create(&log).unwrap()))
            .spawn()
            .unwrap();
        let hook = Webhook { child, log };
        hook.wait_log("serving", 1);
        hook
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits until the log has `n` lines containing `text`.
    pub fn wait_log(&self, text: &str, n: usize) {
        wait_for(&format!("{n} × {text:?} in the webhook's log"), Duration::from_secs(10), || {
            let log = fs::read_to_string(&self.log).unwrap_or_default();
            (log.lines().filter(|l| l.contains(text)).count() >= n).then_some(())
        });
    }

    pub fn stop(mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        assert!(self.child.wait().unwrap().success());
    }
}

impl Drop for Webhook {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The webhook binary, as cargo built it for the test or benchmark.
fn webhook_exe() -> &'static str {
    env!("CARGO_BIN_EXE_nodelocaldns-ha-webhook")
}

/// kubectl with `input` on its standard input: its output, or a panic saying why not.
pub fn kubectl(node: &SimNode, args: &[&str], input: &str) -> std::process::Output {
    let out = node.kubectl_input(args, input.as_bytes());
    assert!(out.status.success(), "kubectl {args:?}: {}", describe(&out));
    out
}

/// The project's MutatingWebhookConfiguration, calling `url` and trusting `ca` (PEM).
pub fn configuration(url: &str, ca: &str) -> Value {
    let text = fs::read_to_string(MANIFEST).unwrap();
    let mut doc: Value = serde_norway::from_str(&text).unwrap();
    let bundle = base64(ca.as_bytes());
    for hook in doc["webhooks"].as_array_mut().unwrap() {
        hook["clientConfig"] = json!({"url": url, "caBundle": bundle});
    }
    doc
}

/// Creates namespace `name` with `labels`, and its `default` service account (no
/// controller-manager runs to make it).
pub fn namespace(node: &SimNode, name: &str, labels: Value) {
    let ns = json!({"apiVersion": "v1", "kind": "Namespace",
                    "metadata": {"name": name, "labels": labels}});
    kubectl(node, &["create", "-f", "-"], &ns.to_string());
    kubectl(node, &["create", "serviceaccount", "default", "-n", name], "");
}

/// A pod as a ReplicaSet creates it, `spec` merged into a minimal spec.
pub fn pod(namespace: &str, labels: Value, spec: Value) -> Value {
    let mut pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "web-", "namespace": namespace, "labels": labels},
        "spec": {"containers": [{"name": "web", "image": "registry.k8s.io/pause:3.10"}]},
    });
    for (k, v) in spec.as_object().unwrap() {
        pod["spec"][k] = v.clone();
    }
    pod
}

/// Standard base64 (RFC 4648), as a caBundle is written.
pub fn base64(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, &b)| n | u32::from(b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(DIGITS[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

//! `nodelocaldns-ha-webhook`: the mutating admission webhook that gives pods of opted-in
//! namespaces the node-local IP and the kube-dns IP as nameservers. Which namespaces
//! is the MutatingWebhookConfiguration's `namespaceSelector`; what a pod gets is here.

#![forbid(unsafe_code)]

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use nodelocaldns_ha_webhook::metrics::Metrics;
use nodelocaldns_ha_webhook::mutate::{Settings, ACK_OPTIONS, MAX_NAMESERVERS};
use nodelocaldns_ha_webhook::server::{self, Webhook};
use nodelocaldns_ha_webhook::tls::{Certificates, Reload};
use tokio::net::TcpListener;
use tracing_subscriber::EnvFilter;

/// How often the certificate's files are looked at.
const RELOAD_EVERY: Duration = Duration::from_secs(1);

/// The admission webhook of nodelocaldns-ha: pods get the node-local DNS IP and the kube-dns IP
/// as their nameservers.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The serving certificate (PEM, the chain), reloaded when the file changes.
    #[arg(long, env = "WEBHOOK_TLS_CERT_FILE", default_value = "/tls/tls.crt")]
    tls_cert_file: PathBuf,
    /// The serving certificate's private key (PEM).
    #[arg(long, env = "WEBHOOK_TLS_KEY_FILE", default_value = "/tls/tls.key")]
    tls_key_file: PathBuf,
    /// Where the API server's reviews come (HTTPS: `/mutate`).
    #[arg(long, env = "WEBHOOK_LISTEN", default_value = "0.0.0.0:8443")]
    listen: SocketAddr,
    /// Where the kubelet's probes and Prometheus come (plain HTTP: `/metrics`, `/healthz`,
    /// `/readyz`).
    #[arg(long, env = "WEBHOOK_METRICS_LISTEN", default_value = "0.0.0.0:9254")]
    metrics_listen: SocketAddr,
    /// The pods' nameservers, in order: the node-local IP, then the kube-dns ClusterIP (both
    /// of a dual-stack kube-dns, if wanted). At most 3.
    #[arg(
        long = "nameserver",
        env = "WEBHOOK_NAMESERVERS",
        value_delimiter = ',',
        default_value = "169.254.20.10,10.96.0.10"
    )]
    nameservers: Vec<IpAddr>,
    /// kubelet's `--cluster-domain`.
    #[arg(long, env = "WEBHOOK_CLUSTER_DOMAIN", default_value = "cluster.local")]
    cluster_domain: String,
    /// The resolver options pods get: ACK's (`ndots:3`, `attempts:2`, `timeout:1`), kubelet's
    /// (`ndots:5`), or none beyond the pod's own.
    #[arg(long, env = "WEBHOOK_OPTIONS", value_enum, default_value = "ack")]
    options: Options,
    /// Mutate host-network pods with `dnsPolicy: ClusterFirstWithHostNet` too.
    #[arg(long, env = "WEBHOOK_HOST_NETWORK_PODS")]
    host_network_pods: bool,
    /// Log filter (`info`, `debug`, or a tracing directive).
    #[arg(long, env = "WEBHOOK_LOG", default_value = "info")]
    log: String,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Options {
    Ack,
    Kubelet,
    None,
}

impl Options {
    fn list(self) -> Vec<(String, Option<String>)> {
        let pairs: &[(&str, &str)] = match self {
            Options::Ack => &ACK_OPTIONS,
            Options::Kubelet => &[("ndots", "5")],
            Options::None => &[],
        };
        pairs.iter().map(|(n, v)| (n.to_string(), Some(v.to_string()))).collect()
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let filter = EnvFilter::try_new(&args.log).unwrap_or_else(|e| {
        eprintln!("nodelocaldns-ha-webhook: --log {:?}: {e}", args.log);
        std::process::exit(2)
    });
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .init();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("nodelocaldns-ha-webhook: {message}");
            ExitCode::from(2)
        }
    }
}

fn run(args: Args) -> Result<(), String> {
    let settings = settings(&args)?;
    let certs = Certificates::load(&args.tls_cert_file, &args.tls_key_file)
        .map_err(|e| format!("the serving certificate: {e}"))?;
    let certs = Arc::new(certs);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("the runtime: {e}"))?;
    runtime.block_on(async move {
        let bind = |addr: SocketAddr, what: &'static str| async move {
            TcpListener::bind(addr).await.map_err(|e| format!("{what} {addr}: {e}"))
        };
        let https = bind(args.listen, "--listen").await?;
        let http = bind(args.metrics_listen, "--metrics-listen").await?;
        let hook = Arc::new(Webhook::new(settings, Metrics::default()));
        let tls = tokio_rustls::TlsAcceptor::from(Arc::new(certs.server_config()));
        tracing::info!(
            listen = %https.local_addr().map_err(|e| e.to_string())?,
            metrics = %http.local_addr().map_err(|e| e.to_string())?,
            nameservers = ?hook.settings.nameservers,
            "serving"
        );
        let reloads = reload_forever(certs, hook.clone());
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .map_err(|e| format!("SIGTERM: {e}"))?;
        tokio::select! {
            e = server::serve_https(https, tls, hook.clone()) => Err(format!("--listen: {e}")),
            e = server::serve_http(http, hook) => Err(format!("--metrics-listen: {e}")),
            () = reloads => unreachable!("reloads forever"),
            _ = terminate.recv() => { tracing::info!("SIGTERM: stopping"); Ok(()) }
            _ = tokio::signal::ctrl_c() => { tracing::info!("SIGINT: stopping"); Ok(()) }
        }
    })
}

/// The settings `args` give, or what is wrong with them.
fn settings(args: &Args) -> Result<Settings, String> {
    let n = args.nameservers.len();
    if n == 0 || n > MAX_NAMESERVERS {
        return Err(format!(
            "--nameserver: {n} given, 1 to {MAX_NAMESERVERS} allowed (the node-local IP, then kube-dns)"
        ));
    }
    let domain = args.cluster_domain.trim_matches('.');
    if domain.is_empty() || domain.contains(char::is_whitespace) {
        return Err(format!("--cluster-domain {:?}: not a domain", args.cluster_domain));
    }
    Ok(Settings {
        nameservers: args.nameservers.iter().map(ToString::to_string).collect(),
        cluster_domain: domain.to_owned(),
        options: args.options.list(),
        host_network: args.host_network_pods,
    })
}

/// Looks at the certificate's files every [`RELOAD_EVERY`]; reloads and says so when they change.
async fn reload_forever(certs: Arc<Certificates>, hook: Arc<Webhook>) {
    let mut every = tokio::time::interval(RELOAD_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        match certs.reload() {
            Reload::Unchanged => {}
            Reload::Loaded => {
                hook.metrics.reload(true);
                tracing::info!("the serving certificate changed: reloaded");
            }
            Reload::Failed(e) => {
                hook.metrics.reload(false);
                tracing::warn!(error = %e, "the serving certificate changed but does not load: still serving the old one");
            }
        }
    }
}

//! The forwarder's lease on the link-local queries, for the iptables backends.
//!
//! nftables' `tproxy` lets a packet go on when no socket takes it: with the forwarder gone, the
//! fallback chain's last rule stops matching and the query reaches the cache's socket. xt_TPROXY
//! drops it instead. So with iptables a fallback chain left behind by an agent that is gone (the
//! agent leaves its rules when it stops: SIGKILL, OOM, a rolling update) would cut a healthy
//! cache off from every pod that asks the link-local IP, on `Upstream` always and on `Local`
//! whenever the cache's socket blinks.
//!
//! The TPROXY rule therefore matches only under a lease: `-m recent --rcheck --seconds 1 --name
//! nodelocaldns-ha --rdest`, an entry for the link-local IP in an xt_recent table. Each
//! forwarder renews its IP's every [`RENEW`], from the very task that reads its UDP queries
//! ([`Holder`]): the lease says that someone reads what TPROXY hands over, not only that the
//! agent runs. The renewal is a heartbeat: a datagram from the loopback address to the
//! link-local IP's port [`HEARTBEAT_PORT`], which the fallback chain's first rule records (`-m
//! recent --set --rdest`) and drops, taking it only from `lo`: a pod can forge the datagram, and
//! IPv4 drops its loopback source only at the routing step, after that hook. A packet needs no
//! privilege, where the table's file under `/proc/net/xt_recent/` is root's alone (an agent run
//! as another user with its capabilities could not write it). The kernel forgets the entry by
//! itself [`LEASE_SECONDS`] after the last heartbeat, so a second after the forwarder stopped
//! (the process killed, or its runtime wedged or starved that long) the TPROXY rule stops
//! matching and the fallback chain is what nftables' is: the cache gets the queries. A clean
//! exit ends the lease at once where it may (as root, through the table's file).
//!
//! Until the agent has installed its rules a heartbeat changes nothing: the agent sends one more
//! itself the moment they are first in (`daemon::link_local::Forwarding::renew_lease`), so the
//! fallback works from then on, not a renewal later. The entry then lives as long as the rules
//! (the heartbeat rule is in the fallback chain on both routes). A heartbeat goes to the
//! link-local IP, so the forwarders start only once the agent's copy of it is on `lo`
//! (`daemon::link_local::start`); a copy someone removes is put back within a second, and the
//! heartbeats that failed meanwhile are said once, and their return too.

use std::fs::OpenOptions;
use std::io::{self, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::beat::{Beat, Ticks};

/// The xt_recent table's name, in the TPROXY rules and under `/proc/net/xt_recent/`.
pub const NAME: &str = "nodelocaldns-ha";
/// How long an entry lasts after its last renewal (`--seconds`: whole seconds, at least 1).
pub const LEASE_SECONDS: u32 = 1;
/// The port the heartbeats go to (discard): only the fallback chain's first rule sees them.
pub const HEARTBEAT_PORT: u16 = 9;
/// How often a forwarder renews it: five heartbeats a lease, from the task that serves its UDP
/// queries, on the agent's grid: a timerfd of the forwarders' runtime, armed at the instants
/// the agent's own ticks wake the process anyway, so that an idle forwarder's one thread wakes
/// with them (tokio's timer wheel, off the grid, had woken its two threads four times a second
/// more at 250 ms: a tenth of an idle iptables node's CPU; at 50 ms, a third). A starved
/// forwarder has 800 ms before the lease lapses.
pub const RENEW: Duration = Duration::from_millis(200);

/// The lease on the link-local IPs, held while [`Lease::renew`] is called.
#[derive(Debug)]
pub struct Lease {
    local: Vec<IpAddr>,
    /// One socket per family, bound to its loopback address.
    sockets: Vec<UdpSocket>,
    /// Renewals that could not be sent, since the lease was made.
    failed: AtomicU64,
}

impl Lease {
    /// The lease on `local`, renewed from sockets bound to the loopback addresses.
    pub fn new(local: &[IpAddr]) -> io::Result<Lease> {
        let mut sockets = Vec::new();
        for loopback in [IpAddr::V4(Ipv4Addr::LOCALHOST), IpAddr::V6(Ipv6Addr::LOCALHOST)] {
            if local.iter().any(|ip| ip.is_ipv4() == loopback.is_ipv4()) {
                let socket = UdpSocket::bind(SocketAddr::new(loopback, 0))?;
                socket.set_nonblocking(true)?;
                sockets.push(socket);
            }
        }
        Ok(Lease { local: local.to_vec(), sockets, failed: AtomicU64::new(0) })
    }

    /// Sends each link-local IP's heartbeat. It fails (`EINVAL`) while the IP is not local: a
    /// datagram from the loopback address cannot leave through another interface.
    pub fn renew(&self) -> io::Result<()> {
        let sent = self.send();
        if sent.is_err() {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        sent
    }

    /// How many renewals could not be sent.
    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::Relaxed)
    }

    fn send(&self) -> io::Result<()> {
        for &ip in &self.local {
            let socket = self
                .sockets
                .iter()
                .find(|s| s.local_addr().is_ok_and(|a| a.is_ipv4() == ip.is_ipv4()));
            if let Some(socket) = socket {
                socket.send_to(&[0], SocketAddr::new(ip, HEARTBEAT_PORT))?;
            }
        }
        Ok(())
    }
}

/// Ends the lease on `local` at once where this process may write the table's file (as root):
/// the TPROXY rules stop matching now, not a second from now. Elsewhere it lapses by itself.
pub fn release(local: &[IpAddr]) {
    let path = format!("/proc/thread-self/net/xt_recent/{NAME}");
    for ip in local {
        // One command per open: the file takes each at offset 0 only.
        if let Ok(mut file) = OpenOptions::new().write(true).open(&path) {
            let _ = file.write_all(format!("-{ip}\n").as_bytes());
        }
    }
}

/// A forwarder's hold on its lease: renewed every [`RENEW`] by the task that serves the
/// forwarder's UDP queries ([`Holder::start`] there), so that the lease says the forwarder
/// reads what TPROXY hands it. A runtime wedged or starved for 800 ms lets the lease lapse, and
/// the fallback chain sends the queries on to the cache's socket.
#[derive(Debug)]
pub struct Holder {
    lease: Arc<Lease>,
    beat: Beat,
}

impl Holder {
    /// A hold on `lease`, renewed on the agent's grid (`beat`).
    pub fn new(lease: Arc<Lease>, beat: Beat) -> Holder {
        Holder { lease, beat }
    }

    /// Starts the renewals; call it within the runtime of the task that will renew (its
    /// timer is that runtime's).
    pub(super) fn start(self) -> Renewals {
        Renewals { lease: self.lease, ticks: self.beat.every(RENEW), failing: false }
    }
}

/// The renewals of a [`Holder`]'s lease, due every [`RENEW`] on the grid.
pub(super) struct Renewals {
    lease: Arc<Lease>,
    ticks: Ticks,
    failing: bool,
}

impl Renewals {
    /// Completes when a renewal is due (the first at once). Cancel-safe.
    pub(super) async fn due(&mut self) {
        self.ticks.tick().await
    }

    /// Renews the lease. A failure is said once, not every renewal, and so is the first
    /// renewal sent after failures.
    pub(super) fn renew(&mut self) {
        match self.lease.renew() {
            Ok(()) if self.failing => {
                self.failing = false;
                tracing::info!("the forwarder's lease heartbeat is sent again");
            }
            Ok(()) => {}
            Err(e) if !self.failing => {
                self.failing = true;
                tracing::warn!(
                    error = %e,
                    "cannot send the forwarder's lease heartbeat: the iptables fallback lapses a \
                     second after the last one, and link-local queries go to the cache"
                );
            }
            Err(_) => {}
        }
    }
}

/// Until `renewals` (if any) are due; never without.
pub(super) async fn due(renewals: &mut Option<Renewals>) {
    match renewals {
        Some(renewals) => renewals.due().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{in_netns, run, test_path, Logs};

    /// A heartbeat to a link-local IP that is not on the node fails (`EINVAL`: the loopback
    /// source cannot leave through another interface): said once however many fail; once the IP
    /// is back, the first heartbeat sent is said too, once.
    #[test]
    fn a_failing_heartbeat_is_said_once_and_so_is_its_return() {
        in_netns("nlha-beat", test_path!(), |ns| {
            run("ip", &["-n", ns, "link", "set", "lo", "up"]);
            let local: IpAddr = "169.254.20.10".parse().unwrap();
            let runtime =
                tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let _in_runtime = runtime.enter();
            let lease = Arc::new(Lease::new(&[local]).unwrap());
            let mut renewals = Holder::new(lease.clone(), Beat::start()).start();
            let logs = Logs::default();
            let _logging = logs.capture();
            for _ in 0..3 {
                renewals.renew();
            }
            assert_eq!(lease.failed(), 3, "sent to an address that is not local");
            run("ip", &["-n", ns, "address", "add", "169.254.20.10/32", "dev", "lo"]);
            for _ in 0..3 {
                renewals.renew();
            }
            assert_eq!(lease.failed(), 3, "sent once the address is on lo");
            let text = logs.text();
            let failed = text.matches("cannot send the forwarder's lease heartbeat").count();
            assert_eq!(failed, 1, "the failure said once:\n{text}");
            assert_eq!(text.matches("lease heartbeat is sent again").count(), 1, "{text}");
        });
    }
}

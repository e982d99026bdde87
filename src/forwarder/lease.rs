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
//! nodelocaldns-ha --rdest` (an xt_recent table keyed by destination address), which the
//! forwarders' own runtime renews every [`RENEW`] by writing `+<link-local IP>` to the table's
//! file, `/proc/net/xt_recent/nodelocaldns-ha` (the node's: the agent runs in its network
//! namespace). The kernel forgets an entry by itself [`LEASE_SECONDS`] after its last renewal,
//! so a second after the forwarder stopped (the process killed, or its runtime starved that
//! long) the TPROXY rule stops matching and the fallback chain is what nftables' is: the cache
//! gets the queries. A clean exit ends the lease at once.
//!
//! The table exists once a rule naming it is in the kernel; until then (and on nodes where the
//! backend is nftables, which never names it) there is nothing to renew, and a renewal just
//! tries to open the file again.

use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom, Write};
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

/// The xt_recent table's name, in the TPROXY rules and under `/proc/net/xt_recent/`.
pub const NAME: &str = "nodelocaldns-ha";
/// How long an entry lasts after its last renewal (`--seconds`: whole seconds, at least 1).
pub const LEASE_SECONDS: u32 = 1;
/// How often the forwarders' runtime renews it: a fifth of the lease, so that four renewals in
/// a row may be late before it lapses.
pub const RENEW: Duration = Duration::from_millis(200);
/// How often it looks for the table while there is none yet.
const UNTIL_TABLE: Duration = Duration::from_millis(10);

/// The lease on the link-local IPs, held while [`Lease::renew`] is called.
#[derive(Debug)]
pub struct Lease {
    path: PathBuf,
    /// `+<ip>\n` for each link-local IP, written one at a time: the file takes one command per
    /// write, and only at offset 0 (xt_recent refuses a write at any other with ESPIPE, and
    /// `pwrite` too), so each goes after a seek to 0 on the file kept open.
    renewals: Vec<String>,
    file: Option<File>,
}

impl Lease {
    /// The lease on `local`, in this network namespace's table.
    pub fn new(local: &[IpAddr]) -> Lease {
        // thread-self, not self: `/proc/self/net` is the namespace of the process's main
        // thread, and a test thread may have entered another.
        Lease::at(PathBuf::from("/proc/thread-self/net/xt_recent").join(NAME), local)
    }

    fn at(path: PathBuf, local: &[IpAddr]) -> Lease {
        let renewals = local.iter().map(|ip| format!("+{ip}\n")).collect();
        Lease { path, renewals, file: None }
    }

    /// Renews every address's entry. `Ok(false)` when there is no table yet (no rule names it).
    pub fn renew(&mut self) -> io::Result<bool> {
        if self.file.is_none() {
            match OpenOptions::new().write(true).open(&self.path) {
                Ok(file) => self.file = Some(file),
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
                Err(e) => return Err(e),
            }
        }
        let file = self.file.as_mut().expect("just opened");
        for line in &self.renewals {
            if let Err(e) = at_start(file, line) {
                // The table went (its last rule deleted) while the file was open: open anew.
                self.file = None;
                return Err(e);
            }
        }
        Ok(true)
    }

    /// Ends the lease at once: the TPROXY rules stop matching now, not a second from now.
    pub fn release(&mut self) {
        let Ok(mut file) = OpenOptions::new().write(true).open(&self.path) else { return };
        for line in &self.renewals {
            let _ = at_start(&mut file, &format!("-{}", &line[1..]));
        }
    }
}

/// Writes `command` at the file's start.
fn at_start(file: &mut File, command: &str) -> io::Result<()> {
    file.seek(SeekFrom::Start(0))?;
    file.write_all(command.as_bytes())
}

/// Renews `lease` every [`RENEW`] for as long as the future runs (on the forwarders' runtime,
/// so that the lease lives and dies with them). Until the table exists (the agent installs its
/// rules after it starts the forwarders) it looks every [`UNTIL_TABLE`], so that the fallback
/// works from the moment its rules are in. A failure is said once, not every renewal.
pub async fn hold(mut lease: Lease) {
    let mut failing = false;
    loop {
        let next = match lease.renew() {
            Ok(true) => {
                failing = false;
                RENEW
            }
            Ok(false) => UNTIL_TABLE,
            Err(e) => {
                if !failing {
                    tracing::warn!(
                        file = %lease.path.display(),
                        error = %e,
                        "cannot renew the forwarder's lease: the iptables fallback lapses a \
                         second after the last renewal, and link-local queries go to the cache"
                    );
                }
                failing = true;
                UNTIL_TABLE
            }
        };
        tokio::time::sleep(next).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewal_waits_for_the_table_then_writes_each_command_at_offset_0() {
        let dir = std::env::temp_dir().join(format!("nlha-lease-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(NAME);
        let _ = std::fs::remove_file(&path);
        let mut lease = Lease::at(path.clone(), &["169.254.20.10".parse().unwrap()]);
        assert!(!lease.renew().unwrap(), "no table yet");
        std::fs::write(&path, "").unwrap();
        assert!(lease.renew().unwrap());
        assert!(lease.renew().unwrap());
        // Every command at offset 0, as the kernel's file wants them.
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "+169.254.20.10\n");
        lease.release();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "-169.254.20.10\n");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

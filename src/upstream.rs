//! The upstream: the kube-dns-upstream Service's ClusterIP(s), where CoreDNS is reached past
//! the agent's interception. The agent probes it to know whether failing over helps, and the
//! link-local forwarder sends it what the cache cannot take.
//!
//! Its address comes from `--upstream-ip`, or else from the variable the kubelet put in the
//! pod's environment (`KUBE_DNS_UPSTREAM_SERVICE_HOST`, as node-cache reads it). Both are fixed
//! when the pod starts: a Service deleted and re-created gets a new ClusterIP, and the pod keeps
//! the old one through every restart of its container, its upstream probes failing for good. So
//! with the API client on and no `--upstream-ip` (a flag wins), the agent follows the Service
//! through the API server ([`crate::cluster::follow`]). Each address it learns is checked as the
//! flag's would be, then published here ([`Following::set`]). Every user reads it where it
//! dials: each probe, each forwarder socket's re-dial (every 5 s), each relayed TCP connection.
//! A Service that goes away leaves the last address in place (nothing better is known), and
//! `status` says so.
//!
//! A Service that does not exist when the pod starts (no variable in its environment) is waited
//! for the same way, when the API client is on: the agent starts without an upstream
//! ([`Upstream::awaited`]) and is not ready until the Service is there. Nothing the cache needs
//! waits for it: the ruleset of route `Local` names only the cache's addresses, so a healthy
//! cache serves the pods as it would without the agent. What needs the upstream waits: its
//! probes do not start (a cache failure is then never held for a failing upstream: on the
//! cluster-DNS IP, the fallback is kube-proxy's own path to CoreDNS, which needs no address
//! here), and the link-local forwarder has nowhere to send (the link-local IP's clients fail
//! with a dead cache, as they would with node-local-dns alone).

use std::net::{IpAddr, SocketAddr};

use tokio::sync::watch;

use crate::ruleset::{ListenAddrs, DNS_PORT};

/// The upstream's addresses, and where they came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Upstream {
    /// One per family at most, as `--upstream-ip` takes them.
    pub ips: Vec<IpAddr>,
    /// Where they came from, as `status` says it: `--upstream-ip`, the environment variable, or
    /// the Service followed through the API server.
    pub from: String,
}

/// The upstream as it is now, shared by everything that dials it.
#[derive(Debug)]
pub struct Following {
    latest: watch::Sender<Upstream>,
}

impl Upstream {
    /// No address yet: the Service `name` is waited for through the API server.
    pub fn awaited(name: &str) -> Upstream {
        Upstream { ips: Vec::new(), from: format!("Service {name} (waited for: not there yet)") }
    }

    /// Whether it has no address yet ([`Upstream::awaited`]).
    pub fn is_awaited(&self) -> bool {
        self.ips.is_empty()
    }
}

impl Following {
    /// Starts at `upstream` (the flags' or the environment's).
    pub fn new(upstream: Upstream) -> Following {
        Following { latest: watch::Sender::new(upstream) }
    }

    /// Publishes `upstream`; whether it changed anything.
    pub fn set(&self, upstream: Upstream) -> bool {
        self.latest.send_if_modified(|now| {
            let changed = *now != upstream;
            *now = upstream;
            changed
        })
    }

    /// The upstream now.
    pub fn now(&self) -> Upstream {
        self.latest.borrow().clone()
    }

    /// The address a client of family `v4` dials, kept current.
    pub fn addr(&self, v4: bool) -> Addr {
        Addr { latest: self.latest.subscribe(), v4, port: DNS_PORT }
    }

    /// Hears every change.
    pub fn subscribe(&self) -> watch::Receiver<Upstream> {
        self.latest.subscribe()
    }
}

/// The address to dial the upstream at, read anew at each dial ([`Addr::now`]).
#[derive(Clone, Debug)]
pub struct Addr {
    latest: watch::Receiver<Upstream>,
    v4: bool,
    port: u16,
}

impl Addr {
    /// The upstream's address of the wanted family, else its first; on port 53.
    pub fn now(&self) -> SocketAddr {
        pick(&self.latest.borrow().ips, self.v4, self.port)
    }

    /// Completes once the upstream has an address (at once when it has one).
    pub async fn known(&mut self) {
        if self.latest.wait_for(|u| !u.is_awaited()).await.is_err() {
            std::future::pending().await
        }
    }

    /// Completes when the upstream changes (marking it seen); never for a fixed address.
    pub async fn changed(&mut self) {
        if self.latest.changed().await.is_err() {
            std::future::pending().await
        }
    }
}

impl From<SocketAddr> for Addr {
    /// An address that never changes.
    fn from(addr: SocketAddr) -> Addr {
        let fixed = Upstream { ips: vec![addr.ip()], from: String::new() };
        Addr {
            latest: watch::Sender::new(fixed).subscribe(),
            v4: addr.is_ipv4(),
            port: addr.port(),
        }
    }
}

/// Why an upstream cannot be used.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unusable {
    /// It is one of the addresses the agent intercepts.
    #[error(
        "{flag} {ip} is also {other}: probing it would probe the cache; give the \
         kube-dns-upstream ClusterIP, which the agent does not intercept"
    )]
    Intercepted { flag: String, ip: IpAddr, other: &'static str },
    /// It has no address of the family the cache is probed in.
    #[error(
        "{flag} ({upstream}) has no {family} address: the upstream is probed over {family}, \
         like the cache at {cache}; give its {family} ClusterIP"
    )]
    Family { flag: String, upstream: String, family: &'static str, cache: IpAddr },
}

/// Checks the upstream (named `flag` in errors: a flag, a variable, a Service) against the
/// listen addresses: it must not be one of them (the agent intercepts those), and it must have
/// an address of the family the cache is probed in, so that the two probes compare like with
/// like.
pub fn check(flag: &str, upstream: &[IpAddr], addrs: &ListenAddrs) -> Result<(), Unusable> {
    for &ip in upstream {
        let other = if addrs.cluster_dns.contains(&ip) {
            "--cluster-dns-ip"
        } else if addrs.local.contains(&ip) {
            "--local-ip"
        } else {
            continue;
        };
        return Err(Unusable::Intercepted { flag: flag.to_owned(), ip, other });
    }
    let cache = addrs.local[0];
    if !upstream.iter().any(|ip| ip.is_ipv4() == cache.is_ipv4()) {
        let list: Vec<String> = upstream.iter().map(ToString::to_string).collect();
        return Err(Unusable::Family {
            flag: flag.to_owned(),
            upstream: list.join(","),
            family: if cache.is_ipv4() { "IPv4" } else { "IPv6" },
            cache,
        });
    }
    Ok(())
}

/// The address of `ips` of the wanted family, else the first, on `port`.
pub fn pick(ips: &[IpAddr], v4: bool, port: u16) -> SocketAddr {
    let ip = ips.iter().find(|ip| ip.is_ipv4() == v4).or(ips.first());
    SocketAddr::new(ip.copied().unwrap_or(IpAddr::from([0, 0, 0, 0])), port)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upstream(ips: &[&str], from: &str) -> Upstream {
        Upstream { ips: ips.iter().map(|ip| ip.parse().unwrap()).collect(), from: from.into() }
    }

    #[test]
    fn an_address_follows_what_is_published_and_keeps_its_family() {
        let following = Following::new(upstream(&["10.96.0.11", "fd00::11"], "--upstream-ip"));
        let (v4, v6) = (following.addr(true), following.addr(false));
        assert_eq!(v4.now().to_string(), "10.96.0.11:53");
        assert_eq!(v6.now().to_string(), "[fd00::11]:53");
        assert!(following.set(upstream(&["10.96.0.12"], "Service kube-system/kube-dns-upstream")));
        assert_eq!(v4.now().to_string(), "10.96.0.12:53");
        // No address of its family left: the first, as the forwarder of that family dials.
        assert_eq!(v6.now().to_string(), "10.96.0.12:53");
        assert!(!following.set(following.now()), "the same upstream is no change");
    }

    #[test]
    fn a_fixed_address_keeps_its_port() {
        let addr = Addr::from("127.0.0.1:5353".parse::<SocketAddr>().unwrap());
        assert_eq!(addr.now().to_string(), "127.0.0.1:5353");
    }
}

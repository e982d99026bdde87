//! The upstream Service followed through the API server ([`crate::upstream`]): listed by name,
//! then watched, and listed again whenever the watch ends. Each ClusterIP it shows is checked as
//! `--upstream-ip` would be and published; a Service deleted, headless or unusable keeps the
//! last usable address, and `status` says why. The API server away changes nothing but what is
//! learnt: each failure is said once per outage and retried with backoff, as the reports are. A
//! list that works ends no outage: only a watch that stays open does (`HEALTHY_WATCH`).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use kube::api::{Api, DynamicObject, ListParams, WatchEvent, WatchParams};
use tracing::{info, warn};

use super::{core_v1, within, Outage, REPORT_TIMEOUT};
use crate::ruleset::ListenAddrs;
use crate::upstream::{self, Following, Upstream};

/// How long one watch runs before the API server ends it (it is then listed and watched anew).
const WATCH_SECS: u32 = 290;
/// A watch open this long is a working one: only then is an outage over and the backoff starts
/// over. One that fails or ends sooner is a failure however its list went, so an API server
/// that lists but refuses watches (priority and fairness's 429) or a proxy that cuts them is
/// asked at most once per longest backoff, not listed and watched every second by every agent.
const HEALTHY_WATCH: Duration = super::BACKOFF.1;
/// A watch that brings nothing for this long (not even the API server's end of it) is dead.
const WATCH_SILENCE: Duration = Duration::from_secs(WATCH_SECS as u64 + 30);

/// What the follower checks and publishes to.
pub struct Follower {
    /// The upstream Service's name; its namespace is the client's (the pod's).
    pub name: String,
    /// What the agent intercepts: the upstream must not be one of them.
    pub addrs: ListenAddrs,
    pub following: Arc<Following>,
}

/// Follows the Service forever.
pub async fn follow(client: kube::Client, follower: Follower) {
    let namespace = client.default_namespace().to_owned();
    let services = Api::namespaced_with(client, &namespace, &core_v1("Service", "services"));
    let from = format!("Service {namespace}/{}", follower.name);
    let mut outage = Outage::default();
    loop {
        let mut working = || {
            if outage.ended() {
                info!(service = %from, "following the upstream Service again");
            }
        };
        let said = match watch_once(&services, &from, &follower, &mut working).await {
            Ok(Watched::Working) => continue,
            // Listed and watched again at once, it would spin: backed off like a failure.
            Ok(Watched::Short) => format!("the watch ended within {HEALTHY_WATCH:?} of the list"),
            Err(said) => said,
        };
        if outage.began() {
            warn!(service = %from, error = %said, "following the upstream Service failed; retrying with backoff (its last address is kept)");
        }
        outage.back_off().await;
    }
}

/// How a watch that ended without failing went.
enum Watched {
    /// It was open [`HEALTHY_WATCH`] or longer.
    Working,
    /// It ended sooner.
    Short,
}

/// Lists the Service and watches it until the watch ends (`Ok`) or fails; `working` is called
/// once the watch has been open [`HEALTHY_WATCH`].
async fn watch_once(
    services: &Api<DynamicObject>,
    from: &str,
    follower: &Follower,
    working: &mut (dyn FnMut() + Send),
) -> Result<Watched, String> {
    let selector = format!("metadata.name={}", follower.name);
    let params = ListParams::default().fields(&selector);
    let list = within(REPORT_TIMEOUT, services.list(&params)).await?;
    observe(list.items.first(), from, follower);
    let version = list.metadata.resource_version.unwrap_or_default();
    let params = WatchParams::default().fields(&selector).timeout(WATCH_SECS);
    let healthy_at = tokio::time::Instant::now() + HEALTHY_WATCH;
    let stream = within(REPORT_TIMEOUT, services.watch(&params, &version)).await?;
    let mut stream = std::pin::pin!(stream);
    let mut healthy = false;
    loop {
        let next = tokio::select! {
            next = tokio::time::timeout(WATCH_SILENCE, stream.next()) => next,
            () = tokio::time::sleep_until(healthy_at), if !healthy => {
                healthy = true;
                working();
                continue;
            }
        };
        let next = next.map_err(|_| format!("the watch brought nothing for {WATCH_SILENCE:?}"))?;
        let ended = if healthy { Watched::Working } else { Watched::Short };
        match next.transpose().map_err(|e| e.to_string())? {
            None => return Ok(ended),
            Some(WatchEvent::Added(service) | WatchEvent::Modified(service)) => {
                observe(Some(&service), from, follower)
            }
            Some(WatchEvent::Deleted(_)) => observe(None, from, follower),
            Some(WatchEvent::Bookmark(_)) => {}
            // 410 Gone: the version is too old; the list that follows catches up.
            Some(WatchEvent::Error(status)) if status.code == 410 => return Ok(ended),
            Some(WatchEvent::Error(status)) => return Err(status.message.clone()),
        }
    }
}

/// Publishes what `service` (`None`: there is none) says of the upstream.
fn observe(service: Option<&DynamicObject>, from: &str, follower: &Follower) {
    let last = follower.following.now().ips;
    let kept = |why: String| Upstream { ips: last.clone(), from: format!("{from} ({why})") };
    let upstream = match service.map(|s| usable(s, from, &follower.addrs)) {
        Some(Ok(ips)) => Upstream { ips, from: from.to_owned() },
        Some(Err(why)) if last.is_empty() => kept(format!("{why}; waited for")),
        Some(Err(why)) => kept(format!("{why}; its last usable ClusterIP kept")),
        None if last.is_empty() => kept("not found yet; waited for".into()),
        None => kept("not found; its last ClusterIP kept".into()),
    };
    let ips = upstream.ips.clone();
    let said = upstream.from.clone();
    if follower.following.set(upstream) {
        let ips: Vec<String> = ips.iter().map(ToString::to_string).collect();
        if said == from {
            info!(service = %from, upstream = %ips.join(","), "the upstream follows its Service");
        } else {
            warn!(upstream = %ips.join(","), "{said}");
        }
    }
}

/// The ClusterIPs of `service`, if the agent can use them as its upstream.
fn usable(service: &DynamicObject, from: &str, addrs: &ListenAddrs) -> Result<Vec<IpAddr>, String> {
    let spec = &service.data["spec"];
    let listed = spec["clusterIPs"].as_array().filter(|ips| !ips.is_empty());
    let texts: Vec<&str> = match listed {
        Some(ips) => ips.iter().filter_map(|ip| ip.as_str()).collect(),
        None => spec["clusterIP"].as_str().into_iter().collect(),
    };
    let texts: Vec<_> = texts.into_iter().filter(|t| !t.is_empty() && *t != "None").collect();
    if texts.is_empty() {
        return Err("it has no ClusterIP".into());
    }
    let ips = texts
        .iter()
        .map(|t| t.parse::<IpAddr>().map_err(|_| format!("its ClusterIP {t:?} is no IP")))
        .collect::<Result<Vec<_>, _>>()?;
    upstream::check(from, &ips, addrs).map_err(|e| e.to_string())?;
    Ok(ips)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::Logs;

    fn service(cluster_ips: &[&str]) -> DynamicObject {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "kube-dns-upstream", "namespace": "kube-system"},
            "spec": {"clusterIP": cluster_ips.first(), "clusterIPs": cluster_ips},
        }))
        .unwrap()
    }

    fn follower() -> Follower {
        let addrs = ListenAddrs {
            local: vec!["169.254.20.10".parse().unwrap()],
            cluster_dns: vec!["10.96.0.10".parse().unwrap()],
        };
        let start = Upstream { ips: vec!["10.96.0.11".parse().unwrap()], from: "env".into() };
        let following = Arc::new(Following::new(start));
        Follower { name: "kube-dns-upstream".into(), addrs, following }
    }

    const FROM: &str = "Service kube-system/kube-dns-upstream";

    /// What a fake API server was asked: each request, by when, and whether it was a watch.
    type Asked = Arc<std::sync::Mutex<Vec<(Duration, bool)>>>;

    /// An API server that lists the Service and answers every watch of it with 429 Too Many
    /// Requests (priority and fairness shedding watches; a proxy that cuts them is the same to
    /// the follower): each LIST and WATCH it was asked, by when (from the start), in order.
    fn shedding_watches(start: tokio::time::Instant) -> (kube::Client, Asked) {
        let asked = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = asked.clone();
        let service = tower::service_fn(move |request: http::Request<kube::client::Body>| {
            let watch = request.uri().query().is_some_and(|q| q.contains("watch=true"));
            seen.lock().unwrap().push((start.elapsed(), watch));
            let body = if watch {
                serde_json::json!({
                    "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 429,
                    "reason": "TooManyRequests", "message": "too many requests, please try again later",
                })
            } else {
                serde_json::json!({
                    "kind": "ServiceList", "apiVersion": "v1", "metadata": {"resourceVersion": "7"},
                    "items": [{
                        "metadata": {"name": "kube-dns-upstream", "namespace": "kube-system"},
                        "spec": {"clusterIP": "10.96.0.11", "clusterIPs": ["10.96.0.11"]},
                    }],
                })
            };
            let response = http::Response::builder()
                .status(if watch { 429 } else { 200 })
                .header("content-type", "application/json")
                .body(kube::client::Body::from(serde_json::to_vec(&body).unwrap()))
                .unwrap();
            std::future::ready(Ok::<_, std::convert::Infallible>(response))
        });
        (kube::Client::new(service, "kube-system"), asked)
    }

    /// An API server that lists the Service but refuses every watch (429): after the first
    /// minute the follower lists and watches at most once per 30 s (the longest backoff), a list
    /// that works resetting nothing while the watches fail, and says so once.
    #[tokio::test(start_paused = true)]
    async fn a_watch_refused_after_a_good_list_backs_off_all_the_same() {
        let logs = Logs::default();
        let _logging = logs.capture();
        let start = tokio::time::Instant::now();
        let (client, asked) = shedding_watches(start);
        let following = tokio::spawn(follow(client, follower()));
        tokio::time::sleep(Duration::from_secs(600)).await;
        following.abort();

        let asked = asked.lock().unwrap().clone();
        let lists: Vec<Duration> = asked.iter().filter(|(_, w)| !w).map(|(at, _)| *at).collect();
        let watches = asked.iter().filter(|(_, w)| *w).count();
        let late: Vec<Duration> =
            lists.iter().copied().filter(|at| *at >= Duration::from_secs(60)).collect();
        println!("{} lists, {watches} watches; after the first minute at {late:.0?}", lists.len());
        assert!(watches >= lists.len() - 1 && watches <= lists.len(), "each list then its watch");
        assert!(
            late.len() <= 540 / 30 + 1,
            "{} lists in the 540 s after the first minute: more than one per 30 s",
            late.len()
        );
        for pair in late.windows(2) {
            assert!(pair[1] - pair[0] >= Duration::from_secs(30), "relisted after {pair:?}");
        }
        let text = logs.text();
        let warned = text.matches("following the upstream Service failed").count();
        assert_eq!(warned, 1, "one warning for the outage:\n{text}");
    }

    #[test]
    fn a_new_cluster_ip_is_published_and_an_unusable_one_keeps_the_last() {
        let follower = follower();
        let now = || follower.following.now();
        observe(Some(&service(&["10.96.0.12"])), FROM, &follower);
        assert_eq!(now().ips, ["10.96.0.12".parse::<IpAddr>().unwrap()]);
        assert_eq!(now().from, FROM);
        for (unusable, why) in [
            (service(&["None"]), "it has no ClusterIP"),
            (service(&["10.96.0.10"]), "is also --cluster-dns-ip"),
            (service(&["fd00::12"]), "has no IPv4 address"),
        ] {
            observe(Some(&unusable), FROM, &follower);
            assert_eq!(now().ips, ["10.96.0.12".parse::<IpAddr>().unwrap()], "{why}");
            assert!(now().from.contains(why), "{}", now().from);
            assert!(now().from.contains("its last usable ClusterIP kept"), "{}", now().from);
        }
        observe(None, FROM, &follower);
        assert_eq!(now().ips, ["10.96.0.12".parse::<IpAddr>().unwrap()]);
        assert_eq!(now().from, format!("{FROM} (not found; its last ClusterIP kept)"));
        observe(Some(&service(&["10.96.0.13", "fd00::13"])), FROM, &follower);
        assert_eq!(now().ips.len(), 2);
        assert_eq!(now().from, FROM);
    }
}

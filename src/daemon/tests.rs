//! The daemon's loop, run whole.
//!
//! Most of these run [`run_with`] on a paused tokio clock (a current-thread runtime) with the
//! fake dataplane and scripted probes ([`Scripted`]), and none of the node's watchers: the clock
//! moves only when every task waits, from one timer to the next, so a probe every 100 ms, a
//! timeout of 80 ms and a hold of 2 s happen at exactly those instants, in a few milliseconds of
//! wall time. A read-back runs in `spawn_blocking`, which keeps the paused clock from moving
//! until it is done: a check in flight is never overtaken by time. The test reads the loop from
//! outside, as an operator would: the fake kernel, and `status` through the request channel.
//! The scripts change at instants off the 100 ms grid of the probes and ticks, so nothing
//! depends on the order of two things due at the same instant.
//!
//! One test runs the whole loop as on the node, in a network namespace of its own.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Mutex;

use hickory_proto::op::ResponseCode;
use tokio::sync::oneshot;

use super::*;
use crate::config::{test_raw, RawRun};
use crate::control::{Peer, Request, Response};
use crate::dataplane::fake::FakeDataplane;
use crate::probe::{Outcome, ProbeResult, Transport};
use crate::ruleset::Route;
use crate::state::State;

fn cfg() -> AgentConfig {
    let raw = RawRun { state_dir: "/nonexistent".into(), ..test_raw() };
    AgentConfig::from_args(&raw, |_| None).unwrap()
}

/// The route whose ruleset the fake kernel holds.
fn installed(fake: &FakeDataplane) -> Option<Route> {
    crate::dataplane::installed_route(&mut fake.clone(), &cfg().addrs, Default::default()).unwrap()
}

/// The whole loop, in a network namespace of its own (it probes, binds its sockets and
/// reads netfilter there): a task that dies stops the agent with an error naming it (exit
/// code 1), and the ruleset it installed stays.
#[test]
fn the_agent_exits_on_a_dead_task_and_leaves_its_ruleset() {
    crate::testutil::in_netns("nlha-agent", crate::testutil::test_path!(), |_| {
        let dir = std::env::temp_dir().join(format!("nlha-agent-{}", std::process::id()));
        let raw = RawRun { state_dir: dir.clone(), ..test_raw() };
        let cfg = AgentConfig::from_args(&raw, |_| None).unwrap();
        let fake = FakeDataplane::default();
        let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
        let agent = Box::new(fake.clone());
        let result = runtime.block_on(async {
            let mut tasks = Tasks::default();
            // Its end waits in the task set until the loop looks.
            tasks.spawn("doomed watch", async { panic!("injected") });
            let shutdown = std::future::pending();
            let world = World { tasks, ..World::node() };
            let run = run_with(cfg, agent, Notes::default(), Vec::new(), shutdown, world);
            tokio::time::timeout(Duration::from_secs(30), run).await
        });
        let _ = std::fs::remove_dir_all(&dir);
        let error = result.expect("the agent went on with a dead task").expect_err("exit 0");
        assert!(
            matches!(error, AgentError::TaskDied { task: "doomed watch", ref how } if how == "panicked: injected"),
            "{error}"
        );
        // Left as it was (Local, or Upstream if a probe found no cache in this namespace
        // before the loop looked at its tasks), not removed.
        assert!(installed(&fake).is_some(), "the ruleset was not left in place");
    });
}

/// How a scripted server treats a probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Server {
    /// Answers at once.
    Alive,
    /// Nothing listens: refused at once.
    Dead,
    /// Never answers: the probe times out, on the paused clock.
    Hung,
    /// Answers SERVFAIL at once.
    ServFail,
}

/// What the cache and the upstream do now; the test switches them as it goes.
#[derive(Debug)]
struct Script {
    cache: Server,
    upstream: Server,
}

/// A probe stream's prober, played from the [`Script`]: the cache's address says which server
/// is probed.
struct Scripted {
    script: Arc<Mutex<Script>>,
    cache: SocketAddr,
    timeout: Duration,
}

impl Prober for Scripted {
    fn probe(
        &self,
        target: SocketAddr,
        _: Transport,
    ) -> Pin<Box<dyn Future<Output = ProbeResult> + Send + '_>> {
        let script = self.script.lock().unwrap();
        let server = if target == self.cache { script.cache } else { script.upstream };
        let timeout = self.timeout;
        Box::pin(async move {
            let at_once = |outcome| ProbeResult { outcome, latency: Duration::from_millis(1) };
            match server {
                Server::Alive => at_once(Outcome::Answered { rcode: ResponseCode::NoError }),
                Server::Dead => at_once(Outcome::Refused),
                Server::ServFail => {
                    at_once(Outcome::ServerFailure { rcode: ResponseCode::ServFail })
                }
                Server::Hung => {
                    tokio::time::sleep(timeout).await;
                    ProbeResult { outcome: Outcome::Timeout, latency: timeout }
                }
            }
        })
    }
}

/// The test's hands on the loop under test ([`Node::run`]): the fake kernel, the script, the
/// request channel, the state directory. The test's configuration: a UDP probe of the cache
/// every 100 ms (timeout 80 ms), a TCP one and an upstream one (timeout 500 ms) every second,
/// `fall` 3, `rise` 5, `min-hold` 2 s; no metrics endpoint.
struct Node {
    cfg: AgentConfig,
    fake: FakeDataplane,
    script: Arc<Mutex<Script>>,
    requests: mpsc::Sender<Incoming>,
    /// When the node was made, on the paused clock; the loop starts then (no time passes
    /// before [`Node::run`]), and the tests' instants count from here.
    t0: tokio::time::Instant,
}

impl Node {
    /// A node whose cache and upstream are alive, and the world its loop runs in; `name` names
    /// its state directory.
    fn new(name: &str) -> (Node, World) {
        let dir = std::env::temp_dir().join(format!("nlha-loop-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let raw = RawRun { state_dir: dir, metrics_addr: "off".into(), ..test_raw() };
        let cfg = AgentConfig::from_args(&raw, |_| None).unwrap();
        let script = Arc::new(Mutex::new(Script { cache: Server::Alive, upstream: Server::Alive }));
        let (requests, incoming) = mpsc::channel(8);
        let (played, cache) = (script.clone(), cfg.cache_target());
        let world = World {
            probes: Box::new(move |_, timeout, _| {
                Ok(Arc::new(Scripted { script: played.clone(), cache, timeout }))
            }),
            watch_node: false,
            requests: Some(incoming),
            tasks: Tasks::default(),
        };
        let t0 = tokio::time::Instant::now();
        let node = Node { cfg, fake: FakeDataplane::default(), script, requests, t0 };
        (node, world)
    }

    /// Runs the loop in `world` until `steps` are done, then shuts it down; what `steps`
    /// returned.
    async fn run<T>(&self, world: World, steps: impl Future<Output = T>) -> T {
        let (stop, stopped) = oneshot::channel::<()>();
        let shutdown = async {
            let _ = stopped.await;
        };
        let (cfg, dataplane) = (self.cfg.clone(), Box::new(self.fake.clone()));
        let run = run_with(cfg, dataplane, Notes::default(), Vec::new(), shutdown, world);
        let steps = async {
            let done = steps.await;
            let _ = stop.send(());
            done
        };
        let (result, done) = tokio::join!(run, steps);
        result.expect("the loop ran until its shutdown");
        done
    }

    /// Time since the loop started, on the paused clock.
    fn elapsed(&self) -> Duration {
        self.t0.elapsed()
    }

    /// Lets the clock run to `until` ms after the start, looking every 50 ms on the way: the
    /// kernel always holds the ruleset of the agent's route.
    async fn watch(&self, from: u64, until: u64) {
        let mut at = from + 50;
        while at < until {
            self.at(at).await;
            self.route().await;
            at += 50;
        }
        self.at(until).await;
    }

    /// Lets the paused clock run to `ms` after the start: it moves from one timer to the next,
    /// the probes and the loop turning at each.
    async fn at(&self, ms: u64) {
        tokio::time::sleep_until(self.t0 + Duration::from_millis(ms)).await;
    }

    fn cache(&self, server: Server) {
        self.script.lock().unwrap().cache = server;
    }

    fn upstream(&self, server: Server) {
        self.script.lock().unwrap().upstream = server;
    }

    /// Sends `request` into the loop as the control socket would; where the answer arrives.
    async fn send(&self, request: Request) -> oneshot::Receiver<Response> {
        let (reply, answer) = oneshot::channel();
        let peer = Peer { uid: 0, gid: 0, pid: Some(7) };
        let incoming = Incoming { request, peer, reply };
        self.requests.send(incoming).await.expect("the loop takes requests");
        answer
    }

    /// Sends `request` and waits for its answer.
    async fn ask(&self, request: Request) -> Response {
        self.send(request).await.await.expect("an answer")
    }

    /// What `status` says now.
    async fn state(&self) -> State {
        match self.ask(Request::Status).await {
            Response::Ok { message } => serde_json::from_str(&message).expect("the state"),
            Response::Error { message } => panic!("status failed: {message}"),
        }
    }

    /// The route the agent is on, checked against the ruleset the fake kernel holds.
    async fn route(&self) -> Route {
        let route = self.state().await.route;
        assert_eq!(self.installed(), Some(route), "the kernel holds the route's ruleset");
        route
    }

    fn installed(&self) -> Option<Route> {
        installed(&self.fake)
    }

    /// Whether the override record is on disk.
    fn recorded(&self) -> bool {
        crate::overrides::read(&self.cfg.state_dir).unwrap().is_some()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.cfg.state_dir);
    }
}

fn message(response: &Response) -> &str {
    match response {
        Response::Ok { message } | Response::Error { message } => message,
    }
}

/// A refused probe leaves `Local` at once; `Local` comes back only after `rise` good probes
/// and `min-hold` in `Upstream`, whichever is later: `min-hold` after a short crash, `rise`
/// after a long one.
#[tokio::test(start_paused = true)]
async fn a_crashed_cache_is_left_at_once_and_earned_back() {
    let (node, world) = Node::new("crash");
    node.run(world, async {
        node.at(505).await;
        assert_eq!(node.route().await, Route::Local);
        node.at(1050).await;
        node.cache(Server::Dead);
        // The first probe after the crash, at 1.1 s, is refused.
        node.at(1095).await;
        assert_eq!(node.route().await, Route::Local);
        node.at(1105).await;
        assert_eq!(node.route().await, Route::Upstream);
        let st = node.state().await;
        assert!(st.reason.contains("refused"), "{}", st.reason);
        // Back at 1.55 s: 5 good probes by 2.0 s, but min-hold runs to 3.1 s.
        node.at(1550).await;
        node.cache(Server::Alive);
        node.at(3095).await;
        assert_eq!(node.route().await, Route::Upstream);
        assert!(node.state().await.probes.cache_udp.streak_good >= 5, "rise is met");
        node.at(3105).await;
        assert_eq!(node.route().await, Route::Local);
        // A long crash: min-hold is over at 6.1 s; the 5th good probe comes at 6.4 s.
        node.at(4050).await;
        node.cache(Server::Dead);
        node.at(4105).await;
        assert_eq!(node.route().await, Route::Upstream);
        node.at(5950).await;
        node.cache(Server::Alive);
        node.at(6395).await;
        assert_eq!(node.route().await, Route::Upstream);
        node.at(6405).await;
        assert_eq!(node.route().await, Route::Local);
        let st = node.state().await;
        assert_eq!((st.transitions, st.repairs), (4, 0));
    })
    .await;
    assert_eq!(node.fake.kernel().applies, 5, "the start's, and one per transition");
}

/// A hung cache is left when its `fall`-th probe in a row times out, not a probe earlier.
#[tokio::test(start_paused = true)]
async fn a_hung_cache_is_left_at_the_fall_th_timed_out_probe() {
    let (node, world) = Node::new("hang");
    node.run(world, async {
        node.at(1050).await;
        node.cache(Server::Hung);
        // Probes at 1.1, 1.2 and 1.3 s, each timing out 80 ms later.
        node.at(1375).await;
        assert_eq!(node.route().await, Route::Local);
        assert_eq!(node.state().await.probes.cache_udp.streak_bad, 2);
        node.at(1385).await;
        assert_eq!(node.route().await, Route::Upstream);
        let udp = node.state().await.probes.cache_udp;
        // 11 answered (0 to 1.0 s), then 3 timed out.
        assert_eq!((udp.sent, udp.good, udp.bad, udp.streak_bad), (14, 11, 3, 3));
        assert_eq!(udp.last.as_deref(), Some("timeout"));
        assert_eq!(node.state().await.transitions, 1);
    })
    .await;
}

/// A cache that answers SERVFAIL is failing; while the upstream fails as well, the route is
/// held on `Local` (and says so), and it leaves once the upstream answers again.
#[tokio::test(start_paused = true)]
async fn a_servfailing_cache_is_held_while_the_upstream_fails_too() {
    let (node, world) = Node::new("servfail");
    node.upstream(Server::ServFail);
    node.run(world, async {
        // The upstream's probes at 0, 1 and 2 s fail: it is failing from 2 s on.
        node.at(2050).await;
        node.cache(Server::ServFail);
        node.at(2305).await;
        assert_eq!(node.route().await, Route::Local);
        let st = node.state().await;
        assert_eq!(st.probes.cache_udp.streak_bad, 3);
        assert!(st.held.as_deref().is_some_and(|h| h.contains("staying local")), "{st:?}");
        node.upstream(Server::Hung);
        node.at(2995).await;
        assert_eq!(node.route().await, Route::Local);
        node.at(3505).await;
        assert_eq!(node.route().await, Route::Local, "a hung upstream fails as well");
        node.upstream(Server::Alive);
        // The upstream's next probe, at 4 s, answers.
        node.at(4005).await;
        assert_eq!(node.route().await, Route::Upstream);
        assert_eq!(node.state().await.held, None);
    })
    .await;
}

/// An upstream whose Service is waited for ([`crate::upstream::Upstream::awaited`]) is not
/// probed: a dead cache then fails over (on the cluster-DNS IP the fallback is kube-proxy's,
/// which needs no address of the agent's), never held for an upstream nobody could probe, though
/// the script's upstream is dead and would have failed every probe.
#[tokio::test(start_paused = true)]
async fn an_awaited_upstream_is_not_probed_and_holds_no_failover() {
    let (mut node, world) = Node::new("awaited");
    node.cfg.upstream = crate::upstream::Upstream::awaited("kube-dns-upstream");
    node.upstream(Server::Dead);
    node.run(world, async {
        node.at(4050).await;
        assert_eq!(node.route().await, Route::Local, "the cache serves meanwhile");
        let st = node.state().await;
        assert_eq!(st.probes.upstream.sent, 0, "{st:?}");
        assert_eq!(st.probes.upstream.target, "none yet");
        assert!(st.upstream_from.contains("waited for"), "{}", st.upstream_from);
        node.cache(Server::Dead);
        node.at(4155).await;
        assert_eq!(node.route().await, Route::Upstream);
        assert_eq!(node.state().await.held, None);
    })
    .await;
}

/// A cache that keeps dying and coming back: the route returns to `Local` at most
/// ⌈duration / min-hold⌉ + 1 times, and whenever one looks, the kernel holds the ruleset of
/// the agent's route; nothing is ever repaired or applied twice.
#[tokio::test(start_paused = true)]
async fn a_flapping_cache_returns_to_local_at_most_once_per_min_hold() {
    let (node, world) = Node::new("flap");
    // Dead for 200 ms, then alive for so long, round and round.
    let alive_ms = [350, 2250, 650, 1450, 2650, 150, 3050, 550, 1250, 2850, 750, 1950];
    let start = 1025;
    let st = node
        .run(world, async {
            node.at(start).await;
            let mut at = start;
            for alive in alive_ms {
                node.cache(Server::Dead);
                node.watch(at, at + 200).await;
                at += 200;
                node.cache(Server::Alive);
                node.watch(at, at + alive).await;
                at += alive;
            }
            node.state().await
        })
        .await;
    let lasted = node.elapsed().as_millis() as u64 - start;
    let min_hold = node.cfg.thresholds.min_hold.as_millis() as u64;
    let bound = lasted.div_ceil(min_hold) + 1;
    let returns = st.transitions / 2;
    assert!(returns >= 3, "the cache came back {returns} times: not flapping enough to tell");
    assert!(returns <= bound, "{returns} returns to local in {lasted} ms: more than {bound}");
    assert_eq!(st.repairs, 0);
    assert_eq!(node.fake.kernel().applies as u64, st.transitions + 1, "one apply per transition");
}

/// A ruleset someone else removed is restored by the next tick's read-back, which runs on a
/// blocking thread while the paused clock waits for it.
#[tokio::test(start_paused = true)]
async fn a_removed_ruleset_is_restored_by_the_next_ticks_check() {
    let (node, world) = Node::new("repair");
    node.run(world, async {
        node.at(525).await;
        node.fake.kernel().installed = None;
        node.at(595).await;
        assert_eq!(node.installed(), None);
        node.at(605).await;
        assert_eq!(node.route().await, Route::Local);
        assert_eq!(node.state().await.repairs, 1);
    })
    .await;
}

/// `flip upstream --for 2s`, sent as the control socket would: the route is forced and the
/// override recorded at once; at its end, the next tick makes the route automatic again (back
/// to `Local`, the cache answering) and removes the record.
#[tokio::test(start_paused = true)]
async fn a_flip_for_a_while_ends_by_itself_and_its_record_goes() {
    let (node, world) = Node::new("flip");
    node.run(world, async {
        node.at(550).await;
        let flip = Request::Flip { route: Route::Upstream, for_ms: Some(2000), reason: "".into() };
        assert_eq!(node.ask(flip).await, Response::ok("route forced to upstream for 2s"));
        assert_eq!(node.route().await, Route::Upstream);
        assert!(node.recorded());
        // Forced: the cache's good probes do not bring `Local` back.
        node.at(2545).await;
        assert_eq!(node.route().await, Route::Upstream);
        assert!(node.recorded());
        // It ends at 2.55 s; the tick at 2.6 s sees it.
        node.at(2595).await;
        assert_eq!(node.route().await, Route::Upstream);
        node.at(2605).await;
        assert_eq!(node.route().await, Route::Local);
        assert!(!node.recorded(), "the record of an override no longer in force is removed");
        assert_eq!(node.state().await.transitions, 2);
    })
    .await;
}

/// How many ticks in a row the reply counters must stand still for a drain to answer
/// (`maintenance::QUIET_CHECKS`).
const QUIET_TICKS: u64 = 3;

/// A drain through the loop: the route is forced to `Upstream` at once and recorded; the answer
/// comes once the fake kernel's reply counter has stood still for three ticks. The drained
/// cache's exit (a refused probe) ends the drain, and the new cache earns `Local` back with
/// `rise` and `min-hold`.
#[tokio::test(start_paused = true)]
async fn a_drain_forces_upstream_and_answers_once_the_replies_stand_still() {
    let (node, world) = Node::new("drain");
    node.fake.kernel().replies = Some(0);
    node.run(world, async {
        node.at(550).await;
        let mut answer = node.send(Request::Drain { timeout_ms: 5000 }).await;
        assert_eq!(node.route().await, Route::Upstream);
        assert!(node.recorded());
        assert!(node.state().await.reason.contains("draining"));
        // Pods' queries still reach the cache until 1.525 s.
        for at in (625..=1525).step_by(100) {
            node.at(at).await;
            *node.fake.kernel().replies.as_mut().unwrap() += 10;
            assert!(answer.try_recv().is_err(), "answered at {at} ms while the cache answers");
        }
        // Counted changed at the tick at 1.6 s, unchanged at 1.7, 1.8 and 1.9 s.
        let response = answer.await.expect("the drain answers");
        assert_eq!(node.elapsed(), Duration::from_millis(1600 + QUIET_TICKS * 100));
        assert!(message(&response).contains("gone quiet"), "{response:?}");
        assert!(matches!(response, Response::Ok { .. }), "{response:?}");
        // Still forced after the answer, until the drained cache is gone.
        node.at(2045).await;
        assert_eq!(node.route().await, Route::Upstream);
        assert!(node.recorded());
        node.cache(Server::Dead);
        node.at(2105).await;
        assert!(!node.recorded(), "the drain ended with the cache's exit");
        assert_eq!(node.route().await, Route::Upstream);
        // The new cache from 2.55 s: `rise` by 3.0 s, `min-hold` from the exit, to 4.1 s.
        node.at(2550).await;
        node.cache(Server::Alive);
        node.at(4095).await;
        assert_eq!(node.route().await, Route::Upstream);
        node.at(4105).await;
        assert_eq!(node.route().await, Route::Local);
    })
    .await;
}

/// A drain whose route an operator forces back to `Local` is answered at the next tick: it was
/// interrupted.
#[tokio::test(start_paused = true)]
async fn a_drain_is_interrupted_when_the_route_is_forced_local() {
    let (node, world) = Node::new("drain-interrupted");
    node.fake.kernel().replies = Some(0);
    node.run(world, async {
        node.at(550).await;
        let mut answer = node.send(Request::Drain { timeout_ms: 5000 }).await;
        // Pods' queries still reach the cache.
        for at in (625..=1025).step_by(100) {
            node.at(at).await;
            *node.fake.kernel().replies.as_mut().unwrap() += 10;
        }
        assert_eq!(node.route().await, Route::Upstream);
        assert!(answer.try_recv().is_err(), "answered while the cache answers");
        node.at(1050).await;
        let flip = Request::Flip { route: Route::Local, for_ms: None, reason: "test".into() };
        assert!(matches!(node.ask(flip).await, Response::Ok { .. }));
        assert_eq!(node.route().await, Route::Local);
        let response = answer.await.expect("the drain answers");
        assert_eq!(node.elapsed(), Duration::from_millis(1100), "at the next tick");
        assert!(message(&response).contains("drain interrupted"), "{response:?}");
        assert!(matches!(response, Response::Error { .. }), "{response:?}");
    })
    .await;
}

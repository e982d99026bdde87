//! The daemon's loop, run whole.

use std::time::Duration;

use super::*;
use crate::config::{test_raw, RawRun};
use crate::dataplane::fake::FakeDataplane;
use crate::ruleset::Route;

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

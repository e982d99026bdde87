//! The daemon's tasks, each under a name, supervised: the first one to end is named in the
//! agent's exit.

use super::AgentError;

/// The agent's probe and watch tasks, each under a name. Every one of them runs forever: one
/// that ends has panicked (or returned by mistake), and the agent can no longer see what it
/// should.
#[derive(Default)]
pub(super) struct Tasks {
    set: tokio::task::JoinSet<()>,
    names: std::collections::HashMap<tokio::task::Id, &'static str>,
}

impl Tasks {
    pub(super) fn spawn(
        &mut self,
        name: &'static str,
        task: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        let id = self.set.spawn(task).id();
        self.names.insert(id, name);
    }

    /// The first task to end, named and with how it ended; pending while every one runs.
    pub(super) async fn died(&mut self) -> AgentError {
        let (id, how) = loop {
            match self.set.join_next_with_id().await {
                Some(Ok((id, ()))) => break (id, "ended".to_owned()),
                Some(Err(e)) if e.is_panic() => {
                    let id = e.id();
                    let payload = e.into_panic();
                    let message = payload
                        .downcast_ref::<&str>()
                        .copied()
                        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
                        .unwrap_or("no message");
                    break (id, format!("panicked: {message}"));
                }
                // Cancelled: only at shutdown, by us.
                Some(Err(_)) => {}
                None => std::future::pending().await,
            }
        };
        AgentError::TaskDied { task: self.names.get(&id).copied().unwrap_or("unnamed"), how }
    }

    pub(super) async fn shutdown(&mut self) {
        self.set.shutdown().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Every task of the agent runs forever: the first one to end, by returning or panicking,
    /// is named in the error `run` exits with (exit code 1), however many others still run.
    #[tokio::test]
    async fn a_task_that_ends_or_panics_is_named_in_the_agents_exit() {
        let patience = Duration::from_secs(10);
        let mut tasks = Tasks::default();
        tasks.spawn("steady watch", std::future::pending());
        tasks.spawn("cache UDP probe", async { panic!("a bug") });
        let died = tokio::time::timeout(patience, tasks.died()).await.expect("the panic seen");
        assert_eq!(
            died.to_string(),
            "the cache UDP probe task panicked: a bug; exiting with the current ruleset left in place"
        );
        tasks.spawn("control socket", async {});
        let died = tokio::time::timeout(patience, tasks.died()).await.expect("the return seen");
        assert!(
            matches!(died, AgentError::TaskDied { task: "control socket", ref how } if how == "ended")
        );
        // The steady one never counts as dead.
        let quiet = tokio::time::timeout(Duration::ZERO, tasks.died()).await;
        assert!(quiet.is_err(), "{:?}", quiet.map(|e| e.to_string()));
    }
}

//! Child processes a test starts, never outliving it.

use std::process::{Child, Command};

/// A child process, killed (by pid) and reaped on drop.
pub struct Proc(Option<Child>);

impl Proc {
    /// Takes over a child spawned by the kit.
    pub(crate) fn adopt(child: Child) -> Proc {
        Proc(Some(child))
    }

    /// Spawns `cmd`, panicking with it if it cannot start.
    pub fn spawn(cmd: &mut Command) -> Proc {
        Proc(Some(cmd.spawn().unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"))))
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.0.as_ref().expect("running").id()
    }

    /// Waits for it to exit.
    pub fn wait(mut self) -> std::process::ExitStatus {
        self.0.take().expect("running").wait().expect("wait")
    }

    /// The child, no longer killed on drop (to hand it to an [`Agent`](crate::Agent), say).
    pub fn into_child(mut self) -> Child {
        self.0.take().expect("running")
    }

    /// Its exit status, if it has exited (reaped then); `None` while it runs.
    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.0.as_mut().expect("started").try_wait().expect("try_wait")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

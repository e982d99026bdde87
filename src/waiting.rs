//! The connections of a server that have not said what they want yet, oldest first. The control
//! socket must stay reachable (an operator's `flip`), so when it is full it closes the oldest of
//! these to make room: clients that connect and say nothing cannot lock the others out. (The
//! metrics endpoint, open to every pod, shares its places by client address instead:
//! `metrics/http/places.rs`.)

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

/// The waiting connections, oldest first.
#[derive(Default)]
pub(crate) struct Waiting(VecDeque<Slot>);

/// One connection's place in [`Waiting`]; its task holds the other end, a [`Reading`].
struct Slot {
    waiting: Arc<AtomicBool>,
    evict: Arc<Notify>,
}

/// Held by a connection's task while it reads its request: dropping it leaves [`Waiting`].
pub(crate) struct Reading {
    waiting: Arc<AtomicBool>,
    evict: Arc<Notify>,
}

impl Reading {
    /// Completes when the connection is to be closed to make room (also when that was decided
    /// before this is first polled).
    pub(crate) async fn evicted(&self) {
        self.evict.notified().await;
    }
}

impl Drop for Reading {
    fn drop(&mut self) {
        self.waiting.store(false, Ordering::Relaxed);
    }
}

impl Waiting {
    /// How many connections still wait for their request.
    pub(crate) fn len(&mut self) -> usize {
        self.0.retain(|slot| slot.waiting.load(Ordering::Relaxed));
        self.0.len()
    }

    /// Tells the oldest waiting connection to close; false when none waits.
    pub(crate) fn evict_oldest(&mut self) -> bool {
        self.len();
        let Some(oldest) = self.0.pop_front() else { return false };
        oldest.evict.notify_one();
        true
    }

    /// A new connection's place, the newest.
    pub(crate) fn join(&mut self) -> Reading {
        let slot =
            Slot { waiting: Arc::new(AtomicBool::new(true)), evict: Arc::new(Notify::new()) };
        let reading = Reading { waiting: slot.waiting.clone(), evict: slot.evict.clone() };
        self.0.push_back(slot);
        reading
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_oldest_still_waiting_is_evicted_and_those_done_are_forgotten() {
        let mut waiting = Waiting::default();
        let first = waiting.join();
        let second = waiting.join();
        let third = waiting.join();
        assert_eq!(waiting.len(), 3);
        drop(first); // It read its request.
        assert_eq!(waiting.len(), 2);
        assert!(waiting.evict_oldest());
        // Told before it listens: the notice waits for it.
        second.evicted().await;
        assert_eq!(waiting.len(), 1);
        drop(third);
        assert!(!waiting.evict_oldest());
    }
}

//! The timeline: one line per interval, for the lookups started in it, printed once they all
//! ended (so a line's counts are final), with the route the agent's state file names.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::Duration;

use crate::counts::{percentile, sorted, Counts, Origins};
use crate::lookup::LookupResult;

pub(crate) struct Bucket {
    pub(crate) started: u64,
    pub(crate) finished: u64,
    pub(crate) counts: Counts,
    /// The route when the interval ended (None while it is open).
    pub(crate) route: Option<String>,
}

pub(crate) struct Timeline {
    pub(crate) interval: Duration,
    pub(crate) route_file: Option<PathBuf>,
    /// Buckets not printed yet; `buckets[0]` is interval number `first`.
    pub(crate) buckets: VecDeque<Bucket>,
    pub(crate) first: usize,
}

impl Timeline {
    pub(crate) fn index_of(&self, at: Duration) -> usize {
        (at.as_nanos() / self.interval.as_nanos()) as usize
    }

    pub(crate) fn bucket(&mut self, index: usize, origins: &Origins) -> &mut Bucket {
        // A lookup whose task failed is reported with start 0; count it in the oldest open
        // interval rather than index before the start of the deque.
        let index = index.max(self.first);
        while self.first + self.buckets.len() <= index {
            self.buckets.push_back(Bucket {
                started: 0,
                finished: 0,
                counts: Counts::new(origins),
                route: None,
            });
        }
        &mut self.buckets[index - self.first]
    }

    pub(crate) fn started(&mut self, at: Duration, origins: &Origins) {
        let index = self.index_of(at);
        self.bucket(index, origins).started += 1;
    }

    pub(crate) fn finished(&mut self, origins: &Origins, r: &LookupResult) {
        let index = self.index_of(r.started);
        let bucket = self.bucket(index, origins);
        bucket.finished += 1;
        bucket.counts.add(origins, r);
    }

    /// Closes the intervals that ended before `now` (all of them if `all`), noting the route.
    pub(crate) fn close(&mut self, now: Duration, all: bool, origins: &Origins) {
        let open_from = if all { self.first + self.buckets.len() } else { self.index_of(now) };
        if open_from > self.first {
            self.bucket(open_from - 1, origins); // intervals without lookups get a line too
        }
        let mut route = None;
        for (i, b) in self.buckets.iter_mut().enumerate() {
            if self.first + i < open_from && b.route.is_none() {
                b.route = Some(route.get_or_insert_with(|| read_route(&self.route_file)).clone());
            }
        }
    }

    /// Prints the closed intervals whose lookups have all finished (all closed ones if `force`).
    pub(crate) fn flush(&mut self, force: bool, end: Duration, origins: &Origins) {
        while let Some(b) = self.buckets.front() {
            if b.route.is_none() || (!force && b.finished < b.started) {
                break;
            }
            let b = self.buckets.pop_front().expect("front exists");
            let t = self.interval * (self.first as u32 + 1);
            self.first += 1;
            print_line(t.min(end), &b, self.route_file.is_some(), origins);
        }
    }
}

pub(crate) fn print_line(t: Duration, b: &Bucket, show_route: bool, origins: &Origins) {
    let mut line = format!("t={:6.2}s", t.as_secs_f64());
    if show_route {
        line += &format!(" route={:<7}", b.route.as_deref().unwrap_or("?"));
    }
    for (label, n) in origins.labels.iter().zip(&b.counts.by_origin) {
        line += &format!(" {label}={n}");
    }
    let unfinished = b.started - b.finished;
    line += &format!(
        " failed={} first_attempt_lost={}",
        b.counts.failed + unfinished,
        b.counts.first_attempt_lost
    );
    match b.counts.latencies_ms.is_empty() {
        true => line += " p99_ms=-",
        false => {
            let p99 = percentile(&sorted(&b.counts.latencies_ms), 99.0);
            line += &format!(" p99_ms={p99:.1}");
        }
    }
    println!("{line}");
}

/// The "route" field of the route file, or "?" if it cannot be read right now.
pub(crate) fn read_route(path: &Option<PathBuf>) -> String {
    let Some(path) = path else {
        return String::new();
    };
    std::fs::read_to_string(path)
        .ok()
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .and_then(|v| v.get("route")?.as_str().map(str::to_string))
        .unwrap_or_else(|| "?".to_string())
}

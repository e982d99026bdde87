//! Counting lookups: by who answered them (the address in the answer), failures, first attempts
//! lost, latencies; the run's totals and its `SUMMARY` JSON.

use std::collections::HashMap;
use std::net::IpAddr;

use serde_json::json;

use crate::args::Origin;
use crate::lookup::{AttemptError, LookupResult};

/// How many failure/loss start times the summary lists at most.
pub(crate) const MAX_LISTED: usize = 1000;

/// Maps answer addresses to origin labels; the last index is "other".
pub(crate) struct Origins {
    pub(crate) labels: Vec<String>,
    pub(crate) by_addr: HashMap<IpAddr, usize>,
}

impl Origins {
    pub(crate) fn new(origins: &[Origin]) -> Self {
        let mut labels: Vec<String> = Vec::new();
        let mut by_addr = HashMap::new();
        for o in origins {
            let index = match labels.iter().position(|l| *l == o.label) {
                Some(i) => i,
                None => {
                    labels.push(o.label.clone());
                    labels.len() - 1
                }
            };
            by_addr.insert(o.addr, index);
        }
        labels.push("other".to_string());
        Origins { labels, by_addr }
    }

    pub(crate) fn index(&self, addr: IpAddr) -> usize {
        self.by_addr.get(&addr).copied().unwrap_or(self.labels.len() - 1)
    }
}

/// Counts over a set of lookups (one timeline interval, or the whole run).
#[derive(Default)]
pub(crate) struct Counts {
    pub(crate) by_origin: Vec<u64>,
    pub(crate) failed: u64,
    pub(crate) first_attempt_lost: u64,
    /// Latencies of successful lookups, in ms.
    pub(crate) latencies_ms: Vec<f64>,
}

impl Counts {
    pub(crate) fn new(origins: &Origins) -> Self {
        Counts { by_origin: vec![0; origins.labels.len()], ..Counts::default() }
    }

    pub(crate) fn add(&mut self, origins: &Origins, r: &LookupResult) {
        match r.answer {
            Some(addr) => {
                self.by_origin[origins.index(addr)] += 1;
                self.latencies_ms.push(r.latency.as_secs_f64() * 1000.0);
            }
            None => self.failed += 1,
        }
        if r.first_attempt_lost() {
            self.first_attempt_lost += 1;
        }
    }
}

/// Nearest-rank percentile of sorted values (0 if empty).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

pub(crate) fn sorted(values: &[f64]) -> Vec<f64> {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v
}

/// The whole run.
pub(crate) struct Totals {
    pub(crate) sent: u64,
    pub(crate) skipped: u64,
    pub(crate) unfinished: u64,
    pub(crate) counts: Counts,
    pub(crate) attempt_errors: HashMap<&'static str, u64>,
    pub(crate) failures_at_ms: Vec<u64>,
    pub(crate) first_attempt_lost_at_ms: Vec<u64>,
}

impl Totals {
    pub(crate) fn add(&mut self, origins: &Origins, r: &LookupResult) {
        self.counts.add(origins, r);
        for e in &r.errors {
            let key = match e {
                AttemptError::Timeout => "timeout_attempts",
                AttemptError::Refused => "refused_attempts",
                AttemptError::ServFail => "servfail_attempts",
                AttemptError::BadReply => "bad_reply_attempts",
                AttemptError::Io => "io_error_attempts",
            };
            *self.attempt_errors.entry(key).or_default() += 1;
        }
        let at_ms = r.started.as_millis() as u64;
        if r.answer.is_none() && self.failures_at_ms.len() < MAX_LISTED {
            self.failures_at_ms.push(at_ms);
        }
        if r.first_attempt_lost() && self.first_attempt_lost_at_ms.len() < MAX_LISTED {
            self.first_attempt_lost_at_ms.push(at_ms);
        }
    }

    pub(crate) fn summary(&mut self, origins: &Origins) -> serde_json::Value {
        let by_origin: serde_json::Map<String, serde_json::Value> = origins
            .labels
            .iter()
            .zip(&self.counts.by_origin)
            .map(|(label, n)| (label.clone(), json!(n)))
            .collect();
        let latencies = sorted(&self.counts.latencies_ms);
        self.failures_at_ms.sort_unstable();
        self.first_attempt_lost_at_ms.sort_unstable();
        let errors = |key| self.attempt_errors.get(key).copied().unwrap_or(0);
        json!({
            "sent": self.sent,
            "ok": self.counts.by_origin.iter().sum::<u64>(),
            "failed": self.counts.failed,
            "first_attempt_lost": self.counts.first_attempt_lost,
            "by_origin": by_origin,
            "refused_attempts": errors("refused_attempts"),
            "timeout_attempts": errors("timeout_attempts"),
            "servfail_attempts": errors("servfail_attempts"),
            "bad_reply_attempts": errors("bad_reply_attempts"),
            "io_error_attempts": errors("io_error_attempts"),
            "skipped": self.skipped,
            "unfinished": self.unfinished,
            "latency_ms": {
                "p50": round2(percentile(&latencies, 50.0)),
                "p99": round2(percentile(&latencies, 99.0)),
                "max": round2(latencies.last().copied().unwrap_or(0.0)),
            },
            "failures_at_ms": self.failures_at_ms,
            "first_attempt_lost_at_ms": self.first_attempt_lost_at_ms,
        })
    }
}

pub(crate) fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let v = sorted(&(1..=100).map(f64::from).collect::<Vec<_>>());
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&[], 99.0), 0.0);
    }
}

//! The control loop's judge of the cache's probes, for the quiet pace
//! ([`crate::pace::Pace::calm`]).

use std::time::Duration;

use super::Report;
use crate::health::Stream;

/// The control loop's judge of the cache's probes, for
/// [`Pace::calm`](crate::pace::Pace::calm): its last `rise` UDP probes good and quick (answered
/// within half their timeout: a cache that slows down is probed at the fast pace before it
/// fails), its last TCP probe good. A stall counts as a failed UDP probe.
#[derive(Debug)]
pub struct CacheProbes {
    rise: u32,
    quick_within: Duration,
    /// Consecutive good and quick UDP probes.
    quick: u32,
    tcp_failed: bool,
}

impl CacheProbes {
    /// Nothing heard yet: not calm.
    pub fn new(rise: u32, timeout: Duration) -> CacheProbes {
        CacheProbes { rise, quick_within: timeout / 2, quick: 0, tcp_failed: false }
    }

    /// Takes a probe's report (the upstream's are not the cache's).
    pub fn observe(&mut self, report: &Report) {
        let good = report.result.outcome.is_good();
        match report.stream {
            Stream::CacheUdp if good && report.result.latency <= self.quick_within => {
                self.quick = self.quick.saturating_add(1);
            }
            Stream::CacheUdp => self.quick = 0,
            Stream::CacheTcp => self.tcp_failed = !good,
            Stream::Upstream => {}
        }
    }

    /// Whether the cache's probes ask for nothing faster.
    pub fn calm(&self) -> bool {
        self.quick >= self.rise && !self.tcp_failed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe::{Outcome, ProbeResult};

    fn report(stream: Stream, outcome: Outcome, ms: u64) -> Report {
        Report { stream, result: ProbeResult { outcome, latency: Duration::from_millis(ms) } }
    }

    #[test]
    fn the_cache_is_calm_after_rise_good_and_quick_probes() {
        let answered = || Outcome::Answered { rcode: hickory_proto::op::ResponseCode::NoError };
        let mut probes = CacheProbes::new(3, Duration::from_millis(80));
        for _ in 0..2 {
            probes.observe(&report(Stream::CacheUdp, answered(), 1));
        }
        assert!(!probes.calm(), "two of three");
        probes.observe(&report(Stream::CacheUdp, answered(), 1));
        assert!(probes.calm());
        probes.observe(&report(Stream::Upstream, Outcome::Timeout, 500));
        assert!(probes.calm(), "the upstream's probes are not the cache's");
        probes.observe(&report(Stream::CacheUdp, answered(), 41));
        assert!(!probes.calm(), "answered, but slow: the fast pace");
        for _ in 0..3 {
            probes.observe(&report(Stream::CacheUdp, answered(), 40));
        }
        assert!(probes.calm(), "within half the timeout");
        probes.observe(&report(Stream::CacheTcp, Outcome::Timeout, 80));
        assert!(!probes.calm(), "the TCP probe failed");
        probes.observe(&report(Stream::CacheTcp, answered(), 2));
        assert!(probes.calm());
        let stall = Outcome::Stalled { queued_bytes: 90, for_ms: 30 };
        probes.observe(&report(Stream::CacheUdp, stall, 30));
        assert!(!probes.calm(), "a stall");
    }
}

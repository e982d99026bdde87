//! The run: lookups started at a steady rate as independent tasks, at most so many in flight,
//! counted as they end; a signal stops the starting and drains what is in flight.

use std::collections::{HashMap, VecDeque};
use std::io::{BufWriter, Write};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::json;
use tokio::signal::unix::{signal, SignalKind};
use tokio::task::{Id, JoinSet};
use tokio::time::{interval_at, Instant, MissedTickBehavior};

use crate::args::Args;
use crate::counts::{Counts, Origins, Totals};
use crate::lookup::{lookup, LookupResult, LookupSpec, SYSTEM_LOOKUP_BUDGET};
use crate::timeline::Timeline;

pub async fn run(args: Args) -> std::io::Result<serde_json::Value> {
    let origins = Origins::new(&args.origins);
    let spec = LookupSpec {
        server: args.server,
        qtype: args.qtype,
        timeout: args.timeout,
        attempts: args.attempts,
        tcp: args.tcp,
        both_families: args.both_families,
    };
    let lookup_budget = match spec.server {
        Some(_) => args.timeout * args.attempts,
        None => SYSTEM_LOOKUP_BUDGET,
    };
    let mut lookups_out = match &args.lookups_out {
        Some(path) => Some(BufWriter::new(std::fs::File::create(path)?)),
        None => None,
    };
    let planned = (f64::from(args.rate) * args.duration.as_secs_f64()).round() as u64;
    let max_in_flight = args.max_in_flight.map_or_else(
        || (f64::from(args.rate) * lookup_budget.as_secs_f64()).ceil() as usize + 100,
        |n| n as usize,
    );

    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;

    let mut totals = Totals {
        sent: 0,
        skipped: 0,
        unfinished: 0,
        counts: Counts::new(&origins),
        attempt_errors: HashMap::new(),
        failures_at_ms: Vec::new(),
        first_attempt_lost_at_ms: Vec::new(),
    };
    let mut timeline = (!args.report_interval.is_zero()).then(|| Timeline {
        interval: args.report_interval,
        route_file: args.route_file.clone(),
        buckets: VecDeque::new(),
        first: 0,
    });

    let start = Instant::now();
    let start_unix_ms =
        SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let mut send_tick = interval_at(start, Duration::from_secs(1) / args.rate);
    send_tick.set_missed_tick_behavior(MissedTickBehavior::Burst);
    let report_every = args.report_interval.max(Duration::from_millis(1));
    let mut report_tick = interval_at(start + report_every, report_every);
    report_tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let drain = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(drain);

    let mut tasks = JoinSet::new();
    let mut in_flight: HashMap<Id, Duration> = HashMap::new();
    let mut sending = planned > 0;
    // Where the last timeline interval ends: the planned duration, or when a signal came.
    let mut end = args.duration;

    loop {
        let mut stop = false;
        let mut signalled = false;
        tokio::select! {
            _ = send_tick.tick(), if sending => {
                // When the lookup really starts (not when it was scheduled): it lines up with
                // other processes' events, and it never falls into an interval already closed.
                let at = start.elapsed();
                if tasks.len() < max_in_flight {
                    let handle = tasks.spawn(lookup(spec, args.name.clone(), at));
                    in_flight.insert(handle.id(), at);
                    totals.sent += 1;
                    if let Some(tl) = timeline.as_mut() {
                        tl.started(at, &origins);
                    }
                } else {
                    totals.skipped += 1;
                }
                stop = totals.sent + totals.skipped >= planned;
            }
            _ = report_tick.tick(), if timeline.is_some() && sending => {
                if let Some(tl) = timeline.as_mut() {
                    tl.close(start.elapsed(), false, &origins);
                    tl.flush(false, end, &origins);
                }
            }
            Some(joined) = tasks.join_next_with_id() => {
                let (id, result) = match joined {
                    Ok((id, result)) => (id, result),
                    // A lookup task cannot panic short of a bug; count it as a failure.
                    Err(e) => {
                        let started = in_flight.get(&e.id()).copied().unwrap_or_default();
                        (e.id(), LookupResult::lost(started))
                    }
                };
                in_flight.remove(&id);
                if let Some(out) = lookups_out.as_mut() {
                    write_lookup(out, &origins, &result)?;
                }
                totals.add(&origins, &result);
                if let Some(tl) = timeline.as_mut() {
                    tl.finished(&origins, &result);
                    tl.flush(false, end, &origins);
                }
            }
            _ = sigint.recv() => signalled = true,
            _ = sigterm.recv() => signalled = true,
            () = &mut drain, if !sending => break,
        }
        if signalled {
            if !sending {
                break; // a second signal: report now
            }
            end = start.elapsed().min(end);
        }
        if stop || signalled {
            sending = false;
            // Each lookup ends within its attempts' timeouts; the deadline is a safety net.
            drain.as_mut().reset(Instant::now() + lookup_budget + Duration::from_millis(500));
            if let Some(tl) = timeline.as_mut() {
                tl.close(end, true, &origins);
            }
        }
        if !sending && tasks.is_empty() {
            break;
        }
    }

    tasks.abort_all();
    for (_, started) in in_flight.drain() {
        totals.unfinished += 1;
        let lost = LookupResult::lost(started);
        if let Some(out) = lookups_out.as_mut() {
            write_lookup(out, &origins, &lost)?;
        }
        totals.add(&origins, &lost);
    }
    if let Some(mut out) = lookups_out.take() {
        out.flush()?;
    }
    if let Some(tl) = timeline.as_mut() {
        tl.close(end, true, &origins);
        tl.flush(true, end, &origins);
    }
    let mut summary = totals.summary(&origins);
    // The wall-clock start, so that `*_at_ms` can be lined up with other processes' events.
    summary["start_unix_ms"] = json!(start_unix_ms);
    Ok(summary)
}

/// One `--lookups-out` line: start ms, latency ms, origin label or "failed", failed attempts.
pub(crate) fn write_lookup(
    out: &mut impl Write,
    origins: &Origins,
    r: &LookupResult,
) -> std::io::Result<()> {
    let origin = match r.answer {
        Some(addr) => origins.labels[origins.index(addr)].as_str(),
        None => "failed",
    };
    writeln!(
        out,
        "{:.3} {:.3} {origin} {}",
        r.started.as_secs_f64() * 1000.0,
        r.latency.as_secs_f64() * 1000.0,
        r.errors.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::parse_origin;
    use crate::lookup::AttemptError;

    #[test]
    fn lookups_out_lines() {
        let o = Origins::new(&[parse_origin("1.1.1.1=cache").unwrap()]);
        let answered = LookupResult {
            started: Duration::from_micros(1500),
            answer: Some([1, 1, 1, 1].into()),
            errors: vec![AttemptError::Timeout],
            latency: Duration::from_millis(1000),
        };
        let mut out = Vec::new();
        write_lookup(&mut out, &o, &answered).unwrap();
        write_lookup(&mut out, &o, &LookupResult::lost(Duration::from_millis(2))).unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "1.500 1000.000 cache 1\n2.000 0.000 failed 0\n"
        );
    }
}

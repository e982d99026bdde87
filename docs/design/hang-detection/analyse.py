#!/usr/bin/env python3
"""Throwaway: replay 1 ms rqueue traces through candidate detectors.

Detector (slow S, fast f, bound B), in samples of the 1 ms trace:
  * slow mode: look every S ms; a sample with rqueue > 0 starts a window and fast mode.
  * fast mode: look every f ms; rqueue == 0 -> back to slow mode; rqueue lower than at the
    previous look -> the socket drained: a new window starts here; otherwise, once the window
    is >= B ms old -> FIRE (the queue held > 0 and never went down for B ms).
  * after a fire, nothing more until rqueue goes down (recovery), then slow mode.
  drops=True: also fire at once when SK_MEMINFO_DROPS grows (any mode's look).
usage: analyse.py OUTDIR
"""
import statistics, sys, os

def load(path):
    rows = []
    for line in open(path):
        t, rq, drops, found = line.split()
        rows.append((float(t), int(rq), int(drops)))
    return rows

def events(path):
    ev = []
    if os.path.exists(path):
        for line in open(path):
            k, t = line.split(); ev.append((k, float(t)))
    return ev

def detect(rows, S, f, B, drops=False):
    fires = []; i = 0; mode = "slow"; start = prev = None; last_drops = rows[0][2]
    n = len(rows); looks = 0
    while i < n:
        t, rq, dr = rows[i]; looks += 1
        if drops and dr > last_drops and mode != "fired":
            fires.append(t); mode = "fired"; prev = rq; last_drops = dr; i += f; continue
        last_drops = dr
        if mode == "slow":
            if rq > 0: mode, start, prev = "fast", t, rq; i += f
            else: i += S
        elif mode == "fast":
            if rq == 0: mode = "slow"; i += S; continue
            if rq < prev: start = t
            elif t - start >= B: fires.append(t); mode = "fired"
            prev = rq; i += f
        else:  # fired: wait for the queue to go down
            if rq < prev or rq == 0: mode = "slow" if rq == 0 else "fast"; start = t
            prev = rq; i += f
    return fires, looks

def pct(xs, p):
    xs = sorted(xs); return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]

def main():
    out = sys.argv[1]
    names = sorted({f.rsplit(".", 1)[0] for f in os.listdir(out) if f.endswith(".trace")})
    traces = {n: load(f"{out}/{n}.trace") for n in names}
    for n, rows in traces.items():
        rqs = [r[1] for r in rows]; dur = (rows[-1][0] - rows[0][0]) / 1e3
        gaps = [b[0] - a[0] for a, b in zip(rows, rows[1:])]
        print(f"# {n}: {len(rows)} samples over {dur:.1f} s, rqueue>0 in {100*sum(r>0 for r in rqs)/len(rqs):.2f}% of samples, "
              f"max rqueue {max(rqs)} B, drops {rows[-1][2]-rows[0][2]}, sample gap p50 {pct(gaps,50):.2f} p99 {pct(gaps,99):.2f} max {max(gaps):.1f} ms")
    configs = [(1,1,B) for B in (10,15,20,25,30,40,50)] + [(2,2,B) for B in (20,30,40)] + \
              [(5,5,30),(10,2,30),(20,2,30),(50,2,30),(10,5,30),(20,5,30),(50,5,30),(20,2,20),(10,2,20),(100,2,30)]
    print("\n| S ms | f ms | B ms | " + " | ".join(
        f"{n}: {'latency p50/p90/max (ms), missed' if n.startswith('hang') else 'fires, looks/s'}" for n in names) + " |")
    print("|" + "---|" * (3 + len(names)))
    for S, f, B in configs:
        cells = []
        for n, rows in traces.items():
            fires, looks = detect(rows, S, f, B)
            dur = (rows[-1][0] - rows[0][0]) / 1e3
            if n.startswith("hang"):
                stops = [t for k, t in events(f"{out}/{n}.events") if k == "stop"]
                lat, missed = [], 0
                for s in stops:
                    d = [x - s for x in fires if s <= x <= s + 400]
                    if d: lat.append(d[0])
                    else: missed += 1
                fp = sum(1 for x in fires if not any(s <= x <= s + 450 for s in stops))
                cells.append(f"{statistics.median(lat):.0f}/{pct(lat,90):.0f}/{max(lat):.0f}, {missed} of {len(stops)}, fp {fp}" if lat else f"-, {missed} of {len(stops)}")
            else:
                cells.append(f"{len(fires)}, {looks/dur:.0f}")
        print(f"| {S} | {f} | {B} | " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()

def phase_sweep(out, configs):
    """Hang latency over every phase of the slow sampler against each SIGSTOP (the run's stops
    come every 1000 ms, so one sampler phase would lock onto them)."""
    rows = load(f"{out}/hang.trace")
    stops = [t for k, t in events(f"{out}/hang.events") if k == "stop"]
    print("\n| S ms | f ms | B ms | hang latency over all sampler phases: p50 / p90 / max (ms), n |")
    print("|---|---|---|---|")
    for S, f, B in configs:
        lat = []
        for s in stops:
            seg = [r for r in rows if s - 300 <= r[0] <= s + 400]
            for phase in range(S):
                fires, _ = detect(seg[phase:], S, f, B)
                d = [x - s for x in fires if x >= s]
                lat.append(d[0] if d else 999)
        print(f"| {S} | {f} | {B} | {pct(lat,50):.0f} / {pct(lat,90):.0f} / {max(lat):.0f}, {len(lat)} |")

if __name__ == "__main__" and len(sys.argv) > 2:
    phase_sweep(sys.argv[1], [(1,1,30),(2,2,30),(5,2,30),(10,2,30),(20,2,30),(50,2,30),(100,2,30),(10,2,20),(20,2,20),(50,2,20),(100,2,20)])

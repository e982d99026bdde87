#!/usr/bin/env bash
# Throwaway: run one traffic scenario against a simnode's cache while rqsample traces the cache's
# UDP socket at 169.254.20.10:53 every 1 ms. Output in $OUT/<name>.{trace,events,load}.
#   scenario.sh PREFIX NAME idle|healthy|saturate|hang|pulse SECONDS
set -u
P=$1 NAME=$2 KIND=$3 SECS=$4
OUT=${OUT:-/tmp/$P/out}; mkdir -p "$OUT"
REPO=$(cd "$(dirname "$0")/../../.." && pwd); BIN=/tmp/$P/rqsample
PID=$(SIMNODE_DIR=/tmp/$P "$REPO/testdata/simnode.sh" cache-pid "$P")
echo "who.test A" > /tmp/$P/q.txt
ip netns exec "$P-node" "$BIN" trace udp 169.254.20.10 53 1000 "$SECS" > "$OUT/$NAME.trace" 2> "$OUT/$NAME.cost" &
TRACER=$!
sleep 0.3
LOADPID=
case $KIND in
  healthy|hang|pulse)
    ip netns exec "$P-pod1" "$REPO/target/release/dnsload" --server 169.254.20.10 --rate 1000 \
      --duration "$((SECS-1))s" --report-interval 0 > "$OUT/$NAME.load" 2>&1 & LOADPID=$! ;;
  saturate)
    ip netns exec "$P-pod1" dnsperf -s 169.254.20.10 -d /tmp/$P/q.txt -c 4 -q 200 -l "$((SECS-1))" \
      > "$OUT/$NAME.load" 2>&1 & LOADPID=$! ;;
esac
sleep 0.5
: > "$OUT/$NAME.events"
case $KIND in
  hang)   # SIGSTOP 400 ms, SIGCONT, 600 ms healthy; repeated until the end
    python3 - "$PID" "$((SECS-2))" "$OUT/$NAME.events" <<'PY'
import os, sys, time, signal
pid, secs, out = int(sys.argv[1]), float(sys.argv[2]), open(sys.argv[3], "w")
end = time.time() + secs
while time.time() + 1.0 < end:
    t = time.time(); os.kill(pid, signal.SIGSTOP); out.write("stop %.3f\n" % (t * 1e3))
    time.sleep(0.4)
    t = time.time(); os.kill(pid, signal.SIGCONT); out.write("cont %.3f\n" % (t * 1e3))
    time.sleep(0.6)
PY
    ;;
  pulse)  # SIGSTOP 15 ms every 100 ms (a CPU-throttled cache)
    python3 - "$PID" "$((SECS-2))" "$OUT/$NAME.events" <<'PY'
import os, sys, time, signal
pid, secs, out = int(sys.argv[1]), float(sys.argv[2]), open(sys.argv[3], "w")
start = time.time(); n = 0
while True:
    nxt = start + n * 0.1
    if nxt + 0.1 > start + secs: break
    while time.time() < nxt: time.sleep(max(0, nxt - time.time()))
    t = time.time(); os.kill(pid, signal.SIGSTOP); out.write("stop %.3f\n" % (t * 1e3))
    time.sleep(0.015)
    t = time.time(); os.kill(pid, signal.SIGCONT); out.write("cont %.3f\n" % (t * 1e3))
    n += 1
PY
    ;;
esac
[ -n "$LOADPID" ] && wait "$LOADPID"
wait "$TRACER"
kill -CONT "$PID" 2>/dev/null
echo "$NAME done: $(wc -l < "$OUT/$NAME.trace") samples; $(cat "$OUT/$NAME.cost")"

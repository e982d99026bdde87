# shellcheck shell=bash
# simnode processes: starting, signalling and stopping the node's daemons (the cache, CoreDNS,
# the noise loops, the xtables lock holder).
#
# Each daemon is started in the foreground by `ip netns exec` (which execs it, so $! is the
# daemon's pid), recorded in $RUN_DIR/<svc>.pid. Signals go only to that recorded pid, and only
# while /proc/<pid>/comm still names the program we started.

svc_comm() {
    case $1 in
    cache | cache2) # node-cache with the real parts, else unbound
        if [[ "$(cat "$RUN_DIR/kube-proxy" 2>/dev/null)" == real-* ]]; then echo node-cache; else echo unbound; fi ;;
    coredns) # real CoreDNS with the real parts (real.sh), else the dnsmasq stand-in
        if [[ "$(cat "$RUN_DIR/kube-proxy" 2>/dev/null)" == real-* ]]; then echo coredns; else echo dnsmasq; fi ;;
    etcd | kube-apiserver | kube-proxy) echo "$1" ;;
    endpoint-churn) echo python3 ;; # real.sh's endpoint-churn.py
    cni-noise | kube-proxy-resync) echo bash ;; # and its command line names the loop
    xtables-lock) echo sleep ;;
    *) die "bad service $1" ;;
    esac
}

# pid_running PID: exists and is not a zombie; or is a zombie whose other threads are still
# exiting: a multithreaded process's leader turns zombie first, and its files (sockets) are
# closed by the last thread to go (CoreDNS, Go: a few ms after the leader; unbound has one).
pid_running() {
    local stat tasks
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) } # the fields after "pid (comm) "
    [[ "${stat%% *}" != [ZX] ]] && return 0
    tasks=("/proc/$1/task/"*)
    ((${#tasks[@]} > 1)) && [[ -e ${tasks[1]} ]]
}

# svc_pid SVC: print the recorded pid if that process is still running the program we started.
svc_pid() {
    local pidfile="$RUN_DIR/$1.pid" pid comm
    [[ -f "$pidfile" ]] || return 1
    pid=$(<"$pidfile")
    [[ "$pid" =~ ^[0-9]+$ ]] && pid_running "$pid" || return 1
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
    [[ "$comm" == "$(svc_comm "$1")" ]] || return 1
    case $1 in
    cni-noise | kube-proxy-resync)
        local cmdline
        cmdline=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null) || return 1
        [[ "$cmdline" == *" $SELF __loop $PREFIX $1 " ]] || return 1
        ;;
    esac
    echo "$pid"
}

svc_start() { # svc_start SVC ROLE CMD...
    local svc=$1 role=$2
    shift 2
    if svc_pid "$svc" >/dev/null; then die "$svc already running (pid $(svc_pid "$svc"))"; fi
    # A simple command (not the in_ns function), so that the background job execs ip, which
    # execs the daemon: $! is then the daemon's pid.
    ip netns exec "$(ns_name "$role")" "$@" </dev/null >>"$RUN_DIR/$svc.log" 2>&1 &
    local pid=$!
    echo "$pid" >"$RUN_DIR/$svc.pid"
    # Until the daemon has been exec'd, /proc/<pid>/comm names bash or ip.
    local deadline=$(($(now_ms) + 5000))
    until svc_pid "$svc" >/dev/null; do
        if ! pid_running "$pid" || (($(now_ms) > deadline)); then
            tail -n 5 "$RUN_DIR/$svc.log" >&2
            die "$svc failed to start (log: $RUN_DIR/$svc.log)"
        fi
        sleep 0.01
    done
}

svc_gone() { ! svc_pid "$1" >/dev/null; }

svc_kill() {
    local pid
    if pid=$(svc_pid "$1"); then
        kill -CONT "$pid" 2>/dev/null || true
        local at
        at=$(now_ms)
        kill -KILL "$pid" 2>/dev/null || true
        echo "$at" # when the signal went out (ms since the epoch), for tests to line events up
        wait_for 5 "$1 (pid $pid) to exit" svc_gone "$1"
        now_ms # when it was seen gone (its sockets closed): at most one poll late
    fi
    rm -f "$RUN_DIR/$1.pid"
}

svc_signal() { # svc_signal SVC SIG
    local pid
    pid=$(svc_pid "$1") || die "$1 is not running"
    local at
    at=$(now_ms)
    kill "-$2" "$pid"
    echo "$at" # when the signal went out (ms since the epoch)
}

# svc_term SVC: SIGTERM (a noise loop then stops its running command and exits), SIGKILL if it
# is still there after 5 s.
svc_term() {
    local pid deadline
    if pid=$(svc_pid "$1"); then
        kill -TERM "$pid" 2>/dev/null || true
        deadline=$(($(now_ms) + 5000))
        while ! svc_gone "$1" && (($(now_ms) < deadline)); do sleep 0.01; done
        if ! svc_gone "$1"; then kill -KILL "$pid" 2>/dev/null || true; fi
        wait_for 5 "$1 (pid $pid) to exit" svc_gone "$1"
    fi
    rm -f "$RUN_DIR/$1.pid" "$RUN_DIR/$1.ready"
}

# shellcheck shell=bash
# simnode noise: the node's other programs that write the tables the agent's backends share,
# to test that the agent lives with them: a CNI plugin keeping its rule first, kube-proxy's
# periodic resync, and a holder of the xtables lock.
#
# The loops are simnode.sh run again (`bash SELF __loop PREFIX SVC`) in the node namespace.
# Each command runs as a background child so that SIGTERM stops the loop at once (the trap kills
# the child); the loop writes its pid to $RUN_DIR/<svc>.ready after its first round, if that
# round succeeded (else it exits 1), and its counts to $RUN_DIR/<svc>.rounds after every round.

LOOP_CHILD=""
loop_exit() {
    if [[ -n "$LOOP_CHILD" ]]; then
        kill -TERM "$LOOP_CHILD" 2>/dev/null || true
        wait "$LOOP_CHILD" 2>/dev/null || true
    fi
    echo "$(now_ms) stopped"
    exit 0
}
loop_run() { # loop_run CMD...: run CMD as a child the TERM trap can stop; its exit status
    "$@" &
    LOOP_CHILD=$!
    local rc=0
    wait "$LOOP_CHILD" || rc=$?
    LOOP_CHILD=""
    return "$rc"
}
loop_log() { echo "$(now_ms) $*"; }

# One round of the CNI plugin: its rule first in raw PREROUTING, and there once. Fails when a
# command failed; sets ROUND_IN_FRONT=0 unless the rule was already first in every family.
cni_noise_round() {
    local ipt out="$RUN_DIR/cni-noise.out" restore="$RUN_DIR/cni-noise.restore" want line rc=0
    local -a rules
    want="-A PREROUTING -m comment --comment cali:fake -j ACCEPT"
    ROUND_IN_FRONT=1
    for ipt in $(ipt_families); do
        if ! loop_run "$ipt" -w 5 -t raw -S PREROUTING >"$out"; then
            loop_log "$ipt -S failed"
            rc=1
            ROUND_IN_FRONT=0
            continue
        fi
        rules=()
        while IFS= read -r line; do
            line=${line//\"/} # iptables -S quotes comments (1.8.9 always, older ones if needed)
            [[ "$line" == "-A PREROUTING "* ]] && rules+=("$line")
        done <"$out"
        local n=0 r
        for r in "${rules[@]}"; do [[ "$r" != "$want" ]] || n=$((n + 1)); done
        if ((n == 1)) && [[ "${rules[0]}" == "$want" ]]; then continue; fi
        ROUND_IN_FRONT=0
        {
            echo "*raw"
            for ((r = 0; r < n; r++)); do echo "-D PREROUTING -m comment --comment cali:fake -j ACCEPT"; done
            echo "-I PREROUTING 1 -m comment --comment cali:fake -j ACCEPT"
            echo COMMIT
        } >"$restore"
        if loop_run "$ipt-restore" -w 5 --noflush "$restore"; then
            loop_log "$ipt: cali:fake put first (had $n, first rule was: ${rules[0]:-none})"
        else
            loop_log "$ipt-restore failed"
            rc=1
        fi
    done
    return "$rc"
}

# One round of kube-proxy's periodic sync.
KUBE_PROXY_ROUND=1
kube_proxy_resync_round() {
    local ipt v fam chain ok=1
    if [[ "$KUBE_PROXY" == nftables ]]; then
        for fam in ip ip6; do
            [[ -f "$RUN_DIR/kube-proxy-$fam.resync.nft" ]] || continue
            loop_run nft -f "$RUN_DIR/kube-proxy-$fam.resync.nft" || { ok=0; loop_log "nft -f ($fam) failed"; }
        done
    else
        for ipt in $(ipt_families); do
            v=4
            [[ "$ipt" == ip6* ]] && v=6
            for chain in PREROUTING OUTPUT; do
                loop_run "$ipt" -w 5 -C "$chain" -t nat "${KUBE_PORTALS[@]}" 2>/dev/null ||
                    loop_run "$ipt" -w 5 -I "$chain" -t nat "${KUBE_PORTALS[@]}" ||
                    { ok=0; loop_log "$ipt: jump from $chain failed"; }
            done
            loop_run "$ipt-restore" -w 5 --noflush "$RUN_DIR/kube-proxy-nat-v$v.rules" ||
                { ok=0; loop_log "$ipt-restore failed"; }
            kube_filter_jumps "$ipt" loop_run || { ok=0; loop_log "$ipt: filter jumps failed"; }
            kube_filter_restore "$ipt" "$KUBE_PROXY_ROUND" >"$RUN_DIR/kube-proxy-filter-v$v.rules"
            loop_run "$ipt-restore" -w 5 --noflush "$RUN_DIR/kube-proxy-filter-v$v.rules" ||
                { ok=0; loop_log "$ipt-restore (filter) failed"; }
        done
        KUBE_PROXY_ROUND=$((KUBE_PROXY_ROUND + 1))
    fi
    if ((ok)); then loop_log "synced"; else return 1; fi
}

run_loop() { # run_loop SVC
    local svc=$1 round tick="$RUN_DIR/$1.tick" first=1 ok=0 failed=0 in_front=0
    case $svc in
    cni-noise) round=cni_noise_round ;;
    kube-proxy-resync) round=kube_proxy_resync_round ;;
    *) die "bad loop $svc" ;;
    esac
    load_state
    trap loop_exit TERM INT
    loop_log "started (pid $$)"
    # A FIFO nobody writes to: `read -t 1` on it is a sleep the TERM trap interrupts.
    rm -f "$tick"
    mkfifo "$tick"
    exec 9<>"$tick"
    rm -f "$tick"
    while :; do
        ROUND_IN_FRONT=0
        if "$round"; then
            ok=$((ok + 1))
            in_front=$((in_front + ROUND_IN_FRONT))
        else
            failed=$((failed + 1))
            loop_log "round failed"
        fi
        echo "ok=$ok failed=$failed in_front=$in_front" >"$RUN_DIR/$svc.rounds.tmp"
        mv -f "$RUN_DIR/$svc.rounds.tmp" "$RUN_DIR/$svc.rounds"
        if ((first)); then
            if ((failed)); then
                loop_log "the first round failed: stopping"
                exit 1
            fi
            echo "$$" >"$RUN_DIR/$svc.ready"
            first=0
        fi
        read -r -t 1 -u 9 _ || true
    done
}

loop_start() { # loop_start SVC
    local svc=$1 pid deadline
    load_state
    if [[ $svc == kube-proxy-resync && ($KUBE_PROXY == ipvs || $KUBE_PROXY == real-*) ]]; then
        die "kube-proxy-resync is the stand-in's loop: not modelled for --kube-proxy $KUBE_PROXY (real kube-proxy syncs itself; busy-services and endpoint-churn-start keep it busy)"
    fi
    ns_exists node || die "namespace $(ns_name node) does not exist"
    rm -f "$RUN_DIR/$svc.ready" "$RUN_DIR/$svc.rounds"
    svc_start "$svc" node bash "$SELF" __loop "$PREFIX" "$svc"
    pid=$(<"$RUN_DIR/$svc.pid")
    deadline=$(($(now_ms) + 15000))
    until [[ -f "$RUN_DIR/$svc.ready" && "$(<"$RUN_DIR/$svc.ready")" == "$pid" ]]; do
        if ! svc_pid "$svc" >/dev/null || (($(now_ms) > deadline)); then
            tail -n 5 "$RUN_DIR/$svc.log" >&2
            svc_term "$svc"
            die "$svc failed to start (log: $RUN_DIR/$svc.log)"
        fi
        sleep 0.01
    done
}

loop_rounds() { # loop_rounds SVC: the counts of the loop's rounds since its -start
    [[ -f "$RUN_DIR/$1.rounds" ]] || die "$1 has not finished a round since its -start"
    cat "$RUN_DIR/$1.rounds"
}

# xtables-lock-hold SECONDS: the node's xtables lock (its own file, XTABLES_LOCKFILE: see main)
# held as another iptables-legacy user would hold it, for the agent's waits on it.
cmd_xtables_lock_hold() {
    if (($# != 1)) || [[ ! "$1" =~ ^[0-9]+(\.[0-9]+)?$ ]]; then usage; fi
    load_state
    # The background shell takes the lock on its fd 9, then becomes `sleep`, keeping the fd: the
    # lock is held exactly as long as that process lives.
    # shellcheck disable=SC2016 # expanded by the inner shell
    svc_start xtables-lock node bash -c 'exec 9>>"$1" && flock -x 9 && exec sleep "$2"' _ "$XTABLES_LOCKFILE" "$1"
    echo "$XTABLES_LOCKFILE"
}

# shellcheck shell=bash
# simnode kubelet: the iptables chains kubelet (>= 1.28, whatever the proxy mode:
# kubelet_network_linux.go) makes in the host's `iptables`, iptables-nft on current distros.

# kubelet_canaries IPT: KUBE-KUBELET-CANARY in mangle, nat and filter, the chains whose
# disappearance tells kubelet that someone flushed the tables.
kubelet_canaries() {
    local table
    for table in mangle nat filter; do in_ns node "$1" -t "$table" -N KUBE-KUBELET-CANARY; done
}

# kubelet_iptables: kubelet's iptables on a node whose kube-proxy uses nftables or IPVS, made with
# iptables-nft in both families: KUBE-IPTABLES-HINT (mangle), the canaries and, IPv4 only, filter
# KUBE-FIREWALL with its "block incoming localnet connections" DROP rule and `-I INPUT/OUTPUT -j
# KUBE-FIREWALL`. So iptables is not empty in those modes (as on a real node), but it has no nat
# rules at all. (In the iptables modes kube_iptables_rules makes only the canary and hint chains.)
kubelet_iptables() {
    local ipt
    for ipt in iptables-nft ip6tables-nft; do
        # What kubelet's commands leave, in one iptables-restore (a process costs ~0.2 s in the
        # test bed's TCG guest).
        {
            printf '*mangle\n:KUBE-IPTABLES-HINT - [0:0]\n:KUBE-KUBELET-CANARY - [0:0]\nCOMMIT\n'
            printf '*nat\n:KUBE-KUBELET-CANARY - [0:0]\nCOMMIT\n'
            printf '*filter\n:KUBE-KUBELET-CANARY - [0:0]\n'
            if [[ $ipt == iptables-nft ]]; then
                echo ":KUBE-FIREWALL - [0:0]"
                echo "-I OUTPUT -j KUBE-FIREWALL"
                echo "-I INPUT -j KUBE-FIREWALL"
                echo "-A KUBE-FIREWALL -m comment --comment \"block incoming localnet connections\"" \
                    "--dst 127.0.0.0/8 ! --src 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP"
            fi
            echo COMMIT
        } | in_ns node "$ipt-restore" --noflush
    done
}

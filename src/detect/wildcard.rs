//! A cache bound to the wildcard address, which the agent cannot run beside.

/// Why the agent cannot run beside the cache: a socket of the node's bound to port 53 of the
/// wildcard address (`listening`, as sock_diag lists the sockets serving the listen IPs), which
/// is node-local-dns's node-cache told to bind every address (deliveryhero's chart's default,
/// `config.bindIp: false`), or another DNS server of the node's. The kernel fast path hands a
/// pod's query only to a socket bound to the cache's address itself (`socket wildcard 0`, and
/// xt_socket's `--nowildcard`): pods would never reach such a cache. And the link-local
/// forwarder's transparent sockets on port 53 cannot bind beside it. `None`: there is none.
pub fn wildcard_refusal(listening: &[crate::sockdiag::Listener]) -> Option<String> {
    let wildcard = listening.iter().find(|l| l.local.ip().is_unspecified())?;
    Some(format!(
        "{} {}: a socket of this node listens on port 53 of every address, not on node-local-dns's \
         own: node-cache bound to the wildcard address (deliveryhero's node-local-dns chart does, \
         by default: config.bindIp=false). Pods' queries are handed only to a socket bound to the \
         cache's address itself, so they would never reach this cache, and the agent's \
         forwarder cannot listen on port 53 beside it. Bind node-local-dns to its addresses \
         (deliveryhero's chart: --set config.bindIp=true; a Corefile of your own: `bind` with its \
         link-local IP and the kube-dns ClusterIP in each server block), then restart this agent; \
         nothing was changed",
        wildcard.transport, wildcard.local
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_bound_to_the_wildcard_is_refused_naming_the_value_to_change() {
        use crate::probe::Transport;
        use crate::sockdiag::Listener;
        let listener = |transport, local: &str| Listener {
            transport,
            local: local.parse().unwrap(),
            cookie: 1,
        };
        let bound = [
            listener(Transport::Udp, "169.254.20.10:53"),
            listener(Transport::Tcp, "10.96.0.10:53"),
        ];
        assert_eq!(wildcard_refusal(&bound), None);
        assert_eq!(wildcard_refusal(&[]), None);
        for wildcard in ["0.0.0.0:53", "[::]:53"] {
            let listening = [bound[0], listener(Transport::Tcp, wildcard)];
            let refusal = wildcard_refusal(&listening).expect("refused");
            assert!(refusal.starts_with(&format!("tcp {wildcard}: ")), "{refusal}");
            for says in ["config.bindIp=true", "`bind`", "nothing was changed"] {
                assert!(refusal.contains(says), "{says}: {refusal}");
            }
        }
    }
}

//! Real-kernel test of an upstream that moves (its Service re-created with a new ClusterIP,
//! followed through the API server: [`crate::upstream`]), on [`super`]'s namespace and clients.

use super::upstream::SOCKETS;
use super::*;
use crate::upstream::{Following, Upstream};

/// The forwarder dials the new address at once, UDP and TCP: with re-dials an hour apart, only
/// the move can bring the answers back within the deadline.
#[test]
fn a_moved_upstream_is_dialled_at_once_udp_and_tcp() {
    in_netns("fwd", test_path!(), |ns| {
        let family = v4();
        set_up(ns);
        // Nothing at the old address (the Service is gone); the new one answers.
        let new: SocketAddr = "10.96.0.12:53".parse().unwrap();
        run("ip", &["-n", ns, "addr", "add", "10.96.0.12/32", "dev", "lo"]);
        start_upstream(new);
        let old = Upstream { ips: vec![family.upstream.ip()], from: "the environment".into() };
        let following = Following::new(old);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let options = Options { upstream_redial: Duration::from_secs(3600), ..Options::default() };
        let forwarder = {
            let _inside = runtime.enter();
            Forwarder::bind(family.forwarder, following.addr(true), options).unwrap()
        };
        let counters = forwarder.counters();
        runtime.spawn(forwarder.run());
        let client = udp_client(family);
        client.send_to(&query(1, ANSWER), family.link_local).unwrap();
        let failed =
            testkit::poll(DEADLINE, || (counters.totals().upstream_failures == 1).then_some(()));
        assert!(failed.is_some(), "the old address refuses: {:?}", counters.totals());

        following.set(Upstream { ips: vec![new.ip()], from: "Service".into() });
        let mut buf = [0; 512];
        let answered = testkit::poll(DEADLINE, || {
            client.send_to(&query(2, ANSWER), family.link_local).unwrap();
            client.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
            let len = client.recv(&mut buf).ok()?;
            (buf[..len] == answer_to(&query(2, ANSWER))[..]).then_some(())
        });
        assert!(answered.is_some(), "UDP answered by the new address: {:?}", counters.totals());
        let redials = || counters.totals().upstream_redials;
        let each_once = testkit::poll(DEADLINE, || (redials() == SOCKETS as u64).then_some(()));
        assert!(each_once.is_some(), "each socket re-dialled once: {}", redials());
        let mut stream = tcp_client(family);
        write_framed(&mut stream, &query(3, ANSWER)).unwrap();
        assert_eq!(read_framed(&mut stream).unwrap(), answer_to(&query(3, ANSWER)));
    });
}

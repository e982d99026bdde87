//! Who is served when every place is taken. The places are shared by client address, as a
//! fair queue shares a link: a newcomer whose address holds fewer connections than the greediest
//! address takes the place of that address's oldest connection, whatever it is doing (reading its
//! request, or waiting for its client to read the answer); otherwise it takes the place of its own
//! address's oldest connection still reading its request, and failing that it is refused. A
//! connection is reading once its task began to read: until then (a burst of connections
//! accepted one after the other, before any of their tasks ran) it cannot be told from a
//! request about to be read, and only another address's newcomer takes its place.
//!
//! So no address can lock another out: the kubelet, whose probes come from the node's own address
//! one or two at a time, is kept out of those places only when every place is held by addresses
//! that each hold no more than it does (64 addresses of one connection each), and the same holds
//! for a Prometheus in a pod. A fixed share per address (as the forwarder has) would leave the
//! port to eight pods that each take theirs. Within one address (every client of a
//! loopback-only server) the connections still reading their request make room first: silent
//! clients cannot starve a real request from the same address.
//!
//! A host-network tenant shares the node's address with the kubelet, and its connections that
//! were answered but never read their answers (each held up to the write timeout) can hold every
//! place of that address, where nothing tells them from the kubelet's. So a newcomer no place
//! can be made for takes one of a few places kept for health checks ([`Admitted::probes_only`]),
//! where it is answered only if it asks for `/healthz` or `/readyz`. When they are all taken the
//! oldest whose request was read gives way (its answer, a few bytes the kernel took at once, is
//! out: none of those places is held for long by anyone), else the oldest still reading: a
//! kubelet probe, which sends its request as it connects, is answered there unless as many
//! silent newcomers come between its connection and its request.

use std::cmp::Reverse;
use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;

/// The connections being served, by client address, each address's oldest first. `T` is how a
/// connection is told to close (its task's eviction notice).
pub(super) struct Places<T> {
    limit: usize,
    taken: usize,
    next_id: u64,
    by_client: HashMap<IpAddr, VecDeque<Place<T>>>,
    /// The places kept for health checks, at most `probe_limit`, oldest first.
    probes: VecDeque<Place<T>>,
    probe_limit: usize,
}

struct Place<T> {
    id: u64,
    stage: Stage,
    evict: T,
}

/// Where a connection is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Let in; its task has not begun to read.
    Admitted,
    /// Reading its request.
    Reading,
    /// Its request read: being answered, or lingering.
    Answering,
}

/// A connection let in.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Admitted<T> {
    /// Its number, to say later that it has read its request or ended.
    pub(super) id: u64,
    /// The connection that gave way to it, to be closed.
    pub(super) evicted: Option<T>,
    /// It holds a place kept for health checks: only `/healthz` and `/readyz` are answered.
    pub(super) probes_only: bool,
}

impl<T> Places<T> {
    /// `limit` places, all free, and `probe_limit` more kept for health checks.
    pub(super) fn new(limit: usize, probe_limit: usize) -> Places<T> {
        let (by_client, probes) = (HashMap::new(), VecDeque::new());
        Places { limit, taken: 0, next_id: 0, by_client, probes, probe_limit }
    }

    /// Lets a connection from `client` in, reading its request, making room if every place is
    /// taken, else in a place kept for health checks; `None` when it is refused (no such
    /// place).
    pub(super) fn admit(&mut self, client: IpAddr, evict: T) -> Option<Admitted<T>> {
        let evicted = if self.taken < self.limit {
            None
        } else if let Some(evicted) = self.make_room(client) {
            Some(evicted)
        } else {
            return self.admit_for_probes(evict);
        };
        let id = self.next_id;
        self.next_id += 1;
        let place = Place { id, stage: Stage::Admitted, evict };
        self.by_client.entry(client).or_default().push_back(place);
        self.taken += 1;
        Some(Admitted { id, evicted, probes_only: false })
    }

    /// Lets a connection in a place kept for health checks. When they are all taken, the oldest
    /// whose request was read gives way (its answer, a few bytes, is out, or it asked for what
    /// these places do not serve), else the oldest still reading its request.
    fn admit_for_probes(&mut self, evict: T) -> Option<Admitted<T>> {
        if self.probe_limit == 0 {
            return None;
        }
        let evicted = if self.probes.len() < self.probe_limit {
            None
        } else {
            let answered = self.probes.iter().position(|p| p.stage == Stage::Answering);
            let reading = || self.probes.iter().position(|p| p.stage == Stage::Reading);
            let at = answered.or_else(reading).unwrap_or(0);
            self.probes.remove(at).map(|place| place.evict)
        };
        let id = self.next_id;
        self.next_id += 1;
        self.probes.push_back(Place { id, stage: Stage::Admitted, evict });
        Some(Admitted { id, evicted, probes_only: true })
    }

    /// Connection `id` of `client` begins to read its request: from now on a newcomer of its
    /// own address may take its place.
    pub(super) fn reading(&mut self, client: IpAddr, id: u64) {
        self.set_stage(client, id, Stage::Reading);
    }

    /// Connection `id` of `client` has read its request: from now on only another address's
    /// newcomer can take its place.
    pub(super) fn answering(&mut self, client: IpAddr, id: u64) {
        self.set_stage(client, id, Stage::Answering);
    }

    fn set_stage(&mut self, client: IpAddr, id: u64, stage: Stage) {
        let queue = self.by_client.get_mut(&client).into_iter().flatten();
        if let Some(place) = queue.chain(&mut self.probes).find(|p| p.id == id) {
            place.stage = stage;
        }
    }

    /// Connection `id` of `client` ended (nothing to do when it was evicted).
    pub(super) fn leave(&mut self, client: IpAddr, id: u64) {
        if let Some(at) = self.probes.iter().position(|p| p.id == id) {
            self.probes.remove(at);
            return;
        }
        self.remove(client, id);
    }

    /// Frees a place for a newcomer from `client`: the oldest connection of the address holding
    /// the most (on a tie, the one whose oldest is oldest) if that is more than `client` holds,
    /// else `client`'s oldest still reading. Returns how to close it.
    fn make_room(&mut self, client: IpAddr) -> Option<T> {
        let mine = self.by_client.get(&client).map_or(0, VecDeque::len);
        let greediest = self
            .by_client
            .iter()
            .max_by_key(|(_, queue)| (queue.len(), Reverse(queue[0].id)))
            .map(|(&address, queue)| (address, queue.len()));
        let (address, at) = match greediest {
            Some((address, held)) if held > mine => (address, 0),
            _ => {
                let mine = self.by_client.get(&client)?;
                (client, mine.iter().position(|p| p.stage == Stage::Reading)?)
            }
        };
        let id = self.by_client[&address][at].id;
        self.remove(address, id).map(|place| place.evict)
    }

    /// Takes connection `id` of `client` out; an address holding none is forgotten.
    fn remove(&mut self, client: IpAddr, id: u64) -> Option<Place<T>> {
        let queue = self.by_client.get_mut(&client)?;
        let place = queue.remove(queue.iter().position(|p| p.id == id)?)?;
        if queue.is_empty() {
            self.by_client.remove(&client);
        }
        self.taken -= 1;
        Some(place)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POD: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 244, 0, 2));
    const NODE: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 244, 0, 1));

    fn pod(n: u8) -> IpAddr {
        IpAddr::V4(std::net::Ipv4Addr::new(10, 244, 1, n))
    }

    impl<T> Places<T> {
        fn held(&self, client: IpAddr) -> usize {
            self.by_client.get(&client).map_or(0, VecDeque::len)
        }
    }

    /// Admits a connection named `name`: what was evicted for it, or "refused".
    fn admit(places: &mut Places<&'static str>, client: IpAddr, name: &'static str) -> String {
        match places.admit(client, name) {
            None => "refused".into(),
            Some(Admitted { evicted: None, probes_only, .. }) => probes(probes_only, "in"),
            Some(Admitted { evicted: Some(gone), probes_only, .. }) => {
                probes(probes_only, &format!("in, {gone} out"))
            }
        }
    }

    /// `what`, said of a place kept for health checks when it is one.
    fn probes(probes_only: bool, what: &str) -> String {
        if probes_only {
            format!("{what} (probes only)")
        } else {
            what.to_owned()
        }
    }

    /// The node's address holds every place with connections being answered (a host-network
    /// tenant's, as the kubelet's): its newcomers go to the places kept for health checks, the
    /// oldest of them giving way, and never take a place of another address's or of its own
    /// being answered; those places ending free theirs, and a general place that frees is a
    /// general place again.
    #[test]
    fn newcomers_no_place_can_be_made_for_get_the_places_kept_for_probes() {
        let mut places = Places::new(2, 2);
        for name in ["tenant-1", "tenant-2"] {
            let id = places.admit(NODE, name).unwrap().id;
            places.answering(NODE, id);
        }
        assert_eq!(admit(&mut places, NODE, "kubelet-1"), "in (probes only)");
        let second = places.admit(NODE, "kubelet-2").unwrap();
        assert_eq!((second.evicted, second.probes_only), (None, true));
        // Both kept places taken, neither reading nor answered: the oldest gives way.
        let third = places.admit(NODE, "kubelet-3").unwrap();
        assert_eq!((third.evicted, third.probes_only), (Some("kubelet-1"), true));
        // One answered (lingering): it gives way before an older one still reading.
        places.answering(NODE, third.id);
        assert_eq!(admit(&mut places, NODE, "kubelet-4"), "in, kubelet-3 out (probes only)");
        // One reading (silent so far): it gives way before an older one not yet reading.
        places.reading(NODE, 5);
        assert_eq!(admit(&mut places, NODE, "kubelet-5"), "in, kubelet-4 out (probes only)");
        assert_eq!(admit(&mut places, NODE, "kubelet-6"), "in, kubelet-2 out (probes only)");
        // An evicted one ending frees nothing; one that ends frees its kept place.
        places.leave(NODE, second.id);
        assert_eq!((places.taken, places.probes.len()), (2, 2));
        places.leave(NODE, places.probes[0].id);
        assert_eq!((places.taken, places.probes.len()), (2, 1));
        assert_eq!(admit(&mut places, NODE, "kubelet-7"), "in (probes only)");
        // A general place frees: the next newcomer takes it.
        places.leave(NODE, 0);
        assert_eq!(admit(&mut places, NODE, "scrape"), "in");
        assert_eq!((places.taken, places.probes.len()), (2, 2));
        // Another address still takes a general place from the greediest, not a kept one.
        assert_eq!(admit(&mut places, POD, "pod"), "in, tenant-2 out");
    }

    #[test]
    fn a_newcomer_takes_the_place_of_the_greediest_address_oldest_first() {
        let mut places = Places::new(3, 0);
        assert_eq!(admit(&mut places, POD, "pod-1"), "in");
        let answering = places.admit(POD, "pod-2").unwrap().id;
        places.answering(POD, answering);
        assert_eq!(admit(&mut places, pod(9), "other-1"), "in");
        // Full: the pod holds the most, its oldest goes, whatever it is doing.
        assert_eq!(admit(&mut places, NODE, "kubelet-1"), "in, pod-1 out");
        // Now three addresses hold one each: the node's second probe is not let in over them,
        // and none of its own is still reading.
        places.answering(NODE, 3);
        assert_eq!(admit(&mut places, NODE, "kubelet-2"), "refused");
        // A newcomer of an address holding none still gets in: the oldest of the tied goes.
        assert_eq!(admit(&mut places, pod(7), "another"), "in, pod-2 out");
        assert_eq!((places.held(POD), places.held(NODE), places.taken), (0, 1, 3));
    }

    #[test]
    fn within_the_greediest_address_only_its_readers_make_room() {
        let mut places = Places::new(2, 0);
        let first = places.admit(POD, "answering").unwrap().id;
        places.answering(POD, first);
        let silent = places.admit(POD, "silent").unwrap().id;
        // Its task has not begun to read: a newcomer of the same address does not take its
        // place (accepted one after the other, a burst could otherwise evict a request that
        // was about to be read).
        assert_eq!(admit(&mut places, POD, "burst"), "refused");
        places.reading(POD, silent);
        // Full of the pod's own: a newcomer of it takes the silent one's place, not the one
        // being answered, and is refused once none is left reading.
        assert_eq!(admit(&mut places, POD, "request"), "in, silent out");
        places.reading(POD, 3);
        places.answering(POD, 3);
        assert_eq!(admit(&mut places, POD, "more"), "refused");
    }

    #[test]
    fn an_evicted_connection_that_ends_frees_nothing_twice() {
        let mut places = Places::new(1, 0);
        let pod = places.admit(POD, "pod").unwrap();
        let node = places.admit(NODE, "kubelet").unwrap();
        assert_eq!(node.evicted, Some("pod"));
        places.leave(POD, pod.id);
        assert_eq!(places.taken, 1);
        places.leave(NODE, node.id);
        assert_eq!((places.taken, places.by_client.len()), (0, 0));
        assert_eq!(admit(&mut places, POD, "again"), "in");
    }

    /// A pod floods 64 places with connections that never read (each answered and stuck) and
    /// opens one more on every turn; every 10th turn the kubelet probes, and its probe ends
    /// before the next. The kubelet is never refused, the places are never more than 64, and
    /// the pod keeps all the others.
    #[test]
    fn a_flooding_address_never_keeps_the_kubelet_out() {
        let mut places = Places::new(64, 0);
        let mut pods = VecDeque::new();
        let mut evicted = 0;
        for turn in 0..10_000 {
            if let Some(admitted) = places.admit(POD, "pod") {
                places.answering(POD, admitted.id);
                pods.push_back(admitted.id);
                assert_eq!(admitted.evicted, None, "turn {turn}: the pod took from itself");
            }
            // The pod's connections end now and then (the write timeout).
            if turn % 7 == 0 {
                if let Some(id) = pods.pop_front() {
                    places.leave(POD, id);
                }
            }
            if turn % 10 == 0 {
                let full = places.taken == 64;
                let probe = places.admit(NODE, "kubelet");
                let probe = probe.unwrap_or_else(|| panic!("turn {turn}: the kubelet refused"));
                // A pod's connection gives way exactly when there is no free place.
                assert_eq!(probe.evicted.is_some(), full, "turn {turn}");
                evicted += usize::from(full);
                places.answering(NODE, probe.id);
                assert!(places.taken <= 64, "turn {turn}: {} places", places.taken);
                places.leave(NODE, probe.id);
            }
            assert!(places.taken <= 64, "turn {turn}: {} places", places.taken);
        }
        assert_eq!(places.held(POD), 64);
        assert!(evicted > 800, "the flood left free places: {evicted} of 1000 probes found none");
    }

    /// 64 addresses of one connection each (as many pods, or one pod's many IPv6 addresses):
    /// an address holding none still gets in, one holding as many is refused.
    #[test]
    fn many_addresses_of_one_connection_each_still_let_a_newcomer_in() {
        let mut places = Places::new(64, 0);
        for n in 0..64 {
            let id = places.admit(pod(n), "pod").unwrap().id;
            places.answering(pod(n), id);
        }
        let probe = places.admit(NODE, "kubelet").unwrap();
        assert_eq!(probe.evicted, Some("pod"));
        assert_eq!(places.held(pod(0)), 0, "the oldest gave way");
        places.answering(NODE, probe.id);
        assert_eq!(admit(&mut places, NODE, "second probe"), "refused");
    }
}

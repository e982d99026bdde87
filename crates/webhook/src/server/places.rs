//! Who is served when every place is taken: the places of a port are shared by client address,
//! as a fair queue shares a link (the agent's HTTP port does the same). A newcomer whose address
//! holds fewer connections than the greediest address takes the place of that address's oldest
//! connection, whatever it is doing; otherwise it takes the place of its own address's oldest
//! connection with no request in flight (a silent one, or one waiting for its next request),
//! and failing that it is refused.
//!
//! So a pod that opens connections without end holds the places only while nobody else wants
//! them: the API server (from its own address, with a connection or a few) and the kubelet (from
//! the node's) always get in, and a pod's silent connections make room for its own requests.
//! They can be kept out only when every place is held by addresses that each hold no more than
//! they do (a place each for as many pods as there are places).

use std::cmp::Reverse;
use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;

/// A connection holding a place: whether a request of its own is in flight, and how it is
/// told to close.
pub(super) trait Occupant {
    /// A request of this connection is being answered.
    fn busy(&self) -> bool;
}

/// The connections being served, by client address, each address's oldest first.
pub(super) struct Places<T> {
    limit: usize,
    taken: usize,
    next_id: u64,
    by_client: HashMap<IpAddr, VecDeque<Place<T>>>,
}

struct Place<T> {
    id: u64,
    occupant: T,
}

/// A connection let in.
#[derive(Debug)]
pub(super) struct Admitted<T> {
    /// Its number, to say later that it ended.
    pub(super) id: u64,
    /// The connection that gave way to it, to be closed.
    pub(super) evicted: Option<T>,
}

impl<T: Occupant> Places<T> {
    /// `limit` places, all free.
    pub(super) fn new(limit: usize) -> Places<T> {
        Places { limit, taken: 0, next_id: 0, by_client: HashMap::new() }
    }

    /// Lets a connection from `client` in, making room if every place is taken; `None` when no
    /// room can be made for it.
    pub(super) fn admit(&mut self, client: IpAddr, occupant: T) -> Option<Admitted<T>> {
        let evicted = if self.taken < self.limit { None } else { Some(self.make_room(client)?) };
        let id = self.next_id;
        self.next_id += 1;
        self.by_client.entry(client).or_default().push_back(Place { id, occupant });
        self.taken += 1;
        Some(Admitted { id, evicted })
    }

    /// Connection `id` of `client` ended (nothing to do when it was evicted).
    pub(super) fn leave(&mut self, client: IpAddr, id: u64) {
        self.remove(client, id);
    }

    /// Frees a place for a newcomer from `client`: the oldest connection of the address holding
    /// the most (on a tie, the one whose oldest is oldest) if that is more than `client` holds,
    /// else `client`'s oldest with no request in flight. Returns it, to be closed.
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
                (client, mine.iter().position(|p| !p.occupant.busy())?)
            }
        };
        let id = self.by_client[&address][at].id;
        self.remove(address, id).map(|place| place.occupant)
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
    use std::net::Ipv4Addr;

    use super::*;

    /// A connection named for the test, busy or not.
    #[derive(Debug, PartialEq, Eq)]
    struct Conn(&'static str, bool);

    impl Occupant for Conn {
        fn busy(&self) -> bool {
            self.1
        }
    }

    const API_SERVER: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 240, 0, 2));
    const POD: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 244, 0, 2));

    fn pod(n: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 244, 1, n))
    }

    /// Admits `conn` from `client`: the name of the connection evicted for it, "" if none, or
    /// "refused".
    fn admit(places: &mut Places<Conn>, client: IpAddr, conn: Conn) -> &'static str {
        match places.admit(client, conn) {
            None => "refused",
            Some(Admitted { evicted: None, .. }) => "",
            Some(Admitted { evicted: Some(Conn(name, _)), .. }) => name,
        }
    }

    #[test]
    fn under_the_limit_everyone_is_let_in_and_a_place_left_is_free_again() {
        let mut places = Places::new(2);
        assert_eq!(admit(&mut places, POD, Conn("a", false)), "");
        let b = places.admit(API_SERVER, Conn("b", false)).unwrap();
        places.leave(API_SERVER, b.id);
        assert_eq!(admit(&mut places, API_SERVER, Conn("c", true)), "");
        assert_eq!(places.taken, 2);
    }

    #[test]
    fn a_pods_silent_connections_never_keep_the_api_server_out() {
        let mut places = Places::new(4);
        for name in ["p1", "p2", "p3", "p4"] {
            assert_eq!(admit(&mut places, POD, Conn(name, false)), "");
        }
        // Full: the pod's next one takes the place of its own oldest silent one.
        assert_eq!(admit(&mut places, POD, Conn("p5", false)), "p1");
        // The API server takes the pod's oldest, busy or not, and keeps its place.
        assert_eq!(admit(&mut places, API_SERVER, Conn("api", true)), "p2");
        assert_eq!(admit(&mut places, API_SERVER, Conn("api2", false)), "p3");
        for name in ["p6", "p7", "p8"] {
            assert_ne!(admit(&mut places, POD, Conn(name, false)), "api");
        }
        let api = &places.by_client[&API_SERVER];
        assert_eq!(api.len(), 2, "the API server's two connections held");
    }

    #[test]
    fn an_address_whose_connections_are_all_busy_is_refused_when_it_holds_the_most() {
        let mut places = Places::new(2);
        assert_eq!(admit(&mut places, POD, Conn("p1", true)), "");
        assert_eq!(admit(&mut places, POD, Conn("p2", true)), "");
        assert_eq!(admit(&mut places, POD, Conn("p3", false)), "refused");
        // Another address still gets in.
        assert_eq!(admit(&mut places, API_SERVER, Conn("api", false)), "p1");
    }

    #[test]
    fn many_pods_of_one_connection_each_give_way_to_a_newcomer_oldest_first() {
        let mut places = Places::new(3);
        for n in 1..=3 {
            assert_eq!(admit(&mut places, pod(n), Conn("one", true)), "");
        }
        let evicted = places.admit(API_SERVER, Conn("api", false)).unwrap().evicted;
        assert_eq!(evicted, Some(Conn("one", true)));
        assert!(!places.by_client.contains_key(&pod(1)), "the oldest gave way");
        // Now every address holds one: the API server's place is not taken by a pod that holds
        // as many as it does, and a pod with none takes the oldest's.
        assert_eq!(admit(&mut places, pod(2), Conn("again", true)), "refused");
        assert_eq!(admit(&mut places, pod(9), Conn("new", false)), "one");
        assert!(places.by_client.contains_key(&API_SERVER));
    }
}

//! The queries in flight on one of the forwarder's sockets to the upstream, by the message id
//! each went out with.
//!
//! Every client's UDP query leaves on one of a few long-lived sockets (`upstream.rs` says why),
//! so the ids the clients chose would collide there. Each query goes out under an id of the
//! table's choosing, unique among the socket's pending queries; its answer is found by that id
//! and sent back under the client's own. Ids are drawn at random (SipHash, keyed from the
//! operating system's randomness, over a counter), never counted up: the ids of earlier queries
//! tell nobody the next one.
//!
//! What an answer must show to be taken for a query's, and why:
//!
//! * **It comes from the upstream's address and port**: the socket is connected, and the kernel
//!   hands it nothing else. (Not checked here.) A host that can forge that source, on the
//!   node's network to CoreDNS, must still guess the socket's port, which stays the same for
//!   the socket's life, unlike the fresh port per query of a socket per query; hence the rest.
//! * **Its id is pending.** A forger must guess 16 random bits, per pending query it aims at.
//! * **Its question section is the query's** (the name compared without regard to ASCII case,
//!   as an upstream that lowercases would write it). This is what keeps an answer that comes
//!   after its query expired, when the id may have gone to another query since (with 4096
//!   pending, one id in 16 is taken), from reaching a client that asked something else, and
//!   what makes a blind forgery name the question it answers. An answer with no question
//!   passes on its id alone only if it reports an error other than NXDOMAIN (a FORMERR or
//!   SERVFAIL may come without one): it carries no name and no data. A query whose question
//!   the table cannot read (no question, several, a compressed name) is matched by its id
//!   alone: no resolver sends such a thing, and what the upstream says to it answers nothing.
//!
//! A late answer to a question another client has asked since passes for the second's: it is
//! the upstream's answer to the same question, seconds old at most. Anything that passes none
//! of the checks is dropped, and counted by the caller.
//!
//! Pure: no socket, and no clock (the time comes in as an argument).

use std::hash::{BuildHasher, Hasher, RandomState};
use std::time::Instant;

/// How many DNS message ids there are.
const IDS: usize = 1 << 16;

/// The most queries a table holds pending: half the ids, so that a random draw finds a free
/// one at the first or second try.
pub(super) const MAX_PENDING: usize = IDS / 2;

/// How many ids [`Pending::insert`] draws before it gives up (with half the ids taken, it does
/// once in 2³²).
const DRAWS: usize = 32;

/// The length of a DNS message's header; its question section follows.
pub(super) const HEADER_LEN: usize = 12;

/// The longest question section the table reads: a name of 255 bytes, its type and class.
const MAX_QUESTION: usize = 255 + 4;

/// The RCODE of an answer that says the name does not exist.
const NXDOMAIN: u8 = 3;

/// The queries in flight on one socket to the upstream, each with what it takes to answer its
/// client (`T`), under an id drawn from `I`.
pub(super) struct Pending<T, I = RandomIds> {
    /// For each id, 0 when it is free, else the position of its query in `queries` plus one.
    slot_of: Box<[u32]>,
    /// The pending queries, packed: one leaving moves the last into its place.
    queries: Vec<Entry<T>>,
    /// Where ids come from.
    ids: I,
    /// The key of the questions' fingerprints, so that nobody can make another question that
    /// hashes the same.
    questions: RandomState,
}

/// A pending query.
struct Entry<T> {
    /// The id it went out with.
    id: u16,
    /// When it expires.
    deadline: Instant,
    /// Its question, as an answer must repeat it.
    question: Question,
    /// What its client needs.
    query: T,
}

/// A message's question section, as the table compares them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Question {
    /// One question, fingerprinted: the name in lower case, then its type and class.
    Of(u64),
    /// None (QDCOUNT 0).
    Absent,
    /// One the table does not read: several, a compressed or overlong name, a message cut short.
    Unreadable,
}

/// What an answer from the upstream turned out to be.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Answered<T> {
    /// The answer to this query, which is pending no longer.
    Query(T),
    /// No query is pending under its id: it came after its query expired, or was never asked.
    Unknown,
    /// A query is pending under its id but asked another question; it stays pending.
    OtherQuestion,
}

impl<T> Pending<T> {
    /// An empty table, its ids drawn at random.
    pub(super) fn new() -> Pending<T> {
        Pending::with_ids(RandomIds::new())
    }
}

impl<T, I: Iterator<Item = u16>> Pending<T, I> {
    /// An empty table that takes its ids from `ids` (the tests script them).
    pub(super) fn with_ids(ids: I) -> Pending<T, I> {
        Pending {
            slot_of: vec![0; IDS].into_boxed_slice(),
            queries: Vec::new(),
            ids,
            questions: RandomState::new(),
        }
    }

    /// Whether no query is pending.
    pub(super) fn is_empty(&self) -> bool {
        self.queries.is_empty()
    }

    /// How many queries are pending.
    #[cfg(any(test, fuzzing))]
    pub(super) fn len(&self) -> usize {
        self.queries.len()
    }

    /// Takes `query` (the message as the client sent it) pending until `deadline`, with what
    /// its client needs; returns the id it is to go out with. None when the table is full (at
    /// [`MAX_PENDING`]) or no free id came up.
    pub(super) fn insert(&mut self, query: &[u8], client: T, deadline: Instant) -> Option<u16> {
        if self.queries.len() >= MAX_PENDING {
            return None;
        }
        let (ids, slot_of) = (&mut self.ids, &self.slot_of);
        let id = ids.take(DRAWS).find(|&id| slot_of[usize::from(id)] == 0)?;
        let question = question(query, &self.questions);
        self.queries.push(Entry { id, deadline, question, query: client });
        self.slot_of[usize::from(id)] = u32::try_from(self.queries.len()).expect("≤ 2¹⁵ pending");
        Some(id)
    }

    /// Finds the query `answer` answers (see the module's documentation for what must match)
    /// and takes it out of the table.
    pub(super) fn answer(&mut self, answer: &[u8]) -> Answered<T> {
        let Some(&[high, low]) = answer.get(..2) else { return Answered::Unknown };
        let id = u16::from_be_bytes([high, low]);
        let Some(at) = self.slot(id).checked_sub(1) else { return Answered::Unknown };
        let rcode = answer.get(3).map_or(0, |flags| flags & 0x0f);
        let answered = question(answer, &self.questions);
        let matches = match (self.queries[at].question, answered) {
            (Question::Of(asked), Question::Of(answered)) => asked == answered,
            (Question::Of(_), Question::Absent) => rcode != 0 && rcode != NXDOMAIN,
            (Question::Of(_), Question::Unreadable) => false,
            (Question::Absent | Question::Unreadable, _) => true,
        };
        if !matches {
            return Answered::OtherQuestion;
        }
        Answered::Query(self.remove(at))
    }

    /// Takes the query pending under `id` out of the table, if there is one (its query could
    /// not be sent).
    pub(super) fn cancel(&mut self, id: u16) -> Option<T> {
        let at = self.slot(id).checked_sub(1)?;
        Some(self.remove(at))
    }

    /// Takes out every query whose deadline is `now` or earlier, each given to `expired`;
    /// returns how many. One pass over the pending queries, however many there are.
    pub(super) fn expire(&mut self, now: Instant, mut expired: impl FnMut(T)) -> usize {
        let before = self.queries.len();
        let mut at = 0;
        while at < self.queries.len() {
            if self.queries[at].deadline <= now {
                // The last query moves to `at`: look at it next.
                expired(self.remove(at));
            } else {
                at += 1;
            }
        }
        before - self.queries.len()
    }

    /// The slot of `id`: 0 when free, else its query's position plus one.
    fn slot(&self, id: u16) -> usize {
        self.slot_of[usize::from(id)] as usize
    }

    /// Takes out the query at `at`, moving the last one into its place.
    fn remove(&mut self, at: usize) -> T {
        let entry = self.queries.swap_remove(at);
        self.slot_of[usize::from(entry.id)] = 0;
        if let Some(moved) = self.queries.get(at) {
            self.slot_of[usize::from(moved.id)] = u32::try_from(at + 1).expect("≤ 2¹⁵ pending");
        }
        entry.query
    }
}

/// The question section of `message`, fingerprinted with `key`.
fn question(message: &[u8], key: &RandomState) -> Question {
    let Some(header) = message.get(..HEADER_LEN) else { return Question::Unreadable };
    match u16::from_be_bytes([header[4], header[5]]) {
        0 => return Question::Absent,
        1 => {}
        _ => return Question::Unreadable,
    }
    // The name: labels of up to 63 bytes, each after its length, up to the empty one.
    let mut end = HEADER_LEN;
    loop {
        match message.get(end) {
            Some(0) => break,
            Some(&len @ 1..=63) => end += 1 + usize::from(len),
            _ => return Question::Unreadable,
        }
        // A name is at most 255 bytes, its final 0 included.
        if end - HEADER_LEN >= 255 {
            return Question::Unreadable;
        }
    }
    let name = end + 1 - HEADER_LEN;
    let Some(section) = message.get(HEADER_LEN..HEADER_LEN + name + 4) else {
        return Question::Unreadable;
    };
    let mut lowered = [0; MAX_QUESTION];
    let lowered = &mut lowered[..section.len()];
    lowered.copy_from_slice(section);
    // The lengths are below 64, so never a letter; type and class stay as they are.
    lowered[..name].make_ascii_lowercase();
    let mut hasher = key.build_hasher();
    hasher.write(lowered);
    Question::Of(hasher.finish())
}

/// Random message ids: SipHash (std's `RandomState`, keyed from the operating system's
/// randomness) over a counter, four ids from each hash.
pub(super) struct RandomIds {
    key: RandomState,
    counter: u64,
    drawn: u64,
    left: u8,
}

impl RandomIds {
    fn new() -> RandomIds {
        RandomIds { key: RandomState::new(), counter: 0, drawn: 0, left: 0 }
    }
}

impl Iterator for RandomIds {
    type Item = u16;

    fn next(&mut self) -> Option<u16> {
        if self.left == 0 {
            self.drawn = self.key.hash_one(self.counter);
            self.counter = self.counter.wrapping_add(1);
            self.left = 4;
        }
        let id = self.drawn as u16;
        self.drawn >>= 16;
        self.left -= 1;
        Some(id)
    }
}

#[cfg(test)]
mod tests;

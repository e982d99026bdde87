use std::collections::HashSet;
use std::time::Duration;

use super::*;

/// A message: `id`, the flags' second byte (RA and the RCODE), `qdcount`, then `question`.
fn message(id: u16, rcode: u8, qdcount: u16, question: &[u8]) -> Vec<u8> {
    let mut message = id.to_be_bytes().to_vec();
    message.extend_from_slice(&[0x81, rcode]);
    message.extend_from_slice(&qdcount.to_be_bytes());
    message.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
    message.extend_from_slice(question);
    message
}

/// `name`'s question section (labels split at dots) for `qtype`, class IN.
fn question_of(name: &str, qtype: u16) -> Vec<u8> {
    let mut section = Vec::new();
    for label in name.split('.').filter(|l| !l.is_empty()) {
        section.push(u8::try_from(label.len()).unwrap());
        section.extend_from_slice(label.as_bytes());
    }
    section.push(0);
    section.extend_from_slice(&qtype.to_be_bytes());
    section.extend_from_slice(&1u16.to_be_bytes());
    section
}

/// A query for `name`, type A, with `id`.
fn query(id: u16, name: &str) -> Vec<u8> {
    message(id, 0, 1, &question_of(name, 1))
}

/// The answer, under `id`, to `name`, type A: no error, one question (records are not read).
fn answer(id: u16, name: &str) -> Vec<u8> {
    let mut answer = message(id, 0x80, 1, &question_of(name, 1));
    answer.extend_from_slice(b"records");
    answer
}

/// A table whose ids are `ids`, in order.
fn scripted(ids: &'static [u16]) -> Pending<&'static str, impl Iterator<Item = u16>> {
    Pending::with_ids(ids.iter().copied())
}

const TIMEOUT: Duration = Duration::from_secs(2);

#[test]
fn an_id_is_never_one_a_pending_query_has() {
    let now = Instant::now();
    let mut table = scripted(&[7, 7, 7, 9, 7, 7]);
    assert_eq!(table.insert(&query(1, "a.test"), "a", now + TIMEOUT), Some(7));
    // 7 is drawn twice more while it is taken, then 9.
    assert_eq!(table.insert(&query(1, "b.test"), "b", now + TIMEOUT), Some(9));
    assert_eq!(table.answer(&answer(7, "a.test")), Answered::Query("a"));
    // Once its query is answered, 7 is free again.
    assert_eq!(table.insert(&query(1, "c.test"), "c", now + TIMEOUT), Some(7));
    assert_eq!(table.insert(&query(1, "d.test"), "d", now + TIMEOUT), None, "7 taken, then none");
    assert_eq!(table.len(), 2);
}

#[test]
fn random_ids_fill_the_table_without_a_repeat_then_it_refuses() {
    let now = Instant::now();
    let mut table = Pending::new();
    let mut ids = HashSet::new();
    for n in 0..MAX_PENDING {
        let id = table.insert(&query(1, "a.test"), n, now + TIMEOUT).expect("room");
        assert!(ids.insert(id), "id {id} given twice while pending");
    }
    assert_eq!(table.insert(&query(1, "a.test"), MAX_PENDING, now + TIMEOUT), None, "full");
    // One answered: its place goes to a query whose id no pending one has.
    let some = *ids.iter().next().unwrap();
    assert!(matches!(table.answer(&answer(some, "a.test")), Answered::Query(_)));
    ids.remove(&some);
    let id = table.insert(&query(1, "a.test"), MAX_PENDING, now + TIMEOUT).expect("room");
    assert!(!ids.contains(&id), "id {id} given twice while pending");
}

#[test]
fn random_ids_do_not_count_up_and_differ_per_table() {
    let first: Vec<u16> = RandomIds::new().take(64).collect();
    let second: Vec<u16> = RandomIds::new().take(64).collect();
    assert_ne!(first, second);
    let steps = first.windows(2).filter(|w| w[1] == w[0].wrapping_add(1)).count();
    assert!(steps < 4, "{first:?}");
}

#[test]
fn expiry_frees_the_queries_past_their_deadline_and_their_late_answers_are_unknown() {
    let now = Instant::now();
    let mut table = scripted(&[1, 2, 3]);
    table.insert(&query(10, "a.test"), "a", now + Duration::from_secs(1)).unwrap();
    table.insert(&query(20, "b.test"), "b", now + Duration::from_secs(3)).unwrap();
    table.insert(&query(30, "c.test"), "c", now + Duration::from_secs(2)).unwrap();
    assert_eq!(table.expire(now, drop), 0);
    assert_eq!(table.expire(now + Duration::from_secs(2), drop), 2, "a and c, at their deadlines");
    assert_eq!(table.len(), 1);
    assert_eq!(table.answer(&answer(1, "a.test")), Answered::Unknown, "late");
    assert_eq!(table.answer(&answer(3, "c.test")), Answered::Unknown, "late");
    assert_eq!(table.answer(&answer(2, "b.test")), Answered::Query("b"));
    assert_eq!(table.expire(now + Duration::from_secs(60), drop), 0);
}

#[test]
fn queries_left_after_an_expiry_are_still_found_by_their_ids() {
    // Expiry packs the table: every query that stays must keep its id.
    let now = Instant::now();
    let ids: Vec<u16> = (100..200).collect();
    let mut table = Pending::with_ids(ids.clone().into_iter());
    for (n, &id) in ids.iter().enumerate() {
        let deadline = now + Duration::from_secs(if n % 3 == 0 { 1 } else { 5 });
        assert_eq!(table.insert(&query(1, &format!("q{n}.test")), n, deadline), Some(id));
    }
    assert_eq!(table.expire(now + Duration::from_secs(1), drop), 34);
    for (n, &id) in ids.iter().enumerate() {
        let want = if n % 3 == 0 { Answered::Unknown } else { Answered::Query(n) };
        assert_eq!(table.answer(&answer(id, &format!("q{n}.test"))), want, "query {n}");
    }
    assert_eq!(table.len(), 0);
}

#[test]
fn an_answer_under_an_id_nobody_has_is_unknown() {
    let now = Instant::now();
    let mut table = scripted(&[7]);
    table.insert(&query(1, "a.test"), "a", now + TIMEOUT).unwrap();
    assert_eq!(table.answer(&answer(8, "a.test")), Answered::Unknown);
    assert_eq!(table.answer(&[0]), Answered::Unknown, "not even an id");
    assert_eq!(table.len(), 1, "the pending query stays");
}

#[test]
fn an_answer_must_repeat_the_query_s_question() {
    let now = Instant::now();
    let ask = |name: &str| {
        let mut table = scripted(&[7]);
        table.insert(&query(1, name), "asked", now + TIMEOUT).unwrap();
        table
    };
    let other_type = message(7, 0x80, 1, &question_of("a.test", 28));
    let cut_short = answer(7, "a.test")[..HEADER_LEN + 5].to_vec();
    let formerr = message(7, 0x81, 0, b"");
    let servfail = message(7, 0x82, 0, b"");
    let noerror_without_question = message(7, 0x80, 0, b"");
    let nxdomain_without_question = message(7, 0x83, 0, b"");
    let two_questions =
        message(7, 0x80, 2, &[question_of("a.test", 1), question_of("b", 1)].concat());
    for (what, answered, taken) in [
        ("the same", answer(7, "a.test"), true),
        ("in another case", answer(7, "A.Test"), true),
        ("another name", answer(7, "b.test"), false),
        ("another type", other_type, false),
        ("cut short", cut_short, false),
        ("FORMERR, no question", formerr, true),
        ("SERVFAIL, no question", servfail, true),
        ("NOERROR, no question", noerror_without_question, false),
        ("NXDOMAIN, no question", nxdomain_without_question, false),
        ("two questions", two_questions, false),
    ] {
        let mut table = ask("a.test");
        let want = if taken { Answered::Query("asked") } else { Answered::OtherQuestion };
        assert_eq!(table.answer(&answered), want, "{what}");
        if !taken {
            // The query still waits for its own answer.
            assert_eq!(table.answer(&answer(7, "a.test")), Answered::Query("asked"), "{what}");
        }
    }
}

#[test]
fn a_query_whose_question_is_not_read_is_answered_by_its_id() {
    let now = Instant::now();
    let compressed = message(1, 0, 1, &[0xc0, 12, 0, 1, 0, 1]);
    let overlong = message(1, 0, 1, &[[63].as_slice(), &[b'a'; 63]].concat().repeat(5));
    for (what, asked) in [
        ("no question", message(1, 0, 0, b"")),
        ("a marker, no name", message(1, 0, 1, b"answer")),
        ("a compressed name", compressed),
        ("a name past 255 bytes", overlong),
    ] {
        let mut table = scripted(&[7]);
        table.insert(&asked, "asked", now + TIMEOUT).unwrap();
        let mut answered = asked.clone();
        answered[..2].copy_from_slice(&7u16.to_be_bytes());
        answered.extend_from_slice(b", answered");
        assert_eq!(table.answer(&answered), Answered::Query("asked"), "{what}");
    }
}

#[test]
fn a_cancelled_query_frees_its_id() {
    let now = Instant::now();
    let mut table = scripted(&[7, 7]);
    let id = table.insert(&query(1, "a.test"), "a", now + TIMEOUT).unwrap();
    assert_eq!(table.cancel(id), Some("a"));
    assert_eq!(table.cancel(id), None);
    assert_eq!(table.answer(&answer(id, "a.test")), Answered::Unknown);
    assert_eq!(table.insert(&query(1, "b.test"), "b", now + TIMEOUT), Some(7));
}

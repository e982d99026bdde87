use super::*;
use crate::dataplane::nftables::changes::announced;
use crate::dataplane::nftables::expr::{
    NFT_META_L4PROTO, NFT_META_NFPROTO, NFT_SOCKET_TRANSPARENT,
};
use crate::netlink::{attr, messages, NLM_F_REQUEST};

fn nested(kind: u16, attrs: &[Vec<u8>]) -> Vec<u8> {
    attr(kind | 0x8000, &attrs.concat())
}

fn expr(name: &str, data: &[Vec<u8>]) -> Vec<u8> {
    nested(
        rule::LIST_ELEM,
        &[attr(rule::EXPR_NAME, format!("{name}\0").as_bytes()), nested(rule::EXPR_DATA, data)],
    )
}

/// `ip daddr 10.96.0.10 … notrack comment "pods"`, shortened to meta, cmp, counter, notrack.
fn rule_message() -> Vec<u8> {
    let be = |v: u32| v.to_be_bytes().to_vec();
    let attrs = [
        attr(rule::TABLE, b"nodelocaldns-ha\0"),
        attr(rule::CHAIN, b"prerouting\0"),
        attr(rule::HANDLE, &7u64.to_be_bytes()),
        nested(
            rule::EXPRESSIONS,
            &[
                expr("meta", &[attr(2, &be(NFT_META_NFPROTO)), attr(1, &be(1))]),
                expr("cmp", &[attr(1, &be(1)), attr(2, &be(0)), nested(3, &[attr(1, &[2])])]),
                expr("counter", &[attr(1, &5u64.to_be_bytes())]),
                expr("notrack", &[]),
            ],
        ),
        attr(rule::USERDATA, b"\x00\x05pods\x00"),
    ];
    let mut payload = vec![1, 0, 0, 42];
    payload.extend(attrs.concat());
    let kind = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWRULE;
    Message { kind, flags: 0, seq: 9, portid: 0, payload: &payload }.encode()
}

#[test]
fn parses_a_rule_with_comment() {
    let buf = rule_message();
    let messages: Vec<_> = messages(&buf).collect::<Result<_>>().unwrap();
    assert_eq!(messages.len(), 1);
    assert_eq!(nft_type(&messages[0]), Some(NFT_MSG_NEWRULE));
    let (generation, attrs) = nft_body(&messages[0]).unwrap();
    assert_eq!(generation, 42);
    let rule = parse_rule(attrs).unwrap();
    assert_eq!(rule.table, "nodelocaldns-ha");
    assert_eq!(rule.chain, "prerouting");
    assert_eq!(rule.handle, 7);
    assert_eq!(rule.comment.as_deref(), Some("pods"));
    assert_eq!(rule.expr_names(), ["meta", "cmp", "counter", "notrack"]);
    assert_eq!(rule.exprs[1], Found::Known(Expr::Cmp { op: 0, data: vec![2] }));
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let buf = rule_message();
    for len in 0..buf.len() {
        let cut = &buf[..len];
        for message in messages(cut) {
            let Ok(message) = message else { continue };
            if let Ok((_, attrs)) = nft_body(&message) {
                let _ = parse_rule(attrs);
            }
        }
    }
    // A header that claims more than there is.
    assert!(matches!(messages(&buf[..20]).next(), Some(Err(ParseError::Truncated { .. }))));
    // Attributes cut inside the expression list.
    let (_, attrs) = nft_body(&messages(&buf).next().unwrap().unwrap()).unwrap();
    assert!(parse_rule(&attrs[..attrs.len() - 30]).is_err());
}

#[test]
fn garbage_never_panics() {
    // A deterministic pseudo-random byte stream (xorshift), with valid-looking lengths mixed in.
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    for round in 0..2000 {
        let mut buf = Vec::new();
        for _ in 0..(round % 97) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            buf.push(state as u8);
        }
        if buf.len() >= 4 && round % 3 == 0 {
            let len = buf.len() as u32;
            buf[..4].copy_from_slice(&len.to_ne_bytes());
        }
        for message in messages(&buf) {
            let Ok(message) = message else { continue };
            let _ = message.error_code();
            if let Ok((_, attrs)) = nft_body(&message) {
                let _ = parse_table(attrs);
                let _ = parse_chain(attrs);
                let _ = parse_rule(attrs);
            }
        }
        let _ = parse_rule(&buf);
        let _ = parse_expr("cmp", &buf);
        let _ = parse_comment(&buf);
        let _ = announced(&buf, Some(1));
    }
}

#[test]
fn parses_a_base_chain() {
    let attrs = [
        attr(chain::TABLE, b"nodelocaldns-ha\0"),
        attr(chain::NAME, b"output\0"),
        nested(
            chain::HOOK,
            &[
                attr(chain::HOOK_HOOKNUM, &3u32.to_be_bytes()),
                attr(chain::HOOK_PRIORITY, &(-310i32).to_be_bytes()),
            ],
        ),
        attr(chain::POLICY, &1u32.to_be_bytes()),
        attr(chain::TYPE, b"filter\0"),
    ]
    .concat();
    let chain = parse_chain(&attrs).unwrap();
    assert_eq!(
        chain,
        Chain {
            table: "nodelocaldns-ha".to_owned(),
            name: "output".to_owned(),
            hook: Some(ChainHook { hooknum: 3, priority: -310 }),
            chain_type: Some("filter".to_owned()),
            policy: Some(1),
        }
    );
    // A 2-byte priority is a size error.
    let bad = nested(chain::HOOK, &[attr(chain::HOOK_HOOKNUM, &[0, 3])]);
    let attrs = [attr(chain::TABLE, b"t\0"), attr(chain::NAME, b"c\0"), bad].concat();
    assert!(parse_chain(&attrs).is_err());
}

#[test]
fn parses_table_flags() {
    let attrs =
        [attr(table::NAME, b"nodelocaldns-ha\0"), attr(table::FLAGS, &1u32.to_be_bytes())].concat();
    assert_eq!(
        parse_table(&attrs).unwrap(),
        Table { name: "nodelocaldns-ha".to_owned(), flags: 1 }
    );
    assert_eq!(parse_table(&[]).unwrap_err(), ParseError::Missing("table name"));
}

#[test]
fn comments() {
    assert_eq!(parse_comment(b"\x00\x03hi\x00").as_deref(), Some("hi"));
    // Another TLV first.
    assert_eq!(parse_comment(b"\x05\x01x\x00\x03hi\x00").as_deref(), Some("hi"));
    assert_eq!(parse_comment(b"\x00\x09hi\x00"), None);
    assert_eq!(parse_comment(b"\x00"), None);
    assert_eq!(parse_comment(b""), None);
}

#[test]
fn unknown_and_unusual_expressions_are_other() {
    assert_eq!(parse_expr("immediate", &[]).unwrap(), Found::Other("immediate".to_owned()));
    // `meta mark set`: a key and a source register.
    let set = [attr(2, &3u32.to_be_bytes()), attr(3, &1u32.to_be_bytes())].concat();
    assert_eq!(parse_expr("meta", &set).unwrap(), Found::Other("meta".to_owned()));
    let socket =
        [attr(1, &NFT_SOCKET_TRANSPARENT.to_be_bytes()), attr(2, &1u32.to_be_bytes())].concat();
    assert_eq!(parse_expr("socket", &socket).unwrap(), Found::Known(Expr::Socket { key: 0 }));
    let meta = [attr(1, &1u32.to_be_bytes()), attr(2, &NFT_META_L4PROTO.to_be_bytes())].concat();
    assert_eq!(parse_expr("meta", &meta).unwrap(), Found::Known(Expr::Meta { key: 16 }));
    assert!(parse_expr("meta", &[]).is_err());
}

#[test]
fn request_round_trips() {
    let buf =
        request(NFT_MSG_GETTABLE, NLM_F_REQUEST, 77, 1, &[(NFTA_TABLE_NAME, b"nodelocaldns-ha\0")]);
    assert_eq!(buf.len() % 4, 0);
    let message = messages(&buf).next().unwrap().unwrap();
    assert_eq!(nft_type(&message), Some(NFT_MSG_GETTABLE));
    assert_eq!((message.flags, message.seq), (NLM_F_REQUEST, 77));
    let (_, attrs) = nft_body(&message).unwrap();
    assert_eq!(parse_table(attrs).unwrap().name, "nodelocaldns-ha");
}

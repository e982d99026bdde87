//! The reviewed unsafe module of the nftables backend: it turns an [`Expr`] into a libnftnl
//! expression so `nftnl::Rule::add_expr` can serialise it.
//!
//! nftnl has no `fib`, `notrack`, `tproxy` or `ct set` expression and its `socket` one sends an attribute
//! `nft` does not, so every expression goes through this one generic implementation instead: a pure table
//! ([`nftnl_form`]) says which libnftnl attributes to set, and one small function makes the calls.
//! libnftnl then encodes the attributes exactly as it does for `nft`, which uses the same calls.
//! Nothing else in the backend uses `unsafe`.

use std::ffi::{c_void, CStr};
use std::ptr::NonNull;

use nftnl::nftnl_sys as sys;

use super::expr::{Expr, NFT_REG_1, NFT_REG_2, NFT_REG_VERDICT, NF_ACCEPT};

/// One libnftnl attribute value.
enum Value<'a> {
    U32(u32),
    U64(u64),
    Bytes(&'a [u8]),
}

/// The libnftnl expression name and the `NFTNL_EXPR_*` attributes `nft` sets for `expr`.
fn nftnl_form(expr: &Expr) -> (&'static CStr, Vec<(u32, Value<'_>)>) {
    use Value::{Bytes, U32, U64};
    match expr {
        Expr::Meta { key } => (
            c"meta",
            vec![
                (sys::NFTNL_EXPR_META_KEY, U32(*key)),
                (sys::NFTNL_EXPR_META_DREG, U32(NFT_REG_1)),
            ],
        ),
        Expr::Payload { base, offset, len } => (
            c"payload",
            vec![
                (sys::NFTNL_EXPR_PAYLOAD_DREG, U32(NFT_REG_1)),
                (sys::NFTNL_EXPR_PAYLOAD_BASE, U32(*base)),
                (sys::NFTNL_EXPR_PAYLOAD_OFFSET, U32(*offset)),
                (sys::NFTNL_EXPR_PAYLOAD_LEN, U32(*len)),
            ],
        ),
        Expr::Cmp { op, data } => (
            c"cmp",
            vec![
                (sys::NFTNL_EXPR_CMP_SREG, U32(NFT_REG_1)),
                (sys::NFTNL_EXPR_CMP_OP, U32(*op)),
                (sys::NFTNL_EXPR_CMP_DATA, Bytes(data)),
            ],
        ),
        Expr::Fib { flags, result } => (
            c"fib",
            vec![
                (sys::NFTNL_EXPR_FIB_DREG, U32(NFT_REG_1)),
                (sys::NFTNL_EXPR_FIB_RESULT, U32(*result)),
                (sys::NFTNL_EXPR_FIB_FLAGS, U32(*flags)),
            ],
        ),
        // `nft` sets no level for `transparent`; nftnl's own `Socket` would send one.
        Expr::Socket { key } => (
            c"socket",
            vec![
                (sys::NFTNL_EXPR_SOCKET_KEY, U32(*key)),
                (sys::NFTNL_EXPR_SOCKET_DREG, U32(NFT_REG_1)),
            ],
        ),
        Expr::Ct { key } => (
            c"ct",
            vec![(sys::NFTNL_EXPR_CT_KEY, U32(*key)), (sys::NFTNL_EXPR_CT_DREG, U32(NFT_REG_1))],
        ),
        Expr::CtSet { key } => (
            c"ct",
            vec![(sys::NFTNL_EXPR_CT_KEY, U32(*key)), (sys::NFTNL_EXPR_CT_SREG, U32(NFT_REG_1))],
        ),
        Expr::Counter => (
            c"counter",
            vec![(sys::NFTNL_EXPR_CTR_PACKETS, U64(0)), (sys::NFTNL_EXPR_CTR_BYTES, U64(0))],
        ),
        Expr::Notrack => (c"notrack", Vec::new()),
        Expr::Immediate { dreg, data } => (
            c"immediate",
            vec![(sys::NFTNL_EXPR_IMM_DREG, U32(*dreg)), (sys::NFTNL_EXPR_IMM_DATA, Bytes(data))],
        ),
        Expr::Accept => (
            c"immediate",
            vec![
                (sys::NFTNL_EXPR_IMM_DREG, U32(NFT_REG_VERDICT)),
                (sys::NFTNL_EXPR_IMM_VERDICT, U32(NF_ACCEPT)),
            ],
        ),
        Expr::Tproxy { family } => (
            c"tproxy",
            vec![
                (sys::NFTNL_EXPR_TPROXY_FAMILY, U32(*family)),
                (sys::NFTNL_EXPR_TPROXY_REG_ADDR, U32(NFT_REG_1)),
                (sys::NFTNL_EXPR_TPROXY_REG_PORT, U32(NFT_REG_2)),
            ],
        ),
    }
}

impl nftnl::expr::Expression for Expr {
    fn to_expr(&self, _rule: &nftnl::Rule) -> NonNull<sys::nftnl_expr> {
        let (name, attrs) = nftnl_form(self);
        // SAFETY: `name` is a NUL-terminated static string, which libnftnl only reads.
        let raw = unsafe { sys::nftnl_expr_alloc(name.as_ptr()) };
        let Some(expr) = NonNull::new(raw) else {
            // Out of memory for a few bytes (every name above is one libnftnl ≥ 1.2 knows):
            // abort, as nftnl and std do.
            std::process::abort();
        };
        for (attr, value) in attrs {
            // Attribute numbers are below 16, so the cast is lossless.
            let attr = attr as u16;
            match value {
                // SAFETY: `expr` is the live expression allocated above and owned here; `attr` is
                // an attribute of this expression type; the value is passed by copy.
                Value::U32(v) => unsafe { sys::nftnl_expr_set_u32(expr.as_ptr(), attr, v) },
                // SAFETY: as above.
                Value::U64(v) => unsafe { sys::nftnl_expr_set_u64(expr.as_ptr(), attr, v) },
                Value::Bytes(data) => {
                    // SAFETY: as above; the pointer and length describe `data`, which outlives the
                    // call, and libnftnl copies the bytes. It refuses data longer than a register
                    // (16 bytes, never written here) by returning -1 and leaving the attribute
                    // unset, which the kernel then rejects with the whole batch: no memory issue.
                    unsafe {
                        sys::nftnl_expr_set(
                            expr.as_ptr(),
                            attr,
                            data.as_ptr().cast::<c_void>(),
                            data.len() as u32,
                        )
                    };
                }
            }
        }
        // Ownership passes to the caller (`nftnl::Rule::add_expr` hands it to the rule).
        expr
    }
}

//! What a public client sees when a generation fails: a code, a short reason and a request id;
//! the detail (verify node addresses, engine errors) goes to this node's log under that id.
//! Both front ends (gRPC `Generate`, the HTTP API) use these.

use std::sync::atomic::{AtomicU64, Ordering};
use tonic::Status;

/// A random-looking id for one request, for the client and the log lines about it.
pub fn request_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(NEXT.fetch_add(1, Ordering::Relaxed));
    format!("{:016x}", h.finish())
}

pub(crate) fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// What a public client sees of a failed generation: the status code, a short reason it can act
/// on, and the request id. The detail (verify node addresses, engine errors) goes to this
/// node's log under the same request id.
pub fn public_status(s: &Status, id: &str) -> Status {
    use tonic::Code::*;
    let (code, reason) = match s.code() {
        Unavailable => (
            Unavailable,
            "no verify node could serve this generation right now; retry later",
        ),
        ResourceExhausted => (
            ResourceExhausted,
            "the verify nodes cannot take this generation now (session or context limits); retry later or ask for fewer tokens",
        ),
        FailedPrecondition => (
            FailedPrecondition,
            "this deployment's draft and verify nodes are incompatible (tokenizer or protocol version); the operator must fix it",
        ),
        DeadlineExceeded => (DeadlineExceeded, "a verify step did not finish in time; retry"),
        Cancelled => (Cancelled, "the generation was cancelled"),
        _ => (Internal, "internal error"),
    };
    Status::new(
        code,
        format!("{reason} (request id {id}; the detail is in the draft-service log)"),
    )
}

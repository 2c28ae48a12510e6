//! The decode fallback (docs/ALGORITHMS.md §5.5): when no tree pays, the draft node asks the
//! verify node to decode up to K tokens with the target alone, and the tokens stream back as
//! they are sampled. The pair then pays one round trip per K tokens instead of one per token.
//!
//! Exactness: each decoded token is verified as a root-only tree would be — the same
//! [`VerifySession::prepare`] / forward / [`VerifySession::finish`], so the same sampling rule,
//! the same random stream and one step number per token. A decode of K tokens is therefore
//! bit-identical to K root-only trees, i.e. plain target decoding. With batching on, every
//! token is a one-row entry of the shared forwards.

use crate::service::{blocking, to_status, VerifyState};
use crate::session::{Prepared, VerifySession};
use sequoia_core::limits::{DECODE_PROTOCOL_VERSION, MAX_DECODE_TOKENS};
use sequoia_proto::v1::{session_response, DecodeTokens, Decoded, SessionResponse};
use sequoia_server::process::secs;
use std::sync::Arc;
use tokio::sync::mpsc;
use tonic::Status;

/// Check a `decode` against the session before any model work. `version` is the protocol
/// version the session negotiated at `open`.
pub fn check_decode(
    req: &DecodeTokens,
    session: &VerifySession,
    vocab: usize,
    version: u32,
) -> Result<(), Status> {
    if version < DECODE_PROTOCOL_VERSION {
        return Err(Status::failed_precondition(format!(
            "decode needs protocol version {DECODE_PROTOCOL_VERSION} or later; this session opened with version {version}"
        )));
    }
    if req.max_tokens == 0 || req.max_tokens > MAX_DECODE_TOKENS {
        return Err(Status::invalid_argument(format!(
            "decode.max_tokens: {} is outside 1..={MAX_DECODE_TOKENS}",
            req.max_tokens
        )));
    }
    if req.root as usize >= vocab {
        return Err(Status::invalid_argument(format!(
            "decode.root = {} is outside the vocabulary (size {vocab})",
            req.root
        )));
    }
    if req.step != session.next_step() {
        return Err(Status::invalid_argument(format!(
            "decode.step: expected {}, got {} (every tree and every decoded token is one step, in order from 0)",
            session.next_step(),
            req.step
        )));
    }
    if session.tokens_left() == 0 {
        return Err(Status::resource_exhausted(
            "decode: the session has committed all of its open's max_new_tokens",
        ));
    }
    Ok(())
}

/// What became of a decode.
pub enum Outcome {
    /// Done (all tokens sent); the session goes on.
    Done(VerifySession),
    /// The caller went away.
    ClientGone,
}

/// Decode on `session` and stream the tokens to `tx`. The request must have passed
/// [`check_decode`]. Between tokens, a draining node hands the session over (UNAVAILABLE: the
/// draft continues on another node from the tokens it has).
pub async fn decode(
    state: &Arc<VerifyState>,
    mut session: VerifySession,
    req: DecodeTokens,
    tx: &mpsc::Sender<Result<SessionResponse, Status>>,
    moving: &tokio::sync::watch::Receiver<bool>,
) -> Result<Outcome, Status> {
    let eos = state.tokenizer.eos_ids().to_vec();
    let want = (req.max_tokens as usize).min(session.tokens_left());
    let per_message = (req.tokens_per_message as usize).clamp(1, want.max(1));
    let (mut root, mut step) = (req.root, req.step);
    let mut out = Decoded {
        step,
        ..Decoded::default()
    };
    for i in 0..want {
        if *moving.borrow() {
            return Err(Status::unavailable(
                "verify node is shutting down; the session continues on another node",
            ));
        }
        let model = state.model.clone();
        // A root forwarded while the session waited gives the verdict with no forward.
        let r = match &state.scheduler {
            Some(scheduler) => match session
                .prepare_step(&model, step, &[-1], &[root], Vec::new())
                .map_err(to_status)?
            {
                Prepared::Done(r) => r,
                Prepared::Tree(prepared) => {
                    let (back, r) = scheduler
                        .verify(session, prepared)
                        .await
                        .map_err(to_status)?;
                    session = back;
                    r
                }
            },
            None => {
                let (back, r) = blocking(move || {
                    let r = session.verify(&model, step, &[-1], &[root], &[]);
                    (session, r)
                })
                .await?;
                session = back;
                r.map_err(to_status)?
            }
        };
        state
            .metrics
            .step(1, std::iter::empty(), secs(r.verify_ms / 1e3));
        let token = r.verdict.next_token;
        out.tokens.push(token);
        out.verify_ms += r.verify_ms;
        out.batch_rows = u32::try_from(r.batch_rows).unwrap_or(u32::MAX);
        out.batch_sessions = u32::try_from(r.batch_sessions).unwrap_or(u32::MAX);
        (root, step) = (token, step + 1);
        let last = i + 1 == want || eos.contains(&token);
        if out.tokens.len() >= per_message || last {
            out.done = last;
            let msg = std::mem::replace(
                &mut out,
                Decoded {
                    step,
                    ..Decoded::default()
                },
            );
            let sent = tx
                .send(Ok(SessionResponse {
                    msg: Some(session_response::Msg::Decoded(msg)),
                }))
                .await;
            if sent.is_err() {
                return Ok(Outcome::ClientGone);
            }
        }
        if last {
            break;
        }
    }
    Ok(Outcome::Done(session))
}

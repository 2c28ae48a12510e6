//! Issue 17: no resource held by a silent or hostile peer, no panic on any input. A fake verify
//! node (a small Verifier server in this file) misbehaves in every way the draft side must
//! survive; silent clients must not hold verify-node slots; every message that crosses the
//! network is fuzzed for panics.

use draft_service::config::DraftConfig;
use proptest::prelude::*;
use sequoia_core::limits;
use sequoia_core::sampling::{SamplingParams, SparseDist};
use sequoia_engine::tokenizer::TextTokenizer;
use sequoia_engine::{LoadOptions, Model};
use sequoia_proto::v1 as pb;
use sequoia_proto::v1::verifier_client::VerifierClient;
use sequoia_proto::v1::verifier_server::{Verifier, VerifierServer};
use sequoia_tests::*;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request, Response, Status, Streaming};
use verify_service::session::{SessionError, SessionLimits, VerifySession};

// ---------------------------------------------------------------------------------------------
// A fake verify node
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// Correct answers: accept nothing, send a valid next token.
    Good,
    OutOfRange,
    WrongRankCount,
    NanTime,
    InfTime,
    NegativeTime,
    TokenOutsideVocab,
    WrongStep,
    /// Ends the stream (OK) instead of answering the first tree.
    CloseMidStep,
    /// Never answers a tree.
    Silent,
}

#[derive(Clone)]
struct Fake {
    mode: Mode,
    fingerprint: String,
    /// (min, max) protocol versions reported in Info; (0, 0) = a node from before versioning.
    versions: (u32, u32),
    next_token: u32,
    /// `decode` requests received (an old-protocol node must never get one).
    decodes: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

#[tonic::async_trait]
impl Verifier for Fake {
    type SessionStream = ReceiverStream<Result<pb::SessionResponse, Status>>;

    async fn session(
        &self,
        request: Request<Streaming<pb::SessionRequest>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let fake = self.clone();
        tokio::spawn(async move {
            let reply = |m| Ok(pb::SessionResponse { msg: Some(m) });
            while let Ok(Some(msg)) = inbound.message().await {
                match msg.msg {
                    Some(pb::session_request::Msg::Open(o)) => {
                        let opened = pb::SessionOpened {
                            context_limit: 1024,
                            protocol_version: o.protocol_version.min(fake.versions.1),
                            ..Default::default()
                        };
                        let _ = tx
                            .send(reply(pb::session_response::Msg::Opened(opened)))
                            .await;
                    }
                    Some(pb::session_request::Msg::Tree(t)) => {
                        let mut v = pb::Verdict {
                            step: t.step,
                            next_token: fake.next_token,
                            verify_ms: 1.0,
                            ..Default::default()
                        };
                        match fake.mode {
                            Mode::Good => {}
                            Mode::OutOfRange => {
                                v.accepted_nodes = vec![9999];
                                v.accepted_ranks = vec![1];
                            }
                            Mode::WrongRankCount => v.accepted_ranks = vec![1, 2, 3],
                            Mode::NanTime => v.verify_ms = f64::NAN,
                            Mode::InfTime => v.verify_ms = f64::INFINITY,
                            Mode::NegativeTime => v.verify_ms = -5.0,
                            Mode::TokenOutsideVocab => v.next_token = u32::MAX,
                            Mode::WrongStep => v.step = t.step + 7,
                            Mode::CloseMidStep => return,
                            Mode::Silent => {
                                tokio::time::sleep(Duration::from_secs(3600)).await;
                                return;
                            }
                        }
                        let _ = tx.send(reply(pb::session_response::Msg::Verdict(v))).await;
                    }
                    Some(pb::session_request::Msg::Decode(d)) => {
                        fake.decodes
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        // A node from before the decode fallback has no such message: it
                        // refuses the stream (as an old prost decoder would see no `msg`).
                        if fake.versions.1 < limits::DECODE_PROTOCOL_VERSION {
                            let _ = tx
                                .send(Err(Status::invalid_argument("unknown message")))
                                .await;
                            return;
                        }
                        let n = d.max_tokens.min(limits::MAX_DECODE_TOKENS) as usize;
                        let out = pb::Decoded {
                            step: d.step,
                            tokens: vec![fake.next_token; n],
                            done: true,
                            verify_ms: 1.0,
                            ..Default::default()
                        };
                        let _ = tx
                            .send(reply(pb::session_response::Msg::Decoded(out)))
                            .await;
                    }
                    None => return,
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn info(
        &self,
        _: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::InfoResponse>, Status> {
        Ok(Response::new(pb::InfoResponse {
            model_name: "fake".into(),
            vocab_size: sequoia_engine::tokenizer::testing::TINY_VOCAB_SIZE as u32,
            tokenizer_fingerprint: self.fingerprint.clone(),
            max_context: 1024,
            max_sessions: 16,
            max_tree_nodes: 512,
            min_protocol_version: self.versions.0,
            protocol_version: self.versions.1,
            ..Default::default()
        }))
    }

    async fn profile(
        &self,
        _: Request<pb::ProfileRequest>,
    ) -> Result<Response<pb::ProfileResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn ping(
        &self,
        _: Request<pb::PingRequest>,
    ) -> Result<Response<pb::PingResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
}

/// Serve `fake` on an ephemeral port of `rt`.
fn start_fake(rt: &tokio::runtime::Runtime, fake: Fake) -> String {
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr: SocketAddr = listener.local_addr().unwrap();
    rt.spawn(
        tonic::transport::Server::builder()
            .add_service(VerifierServer::new(fake))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    format!("http://{addr}")
}

fn good_fake(pair: &TinyPair, mode: Mode) -> Fake {
    let tok = TextTokenizer::load_for_model(&pair.draft).unwrap();
    let next_token = (10u32..).find(|t| !tok.eos_ids().contains(t)).unwrap();
    Fake {
        mode,
        fingerprint: tok.fingerprint().to_string(),
        versions: (limits::MIN_PROTOCOL_VERSION, limits::PROTOCOL_VERSION),
        next_token,
        decodes: Default::default(),
    }
}

fn fast_draft(pair: &TinyPair, verify: &[String]) -> DraftConfig {
    DraftConfig {
        step_timeout_secs: 1.0,
        connect_timeout_secs: 2.0,
        ..draft_config(&pair.draft, verify, 4, 3)
    }
}

/// The client sees either a summary or an error, never a stream that just ends.
fn summary_or_error(r: &Result<Generated, Status>) {
    if let Ok(g) = r {
        assert!(
            g.summary.is_some(),
            "the stream ended without a summary or an error"
        );
    }
}

#[test]
fn hostile_verify_node_answers_give_a_clear_status_never_a_panic() {
    let pair = TinyPair::new();
    let rt = tokio::runtime::Runtime::new().unwrap();
    for mode in [
        Mode::OutOfRange,
        Mode::WrongRankCount,
        Mode::NanTime,
        Mode::InfTime,
        Mode::NegativeTime,
        Mode::TokenOutsideVocab,
        Mode::WrongStep,
        Mode::CloseMidStep,
        Mode::Silent,
    ] {
        let url = start_fake(&rt, good_fake(&pair, mode));
        let draft = start_draft(fast_draft(&pair, &[url.clone()]));
        let r = rt.block_on(within(
            60,
            generate(&draft.url(), request("hello", 8, 0.0, 1)),
        ));
        summary_or_error(&r);
        let err = r.expect_err(&format!("{mode:?}: a hostile node's answers were accepted"));
        assert_eq!(err.code(), Code::Unavailable, "{mode:?}: {err:?}");
        assert!(err.message().contains("request id"), "{mode:?}: {err:?}");
        assert!(
            !err.message().contains(&url),
            "{mode:?} leaks the node: {err:?}"
        );
    }
}

#[test]
fn generation_fails_over_from_a_hostile_node_to_a_good_one() {
    let pair = TinyPair::new();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let bad = start_fake(&rt, good_fake(&pair, Mode::OutOfRange));
    let verify = start_verify(verify_config(&pair.target));
    let draft = start_draft(fast_draft(&pair, &[bad, verify.url()]));
    for seed in 0..3 {
        let r = rt.block_on(within(
            60,
            generate(&draft.url(), request("hello", 8, 0.0, seed)),
        ));
        let g = r.expect("the good node serves it");
        assert!(g.summary.is_some());
        assert_eq!(g.tokens, plain_greedy(&pair.target, "hello", 8));
    }
}

#[test]
fn multibyte_fingerprint_from_a_verify_node_does_not_panic() {
    let pair = TinyPair::new();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let fake = Fake {
        fingerprint: "é".repeat(20),
        ..good_fake(&pair, Mode::Good)
    };
    let draft = start_draft(fast_draft(&pair, &[start_fake(&rt, fake)]));
    let r = rt.block_on(within(
        60,
        generate(&draft.url(), request("hello", 8, 0.0, 1)),
    ));
    summary_or_error(&r);
    let err = r.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("tokenizer"), "{err:?}");
}

// ---------------------------------------------------------------------------------------------
// Protocol versions
// ---------------------------------------------------------------------------------------------

#[test]
fn old_protocol_verify_node_works_and_a_too_new_one_is_refused() {
    let pair = TinyPair::new();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let old = Fake {
        versions: (0, 0),
        ..good_fake(&pair, Mode::Good)
    };
    let draft = start_draft(fast_draft(&pair, &[start_fake(&rt, old)]));
    let g = rt
        .block_on(within(
            60,
            generate(&draft.url(), request("hello", 4, 0.0, 1)),
        ))
        .expect("an unversioned (v1) node still works");
    assert!(g.summary.is_some());

    let new = Fake {
        versions: (limits::PROTOCOL_VERSION + 1, limits::PROTOCOL_VERSION + 2),
        ..good_fake(&pair, Mode::Good)
    };
    let draft = start_draft(fast_draft(&pair, &[start_fake(&rt, new)]));
    let err = rt
        .block_on(within(
            60,
            generate(&draft.url(), request("hello", 4, 0.0, 1)),
        ))
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("protocol"), "{err:?}");
}

/// The decode fallback needs protocol version 3: a draft whose plan is no speculation sends a
/// node that speaks only version 2 root-only trees, never a `decode`; a current node gets
/// decodes (so the first half could fail).
#[test]
fn old_protocol_verify_node_never_gets_a_decode() {
    let pair = TinyPair::new();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let no_speculation = |url: String| {
        let mut c = fast_draft(&pair, &[url]);
        c.tree.nodes = 1;
        c.tree.max_levels = 1;
        start_draft(c)
    };
    let old = Fake {
        versions: (1, limits::DECODE_PROTOCOL_VERSION - 1),
        ..good_fake(&pair, Mode::Good)
    };
    let old_decodes = old.decodes.clone();
    let draft = no_speculation(start_fake(&rt, old));
    let g = rt
        .block_on(within(
            60,
            generate(&draft.url(), request("hello", 6, 0.0, 1)),
        ))
        .expect("an old node serves root-only trees");
    let s = g.summary.unwrap();
    assert_eq!(s.generated_tokens, 6);
    assert_eq!(s.steps, 6, "one root-only tree per token");
    assert_eq!(s.fallback_tokens, 0);
    assert_eq!(old_decodes.load(std::sync::atomic::Ordering::Relaxed), 0);

    let new = good_fake(&pair, Mode::Good);
    let new_decodes = new.decodes.clone();
    let draft = no_speculation(start_fake(&rt, new));
    let g = rt
        .block_on(within(
            60,
            generate(&draft.url(), request("hello", 6, 0.0, 1)),
        ))
        .expect("a current node decodes");
    let s = g.summary.unwrap();
    assert_eq!(s.fallback_tokens, 6);
    assert!(new_decodes.load(std::sync::atomic::Ordering::Relaxed) > 0);
}

fn open_msg(version: u32) -> pb::SessionRequest {
    pb::SessionRequest {
        msg: Some(pb::session_request::Msg::Open(pb::OpenSession {
            prefix_tokens: vec![1, 2, 3],
            max_new_tokens: 8,
            protocol_version: version,
            ..Default::default()
        })),
    }
}

#[test]
fn verify_node_negotiates_the_protocol_at_open() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_config(&pair.target));
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(within(60, async {
        let mut c = VerifierClient::connect(verify.url()).await.unwrap();
        let info = c.info(pb::InfoRequest {}).await.unwrap().into_inner();
        assert_eq!(info.protocol_version, limits::PROTOCOL_VERSION);
        assert_eq!(info.min_protocol_version, limits::MIN_PROTOCOL_VERSION);
        // An old draft (no version field) gets version 1.
        let (tx, rx) = mpsc::channel(2);
        tx.send(open_msg(0)).await.unwrap();
        let mut s = c
            .session(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        match s.message().await.unwrap().unwrap().msg {
            Some(pb::session_response::Msg::Opened(o)) => assert_eq!(o.protocol_version, 1),
            other => panic!("{other:?}"),
        }
        // A draft too new for this node is refused with a message.
        let (tx2, rx2) = mpsc::channel(2);
        tx2.send(open_msg(limits::PROTOCOL_VERSION + 5))
            .await
            .unwrap();
        let mut s2 = c
            .session(ReceiverStream::new(rx2))
            .await
            .unwrap()
            .into_inner();
        let err = s2.message().await.unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
        assert!(err.message().contains("protocol"), "{err:?}");
        drop(tx);
    }));
}

// ---------------------------------------------------------------------------------------------
// Silent and slow clients of a verify node
// ---------------------------------------------------------------------------------------------

#[test]
fn silent_session_stream_holds_no_slot_and_is_closed_by_its_deadline() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_service::config::VerifyConfig {
        max_sessions: 1,
        open_timeout_secs: 0.3,
        ..verify_config(&pair.target)
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(within(60, async {
        let mut c = VerifierClient::connect(verify.url()).await.unwrap();
        // Two streams that never send anything.
        let (_keep1, rx1) = mpsc::channel::<pb::SessionRequest>(1);
        let (_keep2, rx2) = mpsc::channel::<pb::SessionRequest>(1);
        let mut silent1 = c
            .session(ReceiverStream::new(rx1))
            .await
            .unwrap()
            .into_inner();
        let _silent2 = c
            .session(ReceiverStream::new(rx2))
            .await
            .unwrap()
            .into_inner();
        // Another client still gets the node's only slot.
        let mut other = VerifierClient::connect(verify.url()).await.unwrap();
        let (tx, rx) = mpsc::channel(2);
        tx.send(open_msg(limits::PROTOCOL_VERSION)).await.unwrap();
        let mut s = other
            .session(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let first = s
            .message()
            .await
            .expect("a silent stream must not hold the slot");
        assert!(matches!(
            first.unwrap().msg,
            Some(pb::session_response::Msg::Opened(_))
        ));
        // The silent stream is ended by its deadline (0.3 s; generous bound).
        let err = tokio::time::timeout(Duration::from_secs(10), silent1.message())
            .await
            .expect("the silent stream was not closed")
            .unwrap_err();
        assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
        drop(tx);
    }));
}

#[test]
fn idle_session_is_closed_and_its_slot_freed() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_service::config::VerifyConfig {
        max_sessions: 1,
        idle_timeout_secs: 0.3,
        ..verify_config(&pair.target)
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(within(60, async {
        let mut c = VerifierClient::connect(verify.url()).await.unwrap();
        let (tx, rx) = mpsc::channel(2);
        tx.send(open_msg(limits::PROTOCOL_VERSION)).await.unwrap();
        let mut s = c
            .session(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        assert!(s.message().await.unwrap().is_some());
        let err = tokio::time::timeout(Duration::from_secs(10), s.message())
            .await
            .expect("the idle session was not closed")
            .unwrap_err();
        assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
        let mut freed = false;
        for _ in 0..100 {
            let info = c.info(pb::InfoRequest {}).await.unwrap().into_inner();
            if info.active_sessions == 0 {
                freed = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(freed, "the idle session's slot was not freed");
        drop(tx);
    }));
}

#[test]
fn profile_work_is_bounded() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_config(&pair.target));
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(within(60, async {
        let mut c = VerifierClient::connect(verify.url()).await.unwrap();
        let err = c
            .profile(pb::ProfileRequest {
                tree_sizes: vec![1; 100_000],
                context_length: 8,
                repeats: u32::MAX,
            })
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
        assert!(err.message().contains("tree_sizes"), "{err:?}");
        let ok = c
            .profile(pb::ProfileRequest {
                tree_sizes: vec![1, 2],
                context_length: 8,
                repeats: u32::MAX,
            })
            .await
            .expect("a bounded profile runs")
            .into_inner();
        assert_eq!(ok.forward_ms.len(), 2);
    }));
}

// ---------------------------------------------------------------------------------------------
// Connection limits, half-open peers, cancelled work, clients that stop reading
// ---------------------------------------------------------------------------------------------

/// `active_sessions` as Info reports it, asked on a connection of its own.
async fn active_sessions(url: &str) -> u32 {
    let mut c = VerifierClient::connect(url.to_string()).await.unwrap();
    c.info(pb::InfoRequest {})
        .await
        .unwrap()
        .into_inner()
        .active_sessions
}

/// Poll until the node reports `want` open sessions; false after `secs`.
async fn reaches_active(url: &str, want: u32, secs: u64) -> bool {
    for _ in 0..secs * 10 {
        if active_sessions(url).await == want {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

type OpenStream = (
    mpsc::Sender<pb::SessionRequest>,
    Streaming<pb::SessionResponse>,
);

/// Open a session on `c` and wait for `Opened`.
async fn open_session(c: &mut VerifierClient<tonic::transport::Channel>) -> OpenStream {
    let (tx, rx) = mpsc::channel(2);
    tx.send(open_msg(limits::PROTOCOL_VERSION)).await.unwrap();
    let mut s = c
        .session(ReceiverStream::new(rx))
        .await
        .expect("session stream")
        .into_inner();
    let first = s.message().await.expect("opened").expect("stream open");
    assert!(matches!(
        first.msg,
        Some(pb::session_response::Msg::Opened(_))
    ));
    (tx, s)
}

#[test]
fn one_connection_cannot_open_more_streams_than_its_cap() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_service::config::VerifyConfig {
        max_concurrent_streams: 2,
        ..verify_config(&pair.target)
    });
    let url = verify.url();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(within(60, async {
        // One HTTP/2 connection shared by every call below.
        let channel = tonic::transport::Endpoint::from_shared(url.clone())
            .unwrap()
            .connect()
            .await
            .unwrap();
        let first = open_session(&mut VerifierClient::new(channel.clone())).await;
        let _second = open_session(&mut VerifierClient::new(channel.clone())).await;
        let mut c3 = VerifierClient::new(channel.clone());
        let third = tokio::spawn(async move { open_session(&mut c3).await });
        tokio::time::sleep(Duration::from_millis(500)).await;
        // The node has room for 64 sessions; only the per-connection cap holds the third back.
        assert_eq!(
            active_sessions(&url).await,
            2,
            "a third stream got past the cap"
        );
        assert!(!third.is_finished());
        // When one stream ends, the waiting one gets its turn on the same connection.
        drop(first);
        let _third = tokio::time::timeout(Duration::from_secs(30), third)
            .await
            .expect("the third stream opens once another ends")
            .unwrap();
        assert_eq!(active_sessions(&url).await, 2);
    }));
}

/// A TCP proxy that can be frozen: from then on it forwards nothing in either direction but
/// keeps both sockets open, like a peer whose machine vanished (a half-open connection).
async fn freezable_proxy(
    upstream: SocketAddr,
) -> (SocketAddr, std::sync::Arc<std::sync::atomic::AtomicBool>) {
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let frozen = std::sync::Arc::new(AtomicBool::new(false));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let f = frozen.clone();
    tokio::spawn(async move {
        while let Ok((down, _)) = listener.accept().await {
            let Ok(up) = tokio::net::TcpStream::connect(upstream).await else {
                continue;
            };
            let (dr, dw) = down.into_split();
            let (ur, uw) = up.into_split();
            for (mut r, mut w) in [
                (
                    Box::new(dr) as Box<dyn tokio::io::AsyncRead + Send + Unpin>,
                    Box::new(uw) as Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
                ),
                (Box::new(ur) as _, Box::new(dw) as _),
            ] {
                let f = f.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 16 * 1024];
                    loop {
                        let n = match r.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        if f.load(Ordering::Relaxed) {
                            // Hold both sockets, forward nothing, forever.
                            std::future::pending::<()>().await;
                        }
                        if w.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        }
    });
    (addr, frozen)
}

#[test]
fn half_open_connection_is_dropped_by_keepalive_and_its_slot_freed() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_service::config::VerifyConfig {
        keepalive_secs: 0.3,
        // Only the keepalive can notice this peer is gone.
        idle_timeout_secs: 3600.0,
        ..verify_config(&pair.target)
    });
    let url = verify.url();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(within(90, async {
        let (proxy, frozen) = freezable_proxy(verify.addr).await;
        let mut c = VerifierClient::connect(format!("http://{proxy}"))
            .await
            .unwrap();
        let _held = open_session(&mut c).await;
        assert_eq!(active_sessions(&url).await, 1);
        frozen.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(
            reaches_active(&url, 0, 60).await,
            "a half-open connection kept its session"
        );
    }));
}

#[test]
fn cancelled_profile_stops_its_work_and_frees_the_slot() {
    // A target slow enough that the whole profile below would run for minutes.
    let dir = tempfile::tempdir().unwrap();
    let spec = sequoia_engine::testing::TinySpec {
        hidden: 256,
        layers: 4,
        heads: 4,
        kv_heads: 2,
        intermediate: 768,
        ..tiny_spec(5)
    };
    sequoia_engine::testing::write_tiny_model(dir.path(), &spec).unwrap();
    sequoia_engine::tokenizer::testing::write_tiny_tokenizer(dir.path()).unwrap();
    let verify = start_verify(verify_service::config::VerifyConfig {
        max_sessions: 1,
        profile_timeout_secs: 3600.0,
        ..verify_config(dir.path())
    });
    let url = verify.url();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(within(90, async {
        let mut c = VerifierClient::connect(url.clone()).await.unwrap();
        let call = tokio::spawn(async move {
            c.profile(pb::ProfileRequest {
                tree_sizes: vec![512; limits::MAX_PROFILE_SIZES],
                context_length: 500,
                repeats: limits::MAX_PROFILE_REPEATS,
            })
            .await
        });
        assert!(
            reaches_active(&url, 1, 30).await,
            "the profile never took its slot"
        );
        // The caller goes away.
        call.abort();
        assert!(
            reaches_active(&url, 0, 30).await,
            "the abandoned profile kept working and held its slot"
        );
        // The slot really is free.
        let mut other = VerifierClient::connect(url.clone()).await.unwrap();
        let _s = open_session(&mut other).await;
    }));
}

#[test]
fn client_that_never_reads_its_stream_frees_the_slot_by_its_deadline() {
    use sequoia_proto::v1::generation_client::GenerationClient;
    let pair = TinyPair::new();
    let verify = start_verify(verify_config(&pair.target));
    let draft = start_draft(DraftConfig {
        max_sessions: 1,
        send_timeout_secs: 0.5,
        ..draft_config(&pair.draft, &[verify.url()], 4, 3)
    });
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(within(120, async {
        // A client with a tiny HTTP/2 window that never reads: the draft's sends back up.
        let channel = tonic::transport::Endpoint::from_shared(draft.url())
            .unwrap()
            .initial_stream_window_size(Some(64))
            .initial_connection_window_size(Some(64))
            .connect()
            .await
            .unwrap();
        let _stuck = GenerationClient::new(channel)
            .generate(request("hello world", 900, 0.0, 1))
            .await
            .expect("the stuck generation starts")
            .into_inner();
        // Another client is served once the stuck one's deadline has freed the only slot.
        let mut served = None;
        for _ in 0..600 {
            match generate(&draft.url(), request("quick fox", 8, 0.0, 2)).await {
                Ok(g) => {
                    served = Some(g);
                    break;
                }
                Err(s) if s.code() == Code::ResourceExhausted => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                Err(s) => panic!("unexpected status: {s:?}"),
            }
        }
        let g = served.expect("a client that never reads held the slot");
        assert!(g.summary.is_some());
        assert!(
            reaches_active(&verify.url(), 0, 30).await,
            "the stuck generation's verify session stayed open"
        );
    }));
}

// ---------------------------------------------------------------------------------------------
// Draft side: request size, drain deadline
// ---------------------------------------------------------------------------------------------

#[test]
fn oversized_prompt_is_refused_before_tokenizing() {
    let pair = TinyPair::new();
    let verify = start_verify(verify_config(&pair.target));
    let draft = start_draft(draft_config(&pair.draft, &[verify.url()], 4, 3));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let huge = "a".repeat(limits::MAX_PROMPT_BYTES + 1);
    let err = rt
        .block_on(within(
            60,
            generate(&draft.url(), request(&huge, 4, 0.0, 1)),
        ))
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().starts_with("prompt:"), "{err:?}");
}

#[test]
fn draft_drain_has_a_deadline() {
    let pair = TinyPair::new();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let url = start_fake(&rt, good_fake(&pair, Mode::Silent));
    let config = DraftConfig {
        step_timeout_secs: 600.0,
        drain_timeout_secs: 0.3,
        ..fast_draft(&pair, &[url])
    };
    let state = {
        let _in = rt.enter();
        draft_service::load_state(config).unwrap()
    };
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = rt.spawn(draft_service::serve(state, listener, async move {
        let _ = stopped.await;
    }));
    // A generation stuck on a silent verify node.
    let draft_url = format!("http://{addr}");
    rt.spawn(async move { generate(&draft_url, request("hello", 8, 0.0, 1)).await });
    std::thread::sleep(Duration::from_millis(500));
    stop.send(()).unwrap();
    rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("the drain did not end by its deadline")
            .unwrap()
            .unwrap();
    });
}

#[test]
fn second_sigterm_ends_the_drain_at_once() {
    let pair = TinyPair::new();
    let mut node = VerifyProcess::start(
        env!("CARGO_BIN_EXE_verify-node-under-test"),
        &pair.target,
        &[("SEQUOIA_DRAIN_TIMEOUT_SECS", "300")],
    );
    let rt = tokio::runtime::Runtime::new().unwrap();
    // An open session keeps the drain going.
    let (tx, rx) = mpsc::channel(2);
    let _s = rt.block_on(within(60, async {
        let mut c = VerifierClient::connect(node.url()).await.unwrap();
        tx.send(open_msg(limits::PROTOCOL_VERSION)).await.unwrap();
        let mut s = c
            .session(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        assert!(s.message().await.unwrap().is_some());
        s
    }));
    node.terminate();
    std::thread::sleep(Duration::from_millis(500));
    node.terminate();
    let status = node
        .wait_exit(20)
        .expect("a second SIGTERM must end the process");
    assert_eq!(
        status.code(),
        Some(sequoia_server::process::FORCED_EXIT_CODE)
    );
}

// ---------------------------------------------------------------------------------------------
// Property tests on every message that crosses the network
// ---------------------------------------------------------------------------------------------

fn arb_verdict() -> impl Strategy<Value = pb::Verdict> {
    (
        any::<u64>(),
        prop::collection::vec(prop_oneof![0u32..12, any::<u32>()], 0..8),
        prop_oneof![0u32..600, any::<u32>()],
        prop::collection::vec(prop_oneof![0u32..4, any::<u32>()], 0..8),
        prop_oneof![
            0.0f64..100.0,
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(-1.0),
            any::<f64>()
        ],
    )
        .prop_map(
            |(step, accepted_nodes, next_token, accepted_ranks, verify_ms)| pb::Verdict {
                step,
                accepted_nodes,
                next_token,
                accepted_ranks,
                verify_ms,
                batch_rows: (step as u32).wrapping_mul(2_654_435_761),
                batch_sessions: (step >> 32) as u32,
            },
        )
}

fn arb_parents() -> impl Strategy<Value = Vec<i32>> {
    prop::collection::vec(prop_oneof![-2i32..12, any::<i32>()], 0..16)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    /// Tree and verdict decoding: never a panic; a verdict that passes is safe to follow.
    #[test]
    fn tree_and_verdict_decoding_never_panic(parents in arb_parents(), v in arb_verdict()) {
        let tree = sequoia_core::tree::Tree::from_parents_limited(&parents, limits::TREE);
        if let Ok(t) = &tree {
            prop_assert_eq!(t.len(), parents.len());
        }
        if sequoia_server::wire::check_verdict(&v, &parents, 512).is_ok() {
            prop_assert!(v.verify_ms.is_finite() && v.verify_ms >= 0.0);
            prop_assert!(v.next_token < 512);
            prop_assert_eq!(v.accepted_nodes.len(), v.accepted_ranks.len());
            if let Ok(t) = &tree {
                let accepted: Vec<usize> = v.accepted_nodes.iter().map(|&i| i as usize).collect();
                prop_assert!(sequoia_engine::drafting::check_path(t, &accepted).is_ok());
            }
        }
    }
}

fn arb_decoded() -> impl Strategy<Value = pb::Decoded> {
    (
        prop_oneof![0u64..4, any::<u64>()],
        prop::collection::vec(prop_oneof![0u32..600, any::<u32>()], 0..12),
        any::<bool>(),
        prop_oneof![
            0.0f64..100.0,
            Just(f64::NAN),
            Just(f64::INFINITY),
            Just(-1.0),
            any::<f64>()
        ],
        any::<u32>(),
    )
        .prop_map(|(step, tokens, done, verify_ms, rows)| pb::Decoded {
            step,
            tokens,
            done,
            verify_ms,
            batch_rows: rows,
            batch_sessions: rows.rotate_left(7),
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    /// `decoded` messages from a verify node: never a panic; one that passes is safe to commit.
    #[test]
    fn decoded_messages_never_panic(d in arb_decoded(), step in 0u64..4, left in 0usize..10) {
        if sequoia_server::wire::check_decoded(&d, step, left, 512).is_ok() {
            prop_assert_eq!(d.step, step);
            prop_assert!(!d.tokens.is_empty() && d.tokens.len() <= left);
            prop_assert!(d.tokens.iter().all(|&t| t < 512));
            prop_assert!(d.verify_ms.is_finite() && d.verify_ms >= 0.0);
        }
    }
}

fn tiny_target() -> &'static (TinyPair, Model) {
    static T: std::sync::OnceLock<(TinyPair, Model)> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let pair = TinyPair::new();
        let model = Model::load(&pair.target, &LoadOptions::default()).unwrap();
        (pair, model)
    })
}

fn arb_dists() -> impl Strategy<Value = Vec<SparseDist>> {
    prop::collection::vec(
        (
            prop::collection::vec(prop_oneof![0u32..600, any::<u32>()], 0..6),
            prop::collection::vec(prop_oneof![0.0f32..1.0, Just(f32::NAN), any::<f32>()], 0..6),
        )
            .prop_map(|(tokens, probs)| SparseDist { tokens, probs }),
        0..6,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Session open and tree messages on a real (tiny) target: never a panic; every refusal
    /// is INVALID_ARGUMENT or RESOURCE_EXHAUSTED material.
    #[test]
    fn session_open_and_tree_never_panic(
        prefix in prop::collection::vec(prop_oneof![0u32..600, any::<u32>()], 0..12),
        temperature in prop_oneof![0.0f32..2.0, Just(f32::NAN), Just(-1.0f32), any::<f32>()],
        top_p in prop_oneof![0.0f32..1.0, Just(f32::NAN), any::<f32>()],
        top_k in prop_oneof![0u32..10, any::<u32>()],
        max_new in prop_oneof![0usize..64, Just(usize::MAX / 2)],
        step in prop_oneof![Just(0u64), any::<u64>()],
        parents in arb_parents(),
        tokens in prop::collection::vec(prop_oneof![0u32..600, any::<u32>()], 0..16),
        dists in arb_dists(),
    ) {
        let (_, model) = tiny_target();
        let limits = SessionLimits {
            max_context: 256,
            max_tree_nodes: limits::MAX_TREE_NODES,
            max_tree_levels: limits::MAX_TREE_LEVELS,
            max_dist_entries: limits::MAX_DIST_ENTRIES,
        };
        let params = sequoia_server::wire::sampling_params(temperature, top_p, top_k);
        let expected = |e: &SessionError| matches!(e, SessionError::Invalid(_) | SessionError::Exhausted(_));
        match VerifySession::open(model, &prefix, params, 1, max_new, limits) {
            Err(e) => prop_assert!(expected(&e), "{e}"),
            Ok((mut s, _)) => {
                if let Err(e) = s.verify(model, step, &parents, &tokens, &dists) {
                    prop_assert!(expected(&e), "{e}");
                }
            }
        }
        let _ = SamplingParams::default();
    }

    /// `decode` requests on a real (tiny) target: never a panic; a refusal is
    /// INVALID_ARGUMENT, FAILED_PRECONDITION (old version) or RESOURCE_EXHAUSTED with a message;
    /// one that passes decodes its first token.
    #[test]
    fn decode_requests_never_panic(
        prefix in prop::collection::vec(0u32..200, 0..8),
        max_new in prop_oneof![0usize..8, Just(usize::MAX / 4)],
        step in prop_oneof![Just(0u64), 0u64..3, any::<u64>()],
        root in prop_oneof![0u32..600, any::<u32>()],
        max_tokens in prop_oneof![0u32..8, any::<u32>()],
        per_message in any::<u32>(),
        version in prop_oneof![0u32..5, any::<u32>()],
    ) {
        let (_, model) = tiny_target();
        let limits = SessionLimits {
            max_context: 256,
            max_tree_nodes: limits::MAX_TREE_NODES,
            max_tree_levels: limits::MAX_TREE_LEVELS,
            max_dist_entries: limits::MAX_DIST_ENTRIES,
        };
        let Ok((mut s, _)) = VerifySession::open(model, &prefix, SamplingParams::default(), 1, max_new, limits) else {
            return Ok(());
        };
        let req = pb::DecodeTokens { step, root, max_tokens, tokens_per_message: per_message };
        match verify_service::decode::check_decode(&req, &s, model.info().vocab_size, version) {
            Err(st) => {
                prop_assert!(
                    matches!(st.code(), Code::InvalidArgument | Code::FailedPrecondition | Code::ResourceExhausted),
                    "{st:?}"
                );
                prop_assert!(!st.message().is_empty());
            }
            Ok(()) => {
                prop_assert!(s.verify(model, step, &[-1], &[root], &[]).is_ok());
            }
        }
    }

    /// Generate requests: never a panic, and every refusal has a code that means what it says.
    #[test]
    fn generate_requests_never_panic(
        prompt in prop_oneof![Just(String::new()), ".{0,40}"],
        roles in prop::collection::vec(prop_oneof![Just("user".to_string()), ".{0,6}"], 0..3),
        max_tokens in prop_oneof![0u32..64, any::<u32>()],
        temperature in prop_oneof![0.0f32..2.0, Just(f32::NAN), any::<f32>()],
        top_p in prop_oneof![0.0f32..1.0, any::<f32>()],
        top_k in any::<u32>(),
        stop in prop::collection::vec(".{0,8}", 0..20),
        tree_parents in arb_parents(),
        template in any::<bool>(),
    ) {
        let state = draft_state();
        let req = pb::GenerateRequest {
            prompt,
            messages: roles
                .into_iter()
                .map(|role| pb::ChatMessage { role, content: "hi".into() })
                .collect(),
            apply_chat_template: template,
            max_tokens,
            temperature,
            top_p,
            top_k,
            seed: Some(1),
            stop,
            tree_parents,
            pipeline: template.then_some(true),
        };
        if let Err(s) = draft_service::generation::prepare(state, &req) {
            prop_assert!(
                matches!(s.code(), Code::InvalidArgument | Code::ResourceExhausted | Code::FailedPrecondition),
                "{s:?}"
            );
            prop_assert!(!s.message().is_empty());
        }
    }
}

fn draft_state() -> &'static draft_service::DraftState {
    static S: std::sync::OnceLock<(
        TinyPair,
        tokio::runtime::Runtime,
        std::sync::Arc<draft_service::DraftState>,
    )> = std::sync::OnceLock::new();
    &S.get_or_init(|| {
        let pair = TinyPair::new();
        let rt = tokio::runtime::Runtime::new().unwrap();
        let state = {
            let _in = rt.enter();
            draft_service::load_state(draft_config(
                &pair.draft,
                &["http://127.0.0.1:1".into()],
                4,
                3,
            ))
            .unwrap()
        };
        (pair, rt, state)
    })
    .2
}

//! Issue 17: log lines cannot be forged by input. A draft-service runs in-process with the
//! services' own log subscriber (`sequoia_server::telemetry::subscriber`) writing into a
//! buffer; prompts, stop strings, a model name and a verify node's error text all carry a
//! newline followed by a fake log line. Every captured line must be one of the service's own
//! events. (Alone in its file: it installs the process-wide subscriber.)

use sequoia_core::limits;
use sequoia_engine::tokenizer::TextTokenizer;
use sequoia_proto::v1 as pb;
use sequoia_proto::v1::verifier_server::{Verifier, VerifierServer};
use sequoia_tests::*;
use std::net::SocketAddr;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// A newline, then what a forged event would look like in the text format.
const FORGED: &str = "1999-01-01T00:00:00.000000Z  INFO forged: admin logged in";

fn evil(what: &str) -> String {
    format!("{what}\n{FORGED}\r\n{FORGED}")
}

/// A verify node that opens sessions and answers every tree with an error whose text is hostile.
#[derive(Clone)]
struct HostileText {
    fingerprint: String,
}

#[tonic::async_trait]
impl Verifier for HostileText {
    type SessionStream = ReceiverStream<Result<pb::SessionResponse, Status>>;

    async fn session(
        &self,
        request: Request<Streaming<pb::SessionRequest>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            while let Ok(Some(msg)) = inbound.message().await {
                let reply = match msg.msg {
                    Some(pb::session_request::Msg::Open(_)) => Ok(pb::SessionResponse {
                        msg: Some(pb::session_response::Msg::Opened(pb::SessionOpened {
                            context_limit: 1024,
                            ..Default::default()
                        })),
                    }),
                    // A tree, or a decode where the planner falls back to one: both fail.
                    Some(
                        pb::session_request::Msg::Tree(_) | pb::session_request::Msg::Decode(_),
                    ) => Err(Status::unavailable(evil("peer error"))),
                    None => return,
                };
                let end = reply.is_err();
                let _ = tx.send(reply).await;
                if end {
                    return;
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
            min_protocol_version: limits::MIN_PROTOCOL_VERSION,
            protocol_version: limits::PROTOCOL_VERSION,
            ..Default::default()
        }))
    }

    async fn profile(
        &self,
        _: Request<pb::ProfileRequest>,
    ) -> Result<Response<pb::ProfileResponse>, Status> {
        Err(Status::unimplemented(evil("profile")))
    }

    async fn ping(
        &self,
        _: Request<pb::PingRequest>,
    ) -> Result<Response<pb::PingResponse>, Status> {
        Err(Status::unimplemented(evil("ping")))
    }
}

/// POST a JSON body to the draft's HTTP API; the status line and body.
async fn post(addr: SocketAddr, path: &str, body: &serde_json::Value) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = body.to_string();
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    conn.write_all(body.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    conn.read_to_end(&mut out).await.unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn input_with_newlines_cannot_forge_a_log_line() {
    let log = Captured::install();

    let pair = TinyPair::new();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let tok = TextTokenizer::load_for_model(&pair.draft).unwrap();
    let fake = HostileText {
        fingerprint: tok.fingerprint().to_string(),
    };
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let verify = format!("http://{}", listener.local_addr().unwrap());
    rt.spawn(
        tonic::transport::Server::builder()
            .add_service(VerifierServer::new(fake))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let draft = start_draft(draft_config(&pair.draft, &[verify], 4, 3));
    let http = draft.http.expect("HTTP API on");

    rt.block_on(within(120, async {
        // gRPC: hostile prompt and stop strings; the node's hostile error ends the generation.
        let mut req = request(&evil("prompt"), 8, 0.0, 1);
        req.stop = vec![evil("stop")];
        let r = generate(&draft.url(), req).await;
        assert!(r.is_err(), "the hostile node fails every step: {r:?}");
        // HTTP: hostile model name (refused) and hostile prompt/stop (fails at the node).
        for model in [evil("model"), "fake".to_string()] {
            let reply = post(
                http,
                "/v1/completions",
                &serde_json::json!({
                    "model": model,
                    "prompt": evil("http prompt"),
                    "stop": [evil("http stop")],
                    "max_tokens": 8,
                    "temperature": 0,
                }),
            )
            .await;
            assert!(!reply.starts_with("HTTP/1.1 200"), "{reply}");
        }
    }));
    drop(draft);

    let text = log.text();
    // The hostile text did reach the log (escaped), so the check below means something.
    assert!(text.contains("admin logged in"), "{text}");
    for line in text.lines() {
        assert!(
            !line.trim_start().starts_with("1999-"),
            "forged log line: {line:?}\nwhole log:\n{text}"
        );
        assert!(!line.contains('\r'), "raw carriage return: {line:?}");
    }
}

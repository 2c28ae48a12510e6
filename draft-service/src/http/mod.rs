//! The OpenAI-compatible HTTP API and the web playground, served next to gRPC by the same
//! process (`http_listen`).
//!
//! | route | what | token needed |
//! |---|---|---|
//! | `POST /v1/chat/completions` | chat (the model's own chat template), streamed or not | yes |
//! | `POST /v1/completions` | raw prompt, streamed or not | yes |
//! | `GET /v1/models` | the served target model (the draft in the `sequoia` extension) | yes |
//! | `GET /health` | 200 ready; 503 `loading`, `draining` or `no_verify_node` | no (probes) |
//! | `GET /` | the playground: one static page; its API calls carry the token typed into it | no (a browser cannot send a bearer token when it opens a page) |
//!
//! Dependencies point one way: HTTP → [`crate::generation`]. A request body is checked
//! ([`openai`]), turned into the same `GenerateRequest` gRPC clients send, then admitted
//! (the same slots as gRPC `Generate`), prepared and run by the same generation code. The
//! handlers only translate. TLS and tokens come from the same settings as the gRPC port.

mod errors;
mod openai;
mod sse;

use crate::config::DraftConfig;
use crate::generation;
use crate::state::DraftState;
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use errors::ApiError;
use futures::StreamExt;
use openai::{Endpoint, Parsed};
use sequoia_proto::v1::GenerateSummary;
use sequoia_server::security::{self, TokenCheck};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Largest request body accepted (413 above): far more than any prompt that fits the context.
pub const MAX_BODY_BYTES: usize = 4 << 20;

/// The playground page, embedded so the binary serves it without files or a build step.
const PLAYGROUND: &str = include_str!("playground.html");

/// A TLS handshake that has not finished by then is dropped (a stalled client must not hold a
/// task and a socket forever).
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The running HTTP listener. It answers from [`bind`](Self::bind) on — `503 loading` until
/// [`ready`](Self::ready) hands it the loaded state — and stops accepting on
/// [`stop_accepting`](Self::stop_accepting) or drop.
pub struct HttpServer {
    pub addr: SocketAddr,
    ready: Arc<OnceLock<Arc<DraftState>>>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl HttpServer {
    /// Bind `http_listen` and start answering; `None` when it is empty.
    pub async fn bind(config: &DraftConfig) -> anyhow::Result<Option<HttpServer>> {
        let listen = config.http_listen.trim();
        if listen.is_empty() {
            return Ok(None);
        }
        let tls = security::rustls_server_config(
            &config.tls_cert,
            &config.tls_key,
            &config.tls_client_ca,
        )?
        .map(tokio_rustls::TlsAcceptor::from);
        let tokens = TokenCheck::load(&config.auth_tokens, &config.auth_tokens_file)?;
        let listener = TcpListener::bind(listen)
            .await
            .map_err(|e| anyhow::anyhow!("http_listen {listen}: {e}"))?;
        let addr = listener.local_addr()?;
        let ready = Arc::new(OnceLock::new());
        let app = App {
            ready: ready.clone(),
            tokens,
        };
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(accept_loop(listener, tls, router(app), stopped));
        Ok(Some(HttpServer {
            addr,
            ready,
            stop,
            task,
        }))
    }

    /// The model is loaded: serve the API from now on.
    pub fn ready(&self, state: Arc<DraftState>) {
        let _ = state.http_addr.set(self.addr);
        let _ = self.ready.set(state);
    }

    /// Accept no new connections (draining); open ones finish their requests.
    pub fn stop_accepting(&self) {
        let _ = self.stop.send(true);
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Accept connections until told to stop; each connection is served on its own task (HTTP/1.1,
/// TLS when configured).
async fn accept_loop(
    listener: TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    app: Router,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "http accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = stop.changed() => return,
        };
        let _ = tcp.set_nodelay(true);
        let (app, tls) = (app.clone(), tls.clone());
        tokio::spawn(async move {
            let service = hyper_util::service::TowerToHyperService::new(app);
            let http = hyper::server::conn::http1::Builder::new();
            let served = match tls {
                None => {
                    http.serve_connection(hyper_util::rt::TokioIo::new(tcp), service)
                        .await
                }
                Some(tls) => {
                    match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, tls.accept(tcp)).await {
                        Ok(Ok(stream)) => {
                            http.serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                                .await
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(error = %e, "TLS handshake failed");
                            return;
                        }
                        Err(_) => return,
                    }
                }
            };
            if let Err(e) = served {
                tracing::debug!(error = %e, "http connection ended with an error");
            }
        });
    }
}

#[derive(Clone)]
struct App {
    ready: Arc<OnceLock<Arc<DraftState>>>,
    tokens: TokenCheck,
}

impl App {
    fn state(&self) -> Result<Arc<DraftState>, ApiError> {
        self.ready.get().cloned().ok_or_else(ApiError::loading)
    }
}

fn router(app: App) -> Router {
    Router::new()
        .route("/", get(playground))
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .fallback(|| async {
            ApiError::not_found("no such path; the API is under /v1/").into_response()
        })
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed().into_response() })
        .layer(axum::middleware::from_fn_with_state(app.clone(), guard))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(app)
}

/// The route label for metrics: one of a fixed set, so unknown paths cannot grow the series.
fn route_label(path: &str) -> &'static str {
    match path {
        "/" => "/",
        "/health" => "/health",
        "/v1/models" => "/v1/models",
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/completions" => "/v1/completions",
        _ => "other",
    }
}

/// Bearer tokens (all routes but the probe and the static page) and request counts.
async fn guard(State(app): State<App>, req: Request, next: Next) -> Response {
    let route = route_label(req.uri().path());
    let open = matches!(route, "/health" | "/");
    let auth = req
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    let response = match app.tokens.accepts(auth) {
        Err(why) if !open => ApiError::unauthorized(why).into_response(),
        _ => next.run(req).await,
    };
    if let Some(state) = app.ready.get() {
        state
            .metrics
            .http_request(route, response.status().as_u16());
    }
    response
}

pub(crate) fn json_response(status: StatusCode, v: &Value) -> Response {
    let mut r = Response::new(Body::from(v.to_string()));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

async fn playground() -> Response {
    let mut r = Response::new(Body::from(PLAYGROUND));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    r
}

/// 200 when a generation could start now; 503 with a reason code otherwise (never an address).
async fn health(State(app): State<App>) -> Response {
    let (status, reason) = match app.ready.get() {
        None => (StatusCode::SERVICE_UNAVAILABLE, "loading"),
        Some(s) if s.admission.is_draining() => (StatusCode::SERVICE_UNAVAILABLE, "draining"),
        Some(s) if !s.pool.nodes().iter().any(|n| n.usable()) => {
            (StatusCode::SERVICE_UNAVAILABLE, "no_verify_node")
        }
        Some(_) => (StatusCode::OK, "ok"),
    };
    let mut r = json_response(status, &json!({"status": reason}));
    if status != StatusCode::OK {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

/// The target model's name, from the first verify node that tells it.
async fn target_model(state: &DraftState) -> Result<String, ApiError> {
    let timeout = Duration::from_secs_f64(state.config.connect_timeout_secs);
    let mut nodes = state.pool.nodes();
    nodes.sort_by_key(|n| !n.usable());
    for node in nodes {
        if let Ok(info) = node.info(timeout).await {
            return Ok(info.model_name);
        }
    }
    Err(ApiError::unavailable(
        "no_verify_node",
        "no verify node is reachable, so the served model is unknown; retry shortly",
    ))
}

async fn models(State(app): State<App>) -> Result<Response, ApiError> {
    let state = app.state()?;
    let target = target_model(&state).await?;
    Ok(json_response(
        StatusCode::OK,
        &json!({
            "object": "list",
            "data": [{
                "id": target,
                "object": "model",
                "created": 0,
                "owned_by": "sequoia",
                "sequoia": {"draft_model": state.model.info().name},
            }],
        }),
    ))
}

async fn chat(
    State(app): State<App>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let state = app.state()?;
    let parsed = openai::parse_chat(&read_body(body)?)?;
    complete(state, parsed, Endpoint::Chat).await
}

async fn completions(
    State(app): State<App>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let state = app.state()?;
    let parsed = openai::parse_completion(&read_body(body)?)?;
    complete(state, parsed, Endpoint::Completions).await
}

fn read_body(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::body_too_large(MAX_BODY_BYTES)
        } else {
            ApiError::bad_body("the request body could not be read")
        }
    })
}

/// Admit, prepare and run a checked request with the shared generation code, and answer in
/// OpenAI's shape.
async fn complete(
    state: Arc<DraftState>,
    parsed: Parsed,
    endpoint: Endpoint,
) -> Result<Response, ApiError> {
    let target = target_model(&state).await?;
    if parsed.model != target {
        return Err(ApiError::model_not_found(&parsed.model, &target));
    }
    let id = request_id(endpoint);
    state.metrics.request();
    let slot = state.admission.try_acquire().map_err(ApiError::refused)?;
    let prepared = generation::prepare(&state, &parsed.request)
        .map_err(|s| ApiError::from_status(&s, endpoint.prompt_param(), &id))?;
    let mut chunks = generation::spawn(state, prepared, slot);
    let reply = Reply {
        endpoint,
        id,
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs(),
        model: target,
        include_usage: parsed.include_usage,
    };
    // Wait for the first chunk before answering, so a generation that cannot start (no verify
    // node, ...) gets its own status instead of a 200 with an error inside.
    // A stream that fails or ends before its summary is the generation's error.
    let id = reply.id.clone();
    let fail = |s: Option<tonic::Status>| match s {
        Some(s) => ApiError::from_status(&s, endpoint.prompt_param(), &id),
        None => ApiError::internal(&id),
    };
    let first = match chunks.next().await {
        Some(Ok(c)) => c,
        Some(Err(s)) => return Err(fail(Some(s))),
        None => return Err(fail(None)),
    };
    if parsed.stream {
        return Ok(sse::response(reply, first, chunks));
    }
    let mut text = first.text;
    let mut summary = first.summary;
    while summary.is_none() {
        match chunks.next().await {
            Some(Ok(c)) => {
                text.push_str(&c.text);
                summary = c.summary;
            }
            Some(Err(s)) => return Err(fail(Some(s))),
            None => return Err(fail(None)),
        }
    }
    let summary = summary.unwrap_or_default();
    Ok(json_response(StatusCode::OK, &reply.whole(&text, &summary)))
}

/// A random-looking id per response (`chatcmpl-…` / `cmpl-…`, as OpenAI's).
fn request_id(endpoint: Endpoint) -> String {
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Completions => "cmpl",
    };
    format!("{prefix}-{}", generation::request_id())
}

/// An opaque, per-process stable id for a verify node: responses say which node served them
/// (so users can tell nodes apart) without revealing internal addresses.
fn node_id(addr: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    static KEY: OnceLock<std::collections::hash_map::RandomState> = OnceLock::new();
    let mut h = KEY.get_or_init(Default::default).build_hasher();
    h.write(addr.as_bytes());
    format!("node-{:08x}", h.finish() as u32)
}

/// How to shape one request's answer.
pub(crate) struct Reply {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
}

impl Reply {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completions, _) => "text_completion",
        }
    }

    fn envelope(&self, chunk: bool, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    fn choice(&self, text: &str, finish: Option<&str>, delta_role: bool) -> Value {
        match self.endpoint {
            Endpoint::Chat => {
                let delta = if delta_role {
                    json!({"role": "assistant", "content": text})
                } else if finish.is_some() && text.is_empty() {
                    json!({})
                } else {
                    json!({"content": text})
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
            Endpoint::Completions => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
            }
        }
    }

    /// Chat streams open with the assistant role, as OpenAI's do.
    fn opening_chunk(&self) -> Option<Value> {
        (self.endpoint == Endpoint::Chat)
            .then(|| self.envelope(true, json!([self.choice("", None, true)])))
    }

    /// One step's text; `sequoia.tokens` lets the playground count tokens and steps live.
    fn delta_chunk(&self, text: &str, tokens: usize) -> Value {
        let mut v = self.envelope(true, json!([self.choice(text, None, false)]));
        v["sequoia"] = json!({"tokens": tokens});
        v
    }

    fn final_chunk(&self, s: &GenerateSummary) -> Value {
        let finish = openai::finish_reason(s);
        let mut v = self.envelope(true, json!([self.choice("", Some(finish), false)]));
        v["sequoia"] = openai::speculation(s, &node_id(&s.verify_node));
        v
    }

    /// With `stream_options.include_usage`: a last chunk without choices, as OpenAI sends.
    fn usage_chunk(&self, s: &GenerateSummary) -> Value {
        let mut v = self.envelope(true, json!([]));
        v["usage"] = openai::usage(s);
        v
    }

    /// The non-streamed response.
    fn whole(&self, text: &str, s: &GenerateSummary) -> Value {
        let finish = openai::finish_reason(s);
        let choice = match self.endpoint {
            Endpoint::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": null,
                "finish_reason": finish,
            }),
            Endpoint::Completions => self.choice(text, Some(finish), false),
        };
        let mut v = self.envelope(false, json!([choice]));
        v["usage"] = openai::usage(s);
        v["sequoia"] = openai::speculation(s, &node_id(&s.verify_node));
        v
    }
}

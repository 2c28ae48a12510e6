//! The `sequoia.v1.Generation` gRPC service: admission, then the generation itself
//! ([`crate::generation`]) on a task of its own, streaming chunks back; and [`serve`], the
//! server with health, reflection, TLS, tokens, metrics and draining shutdown.

use crate::generation;
pub use crate::generation::record_summary;
use crate::http::HttpServer;
use crate::state::DraftState;
use futures::Stream;
use sequoia_proto::v1::generation_server::{Generation, GenerationServer};
use sequoia_proto::v1::{GenerateChunk, GenerateRequest};
use sequoia_server::admission::Refused;
use sequoia_server::{process, security};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tonic::service::interceptor::InterceptedService;
use tonic::service::Routes;
use tonic::{Request, Response, Status};

#[derive(Clone)]
pub struct GenerationService {
    state: Arc<DraftState>,
}

#[tonic::async_trait]
impl Generation for GenerationService {
    type GenerateStream = Pin<Box<dyn Stream<Item = Result<GenerateChunk, Status>> + Send>>;

    async fn generate(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let state = self.state.clone();
        state.metrics.request();
        let id = generation::request_id();
        let slot = state.admission.try_acquire().map_err(|r| match r {
            Refused::Draining => Status::unavailable(format!(
                "draft node is shutting down; retry on another (request id {id})"
            )),
            Refused::Full { active, max } => Status::resource_exhausted(format!(
                "draft node is busy ({active} of {max} generations running); retry later (request id {id})"
            )),
        })?;
        let req = request.into_inner();
        let st = state.clone();
        // Templating and tokenization are CPU work in proportion to the prompt: off the async
        // workers (the slot above bounds how many run at once).
        let prepared = tokio::task::spawn_blocking(move || generation::prepare(&st, &req))
            .await
            .map_err(|e| {
                tracing::error!(request_id = %id, error = ?e.to_string(), "request preparation failed");
                Status::internal(format!("internal error (request id {id})"))
            })?
            .map_err(|s| {
                // Validation messages are about the caller's own input: they stay as they are.
                tracing::info!(request_id = %id, code = ?s.code(), message = ?s.message(), "request refused");
                Status::new(s.code(), format!("{} (request id {id})", s.message()))
            })?;
        let chunks = generation::spawn_with_id(state, prepared, slot, id.clone());
        let mut response = Response::new(Box::pin(chunks) as Self::GenerateStream);
        if let Ok(v) = id.parse() {
            response.metadata_mut().insert(REQUEST_ID, v);
        }
        Ok(response)
    }
}

/// Response metadata carrying the request id (also in every error message), which the
/// server's log lines for this request carry too.
pub const REQUEST_ID: &str = "x-request-id";

/// Serve Generation + health + reflection on `listener` until `shutdown` resolves; then refuse
/// new generations and let running ones finish. TLS, mutual TLS, bearer tokens and the metrics
/// endpoint follow the config (`tls_*`, `auth_*`, `metrics_listen`).
pub async fn serve(
    state: Arc<DraftState>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let http = HttpServer::bind(&state.config).await?;
    serve_with_http(state, listener, http, shutdown).await
}

/// [`serve`] with the HTTP API already bound (the command line binds it before the model loads,
/// so it can answer `503 loading` meanwhile). On shutdown both ports refuse new generations;
/// this returns once the gRPC and the HTTP ones still running have finished.
pub async fn serve_with_http(
    state: Arc<DraftState>,
    listener: TcpListener,
    http: Option<HttpServer>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    if let Some(h) = &http {
        h.ready(state.clone());
    }
    let http = Arc::new(http);
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<GenerationServer<GenerationService>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(sequoia_proto::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let config = &state.config;
    let (tls, tokens) = security::server_security(
        &config.tls_cert,
        &config.tls_key,
        &config.tls_client_ca,
        &config.auth_tokens,
        &config.auth_tokens_file,
        config.refuse_tokens_without_tls,
    )?;
    // The token check guards Generation only: health and reflection stay open for probes.
    let svc = InterceptedService::new(
        GenerationServer::new(GenerationService {
            state: state.clone(),
        }),
        tokens.clone(),
    );
    let metrics_server = state.metrics.spawn_server(&config.metrics_listen).await?;
    let probe_endpoint =
        security::spawn_probe_endpoint(Routes::new(health.clone()), &config.health_listen).await?;
    // Resolve DNS names and health-check verify nodes now and then every interval.
    state
        .pool
        .spawn_refresh(Duration::from_secs_f64(config.discovery_interval_secs));
    let drain = state.clone();
    let http_drain = http.clone();
    let shutdown = async move {
        shutdown.await;
        drain.admission.start_draining();
        if let Some(h) = http_drain.as_ref() {
            h.stop_accepting();
        }
        reporter
            .set_not_serving::<GenerationServer<GenerationService>>()
            .await;
        tracing::info!(
            drain_timeout_secs = drain.config.drain_timeout_secs,
            "shutting down: no new generations, running ones may finish"
        );
    };
    tracing::info!(
        addr = %listener.local_addr()?,
        model = %state.model.info().name,
        verify = ?state.config.verify,
        tree_mode = %state.config.tree.mode,
        tree_nodes = state.config.tree.nodes,
        tls = tls.is_some(),
        mutual_tls = security::given(&config.tls_client_ca).is_some(),
        auth = tokens.is_enabled(),
        metrics = ?metrics_server.as_ref().map(|m| m.addr),
        health = ?probe_endpoint.as_ref().map(|p| p.addr),
        http = ?http.as_ref().as_ref().map(|h| h.addr),
        "draft-service listening"
    );
    let routes = Routes::new(health).add_service(reflection).add_service(svc);
    let limits = process::GrpcLimits {
        keepalive: process::secs(config.keepalive_secs),
        max_concurrent_streams: config.max_concurrent_streams,
        drain_deadline: process::secs(config.drain_timeout_secs),
        ..process::GrpcLimits::default()
    };
    let drain = limits.drain_deadline;
    process::serve_grpc(listener, tls, routes, shutdown, limits).await?;
    // gRPC calls are done; HTTP generations hold admission slots until they end, within the
    // same drain deadline (a generation stuck on a silent verify node must not hold the exit).
    let waited = tokio::time::timeout(drain, async {
        while state.admission.active() > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    if waited.is_err() {
        tracing::warn!(
            active = state.admission.active(),
            "drain deadline passed with generations still running; exiting"
        );
    }
    Ok(())
}

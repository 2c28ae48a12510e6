//! The `sequoia.v1.Generation` gRPC service: admission, then the generation itself
//! ([`crate::generation`]) on a task of its own, streaming chunks back; and [`serve`], the
//! server with health, reflection, TLS, tokens, metrics and draining shutdown.

use crate::generation;
use crate::state::DraftState;
use futures::{Stream, StreamExt};
use sequoia_proto::v1::generation_server::{Generation, GenerationServer};
use sequoia_proto::v1::{GenerateChunk, GenerateRequest, GenerateSummary};
use sequoia_server::admission::Refused;
use sequoia_server::metrics::Metrics;
use sequoia_server::{process, security};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic::service::Routes;
use tonic::{Request, Response, Status};

/// Record a finished generation (its final summary) in the metrics.
pub fn record_summary(metrics: &Metrics, s: &GenerateSummary) {
    let round_trip_ms = s
        .timings
        .as_ref()
        .map_or(0.0, |t| t.verify_ms + t.network_ms);
    metrics.generation(
        s.generated_tokens as u64,
        s.steps as u64,
        &s.accepted_by_rank,
        &s.trials_by_rank,
        Duration::from_secs_f64(round_trip_ms.max(0.0) / 1e3),
    );
}

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
        let slot = state.admission.try_acquire().map_err(|r| match r {
            Refused::Draining => {
                Status::unavailable("draft node is shutting down; retry on another")
            }
            Refused::Full { active, max } => Status::resource_exhausted(format!(
                "draft node is busy ({active} of {max} generations running); retry later"
            )),
        })?;
        let prepared = generation::prepare(&state, request.get_ref())?;
        let (tx, rx) = mpsc::channel(16);
        let metrics = state.metrics.clone();
        tokio::spawn(async move {
            let _slot = slot;
            if let Err(status) = generation::run(state, prepared, &tx).await {
                tracing::warn!(code = ?status.code(), message = status.message(), "generation failed");
                let _ = tx.send(Err(status)).await;
            }
        });
        let chunks = ReceiverStream::new(rx).inspect(move |chunk| {
            if let Ok(GenerateChunk {
                summary: Some(s), ..
            }) = chunk
            {
                record_summary(&metrics, s);
            }
        });
        Ok(Response::new(Box::pin(chunks)))
    }
}

/// Serve Generation + health + reflection on `listener` until `shutdown` resolves; then refuse
/// new generations and let running ones finish. TLS, mutual TLS, bearer tokens and the metrics
/// endpoint follow the config (`tls_*`, `auth_*`, `metrics_listen`).
pub async fn serve(
    state: Arc<DraftState>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<GenerationServer<GenerationService>>()
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(sequoia_proto::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let config = &state.config;
    let tls = security::server_tls(&config.tls_cert, &config.tls_key, &config.tls_client_ca)?;
    let tokens = security::TokenCheck::load(&config.auth_tokens, &config.auth_tokens_file)?;
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
    let shutdown = async move {
        shutdown.await;
        drain.admission.start_draining();
        reporter
            .set_not_serving::<GenerationServer<GenerationService>>()
            .await;
        tracing::info!("shutting down: no new generations, running ones finish");
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
        "draft-service listening"
    );
    let routes = Routes::new(health).add_service(reflection).add_service(svc);
    process::serve_grpc(listener, tls, routes, shutdown).await
}

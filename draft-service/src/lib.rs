//! draft-service: the public entry point. Serves `sequoia.v1.Generation`: for each `Generate`
//! call it tokenizes the prompt, opens a verification session on a verify node, and repeats
//! grow a token tree with the draft model → send it → follow the verdict, streaming the
//! committed text back to the client.
//!
//! Layout: [`cli`] (the command line), [`config`] (settings), [`plan`] (tree shapes),
//! [`nodes`] (verify nodes: discovery, health, least-loaded choice), [`generation`] (the
//! per-request loop, failover included) and [`serve`] here (the gRPC server).

pub mod cli;
pub mod config;
pub mod generation;
pub mod nodes;
pub mod plan;

use anyhow::Context;
use config::DraftConfig;
use futures::{Stream, StreamExt};
use nodes::NodePool;
use plan::Planner;
use sequoia_proto::v1::generation_server::{Generation, GenerationServer};
use sequoia_proto::v1::{GenerateChunk, GenerateRequest, GenerateSummary};
use sequoia_shared::engine::{LoadOptions, Model};
use sequoia_shared::metrics::Metrics;
use sequoia_shared::security::{self, BearerToken, ClientSecurity};
use sequoia_shared::tokenizer::TextTokenizer;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic::service::Routes;
use tonic::{Request, Response, Status};

/// Everything shared by the generations of one draft node.
pub struct DraftState {
    pub model: Arc<Model>,
    pub tokenizer: Arc<TextTokenizer>,
    pub config: DraftConfig,
    pub pool: Arc<NodePool>,
    pub planner: Planner,
    /// Prometheus series (recording is a no-op when `metrics_listen` is empty).
    pub metrics: Metrics,
    active: AtomicUsize,
    draining: AtomicBool,
}

impl DraftState {
    /// Context limit of this node's draft caches.
    pub fn context_limit(&self) -> usize {
        self.config.max_context.min(self.model.info().max_context)
    }
}

/// Load the draft model and tokenizer, solve the tree plan, set up the verify node pool.
/// Call it inside a tokio runtime (the pool's channels connect lazily in the background).
pub fn load_state(config: DraftConfig) -> anyhow::Result<Arc<DraftState>> {
    if config.model.as_os_str().is_empty() {
        anyhow::bail!(
            "no draft model given: pass --model PATH (a .gguf file or a Hugging Face folder)"
        );
    }
    let pool = NodePool::new(
        &config.verify,
        Duration::from_secs_f64(config.connect_timeout_secs),
        &verify_security(&config)?,
        !config.verify_tls_domain.is_empty(),
    )
    .map_err(anyhow::Error::msg)?;
    if !config.discovery_interval_secs.is_finite() || config.discovery_interval_secs < 0.0 {
        anyhow::bail!(
            "discovery_interval_secs must be ≥ 0 (0 = no periodic health checks), got {}",
            config.discovery_interval_secs
        );
    }
    let planner = Planner::new(&config.tree, config.wire_top_k).map_err(anyhow::Error::msg)?;
    let opts = LoadOptions {
        threads: (config.threads > 0).then_some(config.threads),
        cuda: config.cuda,
        max_context: config.max_context,
    };
    let model = Model::load(&config.model, &opts)
        .with_context(|| format!("loading draft model {}", config.model.display()))?;
    let tokenizer = TextTokenizer::load_for_model(&config.model)
        .with_context(|| format!("loading tokenizer for {}", config.model.display()))?;
    Ok(Arc::new(DraftState {
        metrics: Metrics::for_listen("draft-service", &config.metrics_listen),
        model: Arc::new(model),
        tokenizer: Arc::new(tokenizer),
        config,
        pool: Arc::new(pool),
        planner,
        active: AtomicUsize::new(0),
        draining: AtomicBool::new(false),
    }))
}

/// How this node reaches verify nodes: TLS for `https://` URLs (a CA to trust, a client
/// certificate for mutual TLS) and the bearer token it sends.
fn verify_security(c: &DraftConfig) -> anyhow::Result<ClientSecurity> {
    let tls_given = [&c.verify_tls_ca, &c.verify_tls_cert, &c.verify_tls_key]
        .iter()
        .any(|p| security::given(p).is_some())
        || !c.verify_tls_domain.is_empty();
    let tls = tls_given
        .then(|| {
            security::client_tls(
                &c.verify_tls_ca,
                &c.verify_tls_cert,
                &c.verify_tls_key,
                &c.verify_tls_domain,
            )
        })
        .transpose()
        .context("verify_tls_* settings")?;
    let token =
        BearerToken::new(&c.verify_token, &c.verify_token_file).context("verify_token settings")?;
    Ok(ClientSecurity { tls, token })
}

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

struct ActiveSlot(Arc<DraftState>);
impl Drop for ActiveSlot {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
        self.0.metrics.session_ended();
    }
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
        if state.draining.load(Ordering::SeqCst) {
            return Err(Status::unavailable(
                "draft node is shutting down; retry on another",
            ));
        }
        let max = state.config.max_sessions;
        state
            .active
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            })
            .map_err(|n| {
                Status::resource_exhausted(format!(
                    "draft node is busy ({n} of {max} generations running); retry later"
                ))
            })?;
        state.metrics.session_started();
        let slot = ActiveSlot(state.clone());
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
        drain.draining.store(true, Ordering::SeqCst);
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
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        server = server.tls_config(tls)?;
    }
    server
        .tcp_nodelay(true)
        .add_service(health)
        .add_service(reflection)
        .add_service(svc)
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown,
        )
        .await?;
    Ok(())
}

//! verify-service: hosts the target model and verifies drafted token trees.
//!
//! Each `Verifier.Session` stream is one generation: the node prefills the prompt into a KV
//! cache of its own, then for every tree runs one tree-masked forward, applies the exact
//! verification rule (`sequoia_core::verify`) and compacts the cache to the accepted path.
//! The cache lives exactly as long as the stream. `Info` and `Profile` let draft nodes check
//! tokenizer compatibility and measure verify cost for the planner.
//!
//! Layout: [`cli`] (the command line), [`config`] (settings), [`session`] (plain per-session
//! logic), [`wait`] (what the node does while a session waits for its tree), [`service`] (the
//! gRPC layer), and [`serve`] here (health, reflection, draining shutdown).

pub mod batch;
pub mod cli;
pub mod config;
pub mod decode;
pub mod kv_pool;
pub mod service;
pub mod session;
pub mod wait;

use anyhow::Context;
use config::VerifyConfig;
use sequoia_engine::tokenizer::TextTokenizer;
use sequoia_engine::{LoadOptions, Model};
use sequoia_proto::v1::verifier_server::VerifierServer;
use sequoia_server::{process, security};
use service::{VerifierService, VerifyState};
use std::future::Future;
use std::sync::Arc;
use tokio::net::TcpListener;
use tonic::service::interceptor::InterceptedService;
use tonic::service::Routes;

/// Largest gRPC message accepted (shared with the draft side).
pub use sequoia_core::limits::MAX_MESSAGE_BYTES;

/// Load the target model and its tokenizer as configured.
pub fn load_state(config: VerifyConfig) -> anyhow::Result<Arc<VerifyState>> {
    if config.model.as_os_str().is_empty() {
        anyhow::bail!(
            "no target model given: pass --model PATH (a .gguf file or a Hugging Face folder)"
        );
    }
    config.batch.validate().map_err(anyhow::Error::msg)?;
    let opts = LoadOptions {
        threads: (config.threads > 0).then_some(config.threads),
        cuda: config.cuda,
        max_context: config.max_context,
    };
    let model = Model::load(&config.model, &opts)
        .with_context(|| format!("loading target model {}", config.model.display()))?;
    let tokenizer = TextTokenizer::load_for_model(&config.model)
        .with_context(|| format!("loading tokenizer for {}", config.model.display()))?;
    Ok(Arc::new(VerifyState::new(model, tokenizer, config)))
}

/// With new sessions already refused (`draining`), wait up to `drain_timeout_secs` for the open
/// ones, then tell the rest to move.
async fn drain(state: &VerifyState) {
    let open = state.admission.active();
    let timeout = process::secs(state.config.drain_timeout_secs);
    tracing::info!(
        open,
        ?timeout,
        "shutting down: no new sessions; open sessions may finish"
    );
    let deadline = tokio::time::Instant::now() + timeout;
    while state.admission.active() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let left = state.admission.active();
    if left > 0 {
        tracing::info!(
            sessions = left,
            "drain timeout: moving the open sessions to other nodes"
        );
        state.moving.send_replace(true);
    }
}

/// Serve Verifier + health + reflection on `listener` until `shutdown` resolves; then drain:
/// refuse new sessions, give open ones `drain_timeout_secs` to finish, end the rest so their
/// draft nodes move them to other verify nodes, and return. TLS, mutual TLS, bearer tokens and
/// the metrics endpoint follow the config (`tls_*`, `auth_*`, `metrics_listen`).
pub async fn serve(
    state: Arc<VerifyState>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<VerifierServer<VerifierService>>()
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
    // The token check guards the Verifier only: health and reflection stay open for probes.
    let verifier = InterceptedService::new(
        VerifierServer::new(VerifierService::new(state.clone()))
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES),
        tokens.clone(),
    );
    let metrics_server = state.metrics.spawn_server(&config.metrics_listen).await?;
    let probe_endpoint =
        security::spawn_probe_endpoint(Routes::new(health.clone()), &config.health_listen).await?;
    let drain_state = state.clone();
    let shutdown = async move {
        shutdown.await;
        drain_state.admission.start_draining();
        reporter
            .set_not_serving::<VerifierServer<VerifierService>>()
            .await;
        drain(&drain_state).await;
    };
    tracing::info!(
        addr = %listener.local_addr()?,
        model = %state.model.info().name,
        tls = tls.is_some(),
        mutual_tls = security::given(&config.tls_client_ca).is_some(),
        auth = tokens.is_enabled(),
        metrics = ?metrics_server.as_ref().map(|m| m.addr),
        health = ?probe_endpoint.as_ref().map(|p| p.addr),
        "verify-service listening"
    );
    let routes = Routes::new(health)
        .add_service(reflection)
        .add_service(verifier);
    let limits = process::GrpcLimits {
        keepalive: process::secs(config.keepalive_secs),
        max_concurrent_streams: config.max_concurrent_streams,
        // `drain` above already gave sessions their time and told the rest to move; this only
        // bounds how long they take to go.
        drain_deadline: std::time::Duration::from_secs(5),
        ..process::GrpcLimits::default()
    };
    process::serve_grpc(listener, tls, routes, shutdown, limits).await
}

//! draft-service: the public entry point. Serves `sequoia.v1.Generation`: for each `Generate`
//! call it tokenizes the prompt, opens a verification session on a verify node, and repeats
//! grow a token tree with the draft model → send it → follow the verdict, streaming the
//! committed text back to the client.
//!
//! Layout: [`config`] (settings), [`plan`] (tree shapes), [`nodes`] (verify nodes, compatibility, choice),
//! [`generation`] (the per-request loop) and [`serve`] here (the gRPC server).

pub mod config;
pub mod generation;
pub mod nodes;
pub mod plan;

use anyhow::Context;
use config::DraftConfig;
use nodes::NodePool;
use plan::Planner;
use sequoia_proto::v1::generation_server::{Generation, GenerationServer};
use sequoia_proto::v1::{GenerateChunk, GenerateRequest};
use sequoia_shared::engine::{LoadOptions, Model};
use sequoia_shared::tokenizer::TextTokenizer;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

/// Everything shared by the generations of one draft node.
pub struct DraftState {
    pub model: Arc<Model>,
    pub tokenizer: Arc<TextTokenizer>,
    pub config: DraftConfig,
    pub pool: NodePool,
    pub planner: Planner,
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
    )
    .map_err(anyhow::Error::msg)?;
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
        model: Arc::new(model),
        tokenizer: Arc::new(tokenizer),
        config,
        pool,
        planner,
        active: AtomicUsize::new(0),
        draining: AtomicBool::new(false),
    }))
}

#[derive(Clone)]
pub struct GenerationService {
    state: Arc<DraftState>,
}

struct ActiveSlot(Arc<DraftState>);
impl Drop for ActiveSlot {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}

#[tonic::async_trait]
impl Generation for GenerationService {
    type GenerateStream = ReceiverStream<Result<GenerateChunk, Status>>;

    async fn generate(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let state = self.state.clone();
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
        let slot = ActiveSlot(state.clone());
        let prepared = generation::prepare(&state, request.get_ref())?;
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(async move {
            let _slot = slot;
            if let Err(status) = generation::run(state, prepared, &tx).await {
                tracing::warn!(code = ?status.code(), message = status.message(), "generation failed");
                let _ = tx.send(Err(status)).await;
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// Serve Generation + health + reflection on `listener` until `shutdown` resolves; then refuse
/// new generations and let running ones finish.
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
    let svc = GenerationServer::new(GenerationService {
        state: state.clone(),
    });
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
        "draft-service listening"
    );
    tonic::transport::Server::builder()
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

//! What one draft node holds for all its generations: the draft model and tokenizer, the
//! settings, the verify-node pool, the tree planner, metrics and the admission counter.

use crate::config::DraftConfig;
use crate::nodes::NodePool;
use crate::plan::Planner;
use anyhow::Context;
use sequoia_engine::prefix::{PrefixStore, Reused};
use sequoia_engine::tokenizer::TextTokenizer;
use sequoia_engine::{KvCache, LoadOptions, Model};
use sequoia_server::admission::Admission;
use sequoia_server::metrics::Metrics;
use sequoia_server::security::{self, BearerToken, ClientSecurity};
use std::sync::Arc;
use std::time::Duration;

/// Everything shared by the generations of one draft node.
pub struct DraftState {
    pub model: Arc<Model>,
    pub tokenizer: Arc<TextTokenizer>,
    pub config: DraftConfig,
    pub pool: Arc<NodePool>,
    pub planner: Planner,
    /// Prometheus series (recording is a no-op when `metrics_listen` is empty).
    pub metrics: Metrics,
    /// Generation slots (`max_sessions`); refuses new generations once draining.
    pub admission: Arc<Admission>,
    /// Where the HTTP API listens, once it does (`http_listen`; unset when off).
    pub http_addr: std::sync::OnceLock<std::net::SocketAddr>,
    /// Finished generations' draft caches, kept for the next turn of their conversation.
    pub prefixes: std::sync::Mutex<PrefixStore>,
    /// The first tree of the latest pipelined generation, greedy and sampled: what the next
    /// one starts growing while its prompt is prefilled on the verify node.
    pub first_trees: std::sync::Mutex<FirstTrees>,
}

/// The first trees of the latest pipelined generations (docs/ALGORITHMS.md §10): a new
/// generation's plan is only known once its verify session is open, and it is nearly always the
/// previous one's, so the draft grows that tree during the verify node's prefill. A different
/// plan just drops it.
#[derive(Debug, Default)]
pub struct FirstTrees {
    greedy: Option<sequoia_core::tree::Tree>,
    sampled: Option<sequoia_core::tree::Tree>,
}

impl FirstTrees {
    /// The tree to grow during the prefill of a greedy or sampled generation, if any.
    pub fn get(&self, greedy: bool) -> Option<sequoia_core::tree::Tree> {
        if greedy { &self.greedy } else { &self.sampled }.clone()
    }

    /// What a generation drafted first; `None` when it did not pipeline (its verify node
    /// shares this node's CPUs, or pipelining is off), so the next one grows nothing early.
    pub fn set(&mut self, greedy: bool, tree: Option<sequoia_core::tree::Tree>) {
        *if greedy {
            &mut self.greedy
        } else {
            &mut self.sampled
        } = tree;
    }
}

impl DraftState {
    /// Context limit of this node's draft caches.
    pub fn context_limit(&self) -> usize {
        self.config.max_context.min(self.model.info().max_context)
    }

    /// The kept draft cache sharing the longest prefix with `prefix` (prefix reuse), taken
    /// out of the store; counted in the prefix-cache metrics.
    pub fn take_prefix(&self, prefix: &[u32]) -> Option<Reused> {
        if !self.config.prefix_cache.enabled {
            return None;
        }
        let mut store = self.prefixes.lock().unwrap_or_else(|p| p.into_inner());
        let hit = store.take(prefix, self.config.prefix_cache.min_tokens.max(1));
        self.metrics
            .prefix_lookup(prefix.len(), hit.as_ref().map_or(0, |h| h.reused));
        self.metrics.set_prefix_stored_bytes(store.bytes());
        hit
    }

    /// Keep a finished generation's draft cache (holding the first `cache.len()` of
    /// `tokens`). Copies the live entries, so call it off the async threads.
    pub fn keep_prefix(&self, tokens: Vec<u32>, mut cache: KvCache) {
        if !self.config.prefix_cache.enabled {
            return;
        }
        // The copy runs outside the lock, so other generations' lookups do not wait for it.
        if let Err(e) = cache.shrink_to_fit() {
            tracing::warn!(error = %e, "could not keep a draft prefix cache");
            return;
        }
        let mut store = self.prefixes.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = store.put(tokens, cache, usize::MAX) {
            tracing::warn!(error = %e, "could not keep a draft prefix cache");
        }
        self.metrics.set_prefix_stored_bytes(store.bytes());
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
    let lk = &config.lookup;
    if lk.max_tokens > 0 && (lk.min_ngram == 0 || lk.max_ngram < lk.min_ngram) {
        anyhow::bail!(
            "lookup: need 1 ≤ min_ngram ≤ max_ngram, got min_ngram = {}, max_ngram = {}",
            lk.min_ngram,
            lk.max_ngram
        );
    }
    let max_branch = sequoia_core::limits::MAX_TREE_LEVELS - 1;
    if lk.max_tokens > max_branch {
        anyhow::bail!(
            "lookup.max_tokens = {} is more than a tree's {max_branch} levels below the root",
            lk.max_tokens
        );
    }
    let pl = &config.pipeline;
    if pl.candidates == 0 || pl.candidates > 16 {
        anyhow::bail!("pipeline.candidates must be 1..=16, got {}", pl.candidates);
    }
    let fb = &config.fallback;
    let most = sequoia_core::limits::MAX_DECODE_TOKENS as usize;
    if fb.max_tokens == 0 || fb.max_tokens > most {
        anyhow::bail!(
            "fallback.max_tokens must be 1..={most}, got {}",
            fb.max_tokens
        );
    }
    if !(fb.rtt_share > 0.0 && fb.rtt_share < 1.0) {
        anyhow::bail!(
            "fallback.rtt_share must be between 0 and 1 (e.g. 0.03), got {}",
            fb.rtt_share
        );
    }
    let planner = Planner::new(&config.tree, config.wire_top_k)
        .map_err(anyhow::Error::msg)?
        .with_fallback(fb)
        .pipelining(config.pipeline.candidates, config.pipeline.send_ahead);
    let opts = LoadOptions {
        threads: (config.threads > 0).then_some(config.threads),
        cuda: config.cuda,
        max_context: config.max_context,
    };
    let model = Model::load(&config.model, &opts)
        .with_context(|| format!("loading draft model {}", config.model.display()))?;
    let tokenizer = TextTokenizer::load_for_model(&config.model)
        .with_context(|| format!("loading tokenizer for {}", config.model.display()))?;
    let metrics = Metrics::for_listen("draft-service", &config.metrics_listen);
    let kept = if config.prefix_cache.enabled {
        config.prefix_cache.max_mb.saturating_mul(1 << 20)
    } else {
        0
    };
    Ok(Arc::new(DraftState {
        prefixes: std::sync::Mutex::new(PrefixStore::new(kept)),
        first_trees: std::sync::Mutex::new(FirstTrees::default()),
        admission: Admission::new(config.max_sessions, metrics.clone()),
        metrics,
        model: Arc::new(model),
        tokenizer: Arc::new(tokenizer),
        config,
        pool: Arc::new(pool),
        planner,
        http_addr: std::sync::OnceLock::new(),
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
    // DNS-discovered nodes are reached over TLS exactly when verify TLS is configured.
    let plaintext = c
        .verify
        .iter()
        .any(|u| !(u.starts_with("https://") || (u.starts_with("dns:") && tls.is_some())));
    security::tokens_need_tls(
        token.is_set(),
        !plaintext,
        c.refuse_tokens_without_tls,
        "verify_token with a plaintext verify URL",
    )?;
    Ok(ClientSecurity { tls, token })
}

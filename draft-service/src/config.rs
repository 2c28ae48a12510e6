//! draft-service settings (defaults < TOML file < `SEQUOIA_*` env < flags); every key is
//! documented in deploy/config/draft-service.toml.

use sequoia_core::planner::EXAMPLE_ACCEPTANCE;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct DraftConfig {
    /// Draft model: a .gguf file or a Hugging Face folder.
    pub model: PathBuf,
    /// Verify nodes: URLs (e.g. "http://10.0.0.5:50052") and/or DNS names whose every address
    /// is a node ("dns:///verify-service:50052", e.g. a Kubernetes headless Service).
    pub verify: Vec<String>,
    /// Seconds between re-resolving DNS names and health-checking every verify node (Info:
    /// reachable, load, draining); 0 = never (nodes are then only checked when used).
    pub discovery_interval_secs: f64,
    /// gRPC listen address for the public Generation service.
    pub listen: String,
    /// Compute threads (0 = all cores).
    pub threads: usize,
    /// Run the draft on the GPU (needs the `cuda` feature).
    pub cuda: bool,
    /// Context limit of the draft's KV caches, in tokens.
    pub max_context: usize,
    /// Concurrent generations; more get RESOURCE_EXHAUSTED.
    pub max_sessions: usize,
    /// max_tokens when a request leaves it at 0.
    pub default_max_tokens: u32,
    /// Tokens of the draft's distribution sent per expanded node (the sparse q on the wire).
    pub wire_top_k: usize,
    /// Token ids the draft's LM head scores: the first K (the tokenizer's most frequent merges);
    /// 0 = the whole vocabulary. Exact at any value (docs/ALGORITHMS.md §8).
    pub draft_vocab: usize,
    /// Seconds to wait for one verify step before declaring the node unavailable.
    pub step_timeout_secs: f64,
    /// Seconds to wait when connecting to a verify node.
    pub connect_timeout_secs: f64,
    /// Seconds a generation waits for its client to take the next chunk (its stream buffer
    /// full) before it ends and frees its slot and verify session: a client that stops
    /// reading holds nothing for longer. 0 = end at once when the buffer is full.
    pub send_timeout_secs: f64,
    pub tree: TreeConfig,
    pub lookup: LookupConfig,
    pub pipeline: PipelineConfig,
    pub fallback: FallbackConfig,
    /// Prefix reuse across chat turns: keep finished generations' draft caches for new
    /// generations whose prompt starts with the same tokens.
    pub prefix_cache: PrefixCacheConfig,
    /// Emit JSON log lines.
    pub log_json: bool,
    /// TLS certificate chain and private key (PEM) for the Generation service; empty = plaintext.
    pub tls_cert: PathBuf,
    pub tls_key: PathBuf,
    /// CA (PEM) that client certificates must chain to; set = mutual TLS required.
    pub tls_client_ca: PathBuf,
    /// Bearer tokens accepted from clients; with `auth_tokens_file`, none = no authentication.
    pub auth_tokens: Vec<String>,
    /// File with one accepted token per line (e.g. a mounted Kubernetes Secret).
    pub auth_tokens_file: PathBuf,
    /// CA (PEM) to trust for `https://` verify nodes, besides the system roots.
    pub verify_tls_ca: PathBuf,
    /// Client certificate and key (PEM) presented to verify nodes (mutual TLS).
    pub verify_tls_cert: PathBuf,
    pub verify_tls_key: PathBuf,
    /// Name verify nodes' certificates are checked against instead of the URL's host.
    pub verify_tls_domain: String,
    /// Bearer token sent to verify nodes (or `verify_token_file`); empty = none.
    pub verify_token: String,
    pub verify_token_file: PathBuf,
    /// Plaintext grpc.health.v1-only address for Kubernetes probes (which cannot speak TLS),
    /// e.g. 127.0.0.1:50061 (0.0.0.0 only where probes come from outside); empty = off (health is always served on `listen` too).
    pub health_listen: String,
    /// Prometheus `/metrics` address, e.g. 127.0.0.1:9091; empty = off (no default bind beyond loopback).
    pub metrics_listen: String,
    /// OpenAI-compatible HTTP API and web playground (draft-service/src/http/), with the same
    /// TLS, tokens and generation slots as `listen`; empty = off.
    pub http_listen: String,
    /// On shutdown, seconds running generations may still finish before every connection is
    /// closed (a second SIGTERM exits at once).
    pub drain_timeout_secs: f64,
    /// HTTP/2 keepalive PING interval towards clients (seconds, 0 = off).
    pub keepalive_secs: f64,
    /// Most concurrent streams one client connection may open (0 = the HTTP/2 default).
    pub max_concurrent_streams: u32,
    /// Refuse to start when bearer tokens (`auth_tokens*`, or `verify_token*` with a plaintext
    /// verify URL) would cross the network without TLS; false = start with a loud warning.
    pub refuse_tokens_without_tls: bool,
}

/// The tree shape: a Sequoia DP tree. In "auto" mode its size and depth come from measured
/// costs and a running acceptance estimate; in "fixed" mode from `nodes` and `max_levels`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct TreeConfig {
    /// "auto" (plan from measured costs) or "fixed".
    pub mode: String,
    /// Acceptance vector p_1, p_2, ... (measure it with `sequoia tree measure-acceptance`);
    /// in auto mode the prior of the running estimate.
    pub acceptance: Vec<f64>,
    /// Fixed mode: nodes per tree, root included (1 = no speculation). Auto mode: the largest
    /// tree the planner considers.
    pub nodes: usize,
    /// Maximum levels, root included.
    pub max_levels: usize,
    /// Auto mode: re-plan after this many steps of a generation.
    pub replan_every_steps: u32,
    /// Auto mode: context length at which forward costs are measured.
    pub profile_context: usize,
    /// Auto mode: share of a drift factor's distance from the profile dropped each time the
    /// other mode runs (the decode factor at each tree verdict, the tree and draft factors at
    /// each decode of the fallback; docs/ALGORITHMS.md §5.4). 0 keeps a factor until its own
    /// mode runs again.
    pub drift_relax: f64,
}

/// Prompt lookup: a continuation copied from earlier in the context (prompt and generated
/// text) grafted onto each tree as a free branch (docs/ALGORITHMS.md §9). Greedy requests only.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct LookupConfig {
    /// Most tokens a lookup branch proposes; 0 = off.
    pub max_tokens: usize,
    /// Shortest suffix of the context that must have occurred before.
    pub min_ngram: usize,
    /// Longest suffix tried first.
    pub max_ngram: usize,
}

impl Default for LookupConfig {
    fn default() -> Self {
        Self {
            max_tokens: 8,
            min_ngram: 2,
            max_ngram: 4,
        }
    }
}

impl LookupConfig {
    pub fn params(&self) -> sequoia_core::lookup::LookupParams {
        sequoia_core::lookup::LookupParams {
            min_ngram: self.min_ngram,
            max_ngram: self.max_ngram,
            max_tokens: self.max_tokens,
        }
    }
}

/// Pipelined drafting (docs/ALGORITHMS.md §10): while a tree is being verified, the draft
/// grows the next one for the likeliest verdicts, so that on a hit the next tree is ready
/// when the verdict arrives. Pays where the draft has a CPU (or GPU) of its own, i.e. when draft
/// and verify run on different hosts; on one shared CPU the two compete for the same cores.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct PipelineConfig {
    /// Default for requests that do not set `pipeline`.
    pub enabled: bool,
    /// Also draft ahead, by default, against a verify node that shares this node's CPUs (same
    /// machine, overlapping CPU sets, from its `Info`): off, since the work done ahead then takes
    /// cores from the verification it overlaps (one 2-core host: 0.90× the target alone with it,
    /// 1.03× without). Requests that set `pipeline` get what they ask for.
    pub on_shared_cpus: bool,
    /// Verdicts (end of the accepted path, then the next token) grown ahead per step.
    pub candidates: usize,
    /// Most draft forwards spent ahead per step (one per level of all candidates' trees).
    pub max_forwards: usize,
    /// Grow a generation's first tree while the verify node prefills its prompt (the tree the
    /// latest pipelined generation started with), instead of after.
    pub first_tree_during_prefill: bool,
    /// Send that first tree right behind the `open` when it is whole before the verify node
    /// has prefilled the prompt: the node verifies it as soon as its prefill ends, which saves
    /// the first step a round trip. Exact either way.
    pub first_tree_with_open: bool,
    /// Send each candidate's next tree to the verify node as soon as it is grown, before the
    /// verdict it assumes has come back: the node verifies it right after that verdict if the
    /// assumption holds (no round trip between the two), and drops it otherwise. Needs verify
    /// nodes of protocol version 4; older ones are sent nothing ahead.
    pub send_ahead: bool,
}

/// The decode fallback (docs/ALGORITHMS.md §5.5): when the plan is no speculation (the auto
/// planner finds no tree that pays, or fixed mode with `tree.nodes = 1`), the verify node
/// decodes several tokens on its own per round trip instead of the pair paying one round trip
/// per token. Exact: it is plain target decoding.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct FallbackConfig {
    /// Use it where the verify node speaks it (protocol version 3); false = root-only trees.
    pub enabled: bool,
    /// Most tokens per decode (fixed mode: always this many, bounded by what is left).
    pub max_tokens: usize,
    /// Auto mode: the share of a decode's time the round trip may take; K is the smallest
    /// count that keeps RTT / (K · t(1) + RTT) at or below it.
    pub rtt_share: f64,
    /// Tokens per message from the verify node (1 = each token as soon as it is sampled).
    pub tokens_per_message: u32,
}

impl Default for FallbackConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_tokens: 32,
            rtt_share: 0.03,
            tokens_per_message: 1,
        }
    }
}

/// `[prefix_cache]` settings.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct PrefixCacheConfig {
    pub enabled: bool,
    /// Most memory the kept draft caches may hold, in MiB (least recently used go first).
    pub max_mb: usize,
    /// Shortest shared prefix worth reusing, in tokens.
    pub min_tokens: usize,
}

impl Default for PrefixCacheConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_mb: 512,
            min_tokens: 16,
        }
    }
}

impl Default for PipelineConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            on_shared_cpus: false,
            candidates: 2,
            max_forwards: 16,
            first_tree_during_prefill: true,
            first_tree_with_open: true,
            send_ahead: true,
        }
    }
}

impl Default for TreeConfig {
    fn default() -> Self {
        Self {
            mode: "auto".into(),
            acceptance: EXAMPLE_ACCEPTANCE.to_vec(),
            nodes: 32,
            max_levels: 8,
            replan_every_steps: 16,
            profile_context: 128,
            drift_relax: 0.1,
        }
    }
}

impl Default for DraftConfig {
    fn default() -> Self {
        Self {
            model: PathBuf::new(),
            verify: Vec::new(),
            discovery_interval_secs: 10.0,
            listen: "0.0.0.0:50051".into(),
            threads: 0,
            cuda: false,
            max_context: 4096,
            max_sessions: 16,
            default_max_tokens: 256,
            wire_top_k: 64,
            draft_vocab: 32_768,
            step_timeout_secs: 60.0,
            connect_timeout_secs: 5.0,
            send_timeout_secs: 30.0,
            tree: TreeConfig::default(),
            lookup: LookupConfig::default(),
            pipeline: PipelineConfig::default(),
            fallback: FallbackConfig::default(),
            prefix_cache: PrefixCacheConfig::default(),
            log_json: false,
            tls_cert: PathBuf::new(),
            tls_key: PathBuf::new(),
            tls_client_ca: PathBuf::new(),
            auth_tokens: Vec::new(),
            auth_tokens_file: PathBuf::new(),
            verify_tls_ca: PathBuf::new(),
            verify_tls_cert: PathBuf::new(),
            verify_tls_key: PathBuf::new(),
            verify_tls_domain: String::new(),
            verify_token: String::new(),
            verify_token_file: PathBuf::new(),
            health_listen: String::new(),
            metrics_listen: String::new(),
            http_listen: "0.0.0.0:8000".into(),
            drain_timeout_secs: 30.0,
            keepalive_secs: 30.0,
            max_concurrent_streams: 64,
            refuse_tokens_without_tls: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn example_config_matches_the_code() {
        let file =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/config/draft-service.toml");
        let unknown = sequoia_server::config::unknown_keys(&DraftConfig::default(), &file).unwrap();
        assert!(
            unknown.is_empty(),
            "keys the service does not read: {unknown:?}"
        );
        let c: DraftConfig = sequoia_server::config::load(
            &DraftConfig::default(),
            Some(&file),
            &serde_json::json!({}),
        )
        .unwrap();
        assert_eq!(c.tree.nodes, 32);
        assert_eq!(c.verify, vec!["http://verify-service:50052".to_string()]);
        let text = std::fs::read_to_string(&file).unwrap();
        for (key, v) in serde_json::to_value(DraftConfig::default())
            .unwrap()
            .as_object()
            .unwrap()
        {
            let documented = if v.is_object() {
                text.contains(&format!("[{key}]"))
            } else {
                text.contains(&format!("\n{key} ="))
            };
            assert!(documented, "{key} is not documented in the example");
        }
        for key in serde_json::to_value(TreeConfig::default())
            .unwrap()
            .as_object()
            .unwrap()
            .keys()
            .chain(
                serde_json::to_value(LookupConfig::default())
                    .unwrap()
                    .as_object()
                    .unwrap()
                    .keys(),
            )
            .chain(
                serde_json::to_value(PipelineConfig::default())
                    .unwrap()
                    .as_object()
                    .unwrap()
                    .keys(),
            )
            .chain(
                serde_json::to_value(FallbackConfig::default())
                    .unwrap()
                    .as_object()
                    .unwrap()
                    .keys(),
            )
        {
            assert!(
                text.contains(&format!("\n{key} =")),
                "{key} is not documented"
            );
        }
    }
}

//! verify-service settings (defaults < TOML file < `SEQUOIA_*` env < flags); every key is
//! documented in deploy/config/verify-service.toml.

use sequoia_core::limits;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct VerifyConfig {
    /// Target model: a .gguf file or a Hugging Face folder.
    pub model: PathBuf,
    /// gRPC listen address.
    pub listen: String,
    /// Compute threads (0 = all cores).
    pub threads: usize,
    /// Run on the GPU (needs a build with the `cuda` feature).
    pub cuda: bool,
    /// Per-session context limit in tokens (prompt + generated + one tree).
    pub max_context: usize,
    /// Concurrent sessions; more get RESOURCE_EXHAUSTED.
    pub max_sessions: usize,
    /// On shutdown, seconds open sessions may still finish before they are ended (UNAVAILABLE)
    /// so their draft nodes move them to other verify nodes.
    pub drain_timeout_secs: f64,
    /// Largest tree accepted per step.
    pub max_tree_nodes: usize,
    /// Deepest tree accepted per step (levels, root included).
    pub max_tree_levels: usize,
    /// Largest sparse draft distribution accepted per node.
    pub max_dist_entries: usize,
    /// Emit JSON log lines.
    pub log_json: bool,
    /// TLS certificate chain and private key (PEM); both empty = plaintext.
    pub tls_cert: PathBuf,
    pub tls_key: PathBuf,
    /// CA (PEM) that client certificates must chain to; set = mutual TLS required.
    pub tls_client_ca: PathBuf,
    /// Accepted bearer tokens; with `auth_tokens_file`, none at all = no authentication.
    pub auth_tokens: Vec<String>,
    /// File with one accepted token per line (e.g. a mounted Kubernetes Secret).
    pub auth_tokens_file: PathBuf,
    /// Plaintext grpc.health.v1-only address for Kubernetes probes (which cannot speak TLS),
    /// e.g. 127.0.0.1:50062 (0.0.0.0 only where probes come from outside); empty = off (health is always served on `listen` too).
    pub health_listen: String,
    /// Prometheus `/metrics` address, e.g. 127.0.0.1:9090; empty = off (no default bind beyond loopback).
    pub metrics_listen: String,
    /// Seconds a new Session stream may wait for its `open` message (it holds no slot
    /// meanwhile) and an open session for its next tree, before it is ended with
    /// DEADLINE_EXCEEDED and its slot freed.
    pub open_timeout_secs: f64,
    pub idle_timeout_secs: f64,
    /// Most seconds one `Profile` call may compute before it is cut off (DEADLINE_EXCEEDED).
    pub profile_timeout_secs: f64,
    /// HTTP/2 keepalive PING interval (seconds, 0 = off): a peer that stops answering is
    /// disconnected, ending its streams.
    pub keepalive_secs: f64,
    /// Most concurrent streams one connection may open (0 = the HTTP/2 default).
    pub max_concurrent_streams: u32,
    /// Refuse to start when bearer tokens are configured without TLS (they would cross the
    /// network in clear text); false = start with a loud warning.
    pub refuse_tokens_without_tls: bool,
    /// KV-cache memory all open sessions together may reserve, in MiB (0 = no limit). A
    /// session reserves what its cache can grow to (prompt + max_new_tokens + one tree) at
    /// `open`; one that does not fit gets RESOURCE_EXHAUSTED.
    pub kv_budget_mb: usize,
    /// Sessions alone on this node decode the target's next token while they wait for a
    /// tree that has been taking longer than half a forward to come (a tree that comes meanwhile
    /// stops that forward within a layer) (docs/ALGORITHMS.md §10, "The verify node
    /// decodes while it waits"): a tree without that token is answered without a forward, one
    /// with it by forwarding only the subtree below it. Exact either way, greedy or sampled.
    /// `Info` reports it (`decodes_while_waiting`), so that draft nodes price their trees by it.
    pub decode_while_waiting: bool,
    /// Continuous batching of every session's trees and prefill chunks.
    pub batch: crate::batch::BatchConfig,
    /// Prefix reuse across chat turns: ended sessions' caches are kept (within
    /// `kv_budget_mb`, evicted first) for new sessions whose prompt starts with the same tokens.
    pub prefix_cache: crate::kv_pool::PrefixCacheConfig,
}

impl Default for VerifyConfig {
    fn default() -> Self {
        Self {
            model: PathBuf::new(),
            listen: "0.0.0.0:50052".into(),
            threads: 0,
            cuda: false,
            max_context: 4096,
            max_sessions: 64,
            drain_timeout_secs: 10.0,
            max_tree_nodes: limits::MAX_TREE_NODES,
            max_tree_levels: limits::MAX_TREE_LEVELS,
            max_dist_entries: limits::MAX_DIST_ENTRIES,
            log_json: false,
            tls_cert: PathBuf::new(),
            tls_key: PathBuf::new(),
            tls_client_ca: PathBuf::new(),
            auth_tokens: Vec::new(),
            auth_tokens_file: PathBuf::new(),
            health_listen: String::new(),
            metrics_listen: String::new(),
            open_timeout_secs: 10.0,
            idle_timeout_secs: 120.0,
            profile_timeout_secs: 60.0,
            keepalive_secs: 30.0,
            max_concurrent_streams: 64,
            refuse_tokens_without_tls: false,
            kv_budget_mb: 8192,
            decode_while_waiting: true,
            batch: crate::batch::BatchConfig::default(),
            prefix_cache: crate::kv_pool::PrefixCacheConfig::default(),
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
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/config/verify-service.toml");
        let unknown =
            sequoia_server::config::unknown_keys(&VerifyConfig::default(), &file).unwrap();
        assert!(
            unknown.is_empty(),
            "keys the service does not read: {unknown:?}"
        );
        let c: VerifyConfig = sequoia_server::config::load(
            &VerifyConfig::default(),
            Some(&file),
            &serde_json::json!({}),
        )
        .unwrap();
        assert_eq!(c.listen, "0.0.0.0:50052");
        // Every setting is documented: the example sets every key.
        let all = serde_json::to_value(VerifyConfig::default()).unwrap();
        let text = std::fs::read_to_string(&file).unwrap();
        for (key, v) in all.as_object().unwrap() {
            let documented = match v.as_object() {
                // A table: its header and every key in it.
                Some(table) => {
                    text.contains(&format!("[{key}]"))
                        && table.keys().all(|k| text.contains(&format!("\n{k} =")))
                }
                None => text.contains(&format!("\n{key} =")),
            };
            assert!(documented, "{key} is not documented in the example");
        }
        assert_eq!(c.batch, crate::batch::BatchConfig::default());
        assert_eq!(c.prefix_cache, crate::kv_pool::PrefixCacheConfig::default());
    }
}

//! `sequoia-shared`: the library both services and the CLI stand on.
//!
//! Pure logic, no I/O, tested exhaustively:
//! - [`tree`]: token trees (parent arrays in BFS order, rank-ordered children, ancestor masks);
//! - [`planner`]: the Sequoia DP for optimal tree shapes and the chain / k×d baselines;
//! - [`sampling`]: logits → probabilities (temperature, top-k, top-p), sampling without
//!   replacement, and the seedable per-session RNG;
//! - [`verify`]: the exact tree verification rule (stochastic and greedy);
//! - [`drafting`]: growing a token tree with the draft model and following verdicts.
//!
//! The model side:
//! - [`engine`]: the candle forward pass with tree attention, KV caches with path compaction,
//!   GGUF and safetensors loading;
//! - [`tokenizer`]: tokenizers from tokenizer.json or GGUF metadata, chat templates, fingerprints;
//! - [`models`]: the default model set and where it is fetched to;
//! - [`profiling`]: measured forward costs for the planner.
//!
//! Service plumbing shared by both binaries: [`config`] (figment layers), [`telemetry`], [`process`],
//! [`security`] (TLS, mutual TLS, bearer tokens) and [`metrics`] (Prometheus).

pub mod config;
pub mod drafting;
pub mod engine;
pub mod metrics;
pub mod models;
pub mod planner;
pub mod process;
pub mod profiling;
pub mod sampling;
pub mod security;
pub mod telemetry;
pub mod tokenizer;
pub mod tree;
pub mod verify;

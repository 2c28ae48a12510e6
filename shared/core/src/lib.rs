//! `sequoia-core`: the exact math of Sequoia tree speculative decoding.
//!
//! Everything here is deterministic, pure and unit/property tested; nothing does I/O.
//! - [`tree`]: token trees (parent arrays in BFS order, rank-ordered children, ancestor masks);
//! - [`planner`]: the Sequoia DP for optimal tree shapes, the chain / k×d baselines, and
//!   ([`planner::cost`]) the hardware- and network-aware cost model that picks a tree size;
//! - [`sampling`]: logits → probabilities (temperature, top-k, top-p), sampling without
//!   replacement, the seedable per-session RNG;
//! - [`verify`]: the exact tree verification rule (stochastic and greedy);
//! - [`stats`]: acceptance statistics (accepted per depth and per rank, tokens per step), the one
//!   implementation every caller (generation, acceptance measurement, benchmarks, planner) uses;
//! - [`lookup`]: prompt lookup, continuations copied from the context as free tree branches;
//! - [`limits`]: every size limit the two services agree on;
//! - [`types`]: small shared vocabularies (finish reasons, tree modes) with their wire names.
//!
//! **Must not depend on** candle, tokenizers, tonic, tokio or axum: the math builds in seconds
//! and a change to the engine or the services never rebuilds it. The math itself is written up
//! in `docs/ALGORITHMS.md`. Tests live beside the code (`#[cfg(test)]` modules).

pub mod limits;
pub mod lookup;
pub mod planner;
pub mod sampling;
pub mod stats;
pub mod tree;
pub mod types;
pub mod verify;

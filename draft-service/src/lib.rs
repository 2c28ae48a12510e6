//! draft-service: the public entry point. Serves `sequoia.v1.Generation`: for each `Generate`
//! call it tokenizes the prompt, opens a verification session on a verify node, and repeats
//! grow a token tree with the draft model → send it → follow the verdict, streaming the
//! committed text back to the client.
//!
//! Layout, in the order a request meets it: [`service`] (the gRPC layer: admission, streaming,
//! [`serve`]), [`generation`] (one request: validation, the draft → verify → commit step loop,
//! the verify link with failover, text deltas and stop strings, the summary), [`plan`] (tree
//! shapes and the auto planner), [`nodes`] (verify nodes: discovery, health, least-loaded
//! choice), [`state`] (what the node holds), [`config`] and [`cli`]. [`http`] is a second front
//! end over the same generation code: the OpenAI-compatible HTTP API and the web playground.

pub mod cli;
pub mod config;
pub mod generation;
pub mod http;
pub mod nodes;
pub mod plan;
pub mod service;
pub mod state;

pub use service::{record_summary, serve, GenerationService};
pub use state::{load_state, DraftState};

//! `sequoia-server`: the plumbing both services share, so each service crate is only its own
//! protocol logic.
//!
//! - [`config`]: layered settings (defaults → TOML → `SEQUOIA_*` env → flags, with figment) and
//!   the unknown-key check;
//! - [`telemetry`]: logging setup; [`process`]: the runtime/listener host ([`process::run_server`])
//!   and shutdown signals;
//! - [`security`]: TLS, mutual TLS, bearer tokens, the plaintext health-probe endpoint;
//! - [`metrics`]: the Prometheus series both services record;
//! - [`admission`]: the concurrent-slot limit both services enforce;
//! - [`host`]: the machine and CPUs a service runs on (whether two nodes share cores);
//! - [`wire`]: conversions between protobuf messages and `sequoia-core` types;
//! - [`delay_proxy`]: a TCP proxy that adds round-trip time and a link rate (two-host emulation
//!   and tests).
//!
//! **Must not depend on** `sequoia-engine` (candle): plumbing changes must not rebuild the model
//! code and vice versa. Tests live beside the code; the cross-service tests are in `tests/`.

pub mod admission;
pub mod config;
pub mod delay_proxy;
pub mod host;
pub mod metrics;
pub mod process;
pub mod security;
pub mod telemetry;
pub mod wire;

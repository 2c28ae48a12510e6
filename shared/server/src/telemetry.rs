//! Logging set-up shared by the services: `tracing` with an env filter (`RUST_LOG`, default
//! `info`) and optional JSON lines for log collectors.

use tracing_subscriber::{fmt, EnvFilter};

/// Install the global subscriber once; later calls are no-ops (tests start several services).
pub fn init_logging(json: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

//! `verify-service --model PATH --listen ADDR [--config FILE]`

use anyhow::Context;
use clap::Parser;
use serde::Serialize;
use std::path::PathBuf;
use verify_service::config::VerifyConfig;

/// Hosts the target model and verifies drafted token trees (sequoia.v1.Verifier).
#[derive(Parser, Serialize)]
#[command(version)]
struct Flags {
    /// TOML config file (see deploy/config/verify-service.toml).
    #[arg(long)]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// Target model: a .gguf file or a Hugging Face folder.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    model: Option<PathBuf>,
    /// Listen address, e.g. 0.0.0.0:50052.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    listen: Option<String>,
    /// Compute threads (0 = all cores).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    threads: Option<usize>,
    /// Per-session context limit in tokens.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    max_context: Option<usize>,
    /// Concurrent session limit.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    max_sessions: Option<usize>,
    /// JSON log lines.
    #[arg(long)]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    log_json: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let flags = Flags::parse();
    let config: VerifyConfig =
        sequoia_shared::config::load(&VerifyConfig::default(), flags.config.as_deref(), &flags)?;
    sequoia_shared::telemetry::init_logging(config.log_json);
    let listener = tokio::net::TcpListener::bind(&config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let state = verify_service::load_state(config)?;
    verify_service::serve(state, listener, shutdown_signal()).await
}

/// Resolves on SIGTERM (Kubernetes) or Ctrl-C.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! { _ = ctrl_c => {}, _ = term.recv() => {} }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

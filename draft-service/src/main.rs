//! `draft-service --model PATH --verify URL[,URL...] --listen ADDR [--config FILE]`

use anyhow::Context;
use clap::Parser;
use draft_service::config::DraftConfig;
use serde::Serialize;
use std::path::PathBuf;

/// Serves sequoia.v1.Generation: drafts token trees and has verify nodes check them.
#[derive(Parser, Serialize)]
#[command(version)]
struct Flags {
    /// TOML config file (see deploy/config/draft-service.toml).
    #[arg(long)]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// Draft model: a .gguf file or a Hugging Face folder.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    model: Option<PathBuf>,
    /// Verify node URLs, comma-separated (http://host:port).
    #[arg(long, value_delimiter = ',')]
    #[serde(skip_serializing_if = "Option::is_none")]
    verify: Option<Vec<String>>,
    /// Listen address, e.g. 0.0.0.0:50051.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    listen: Option<String>,
    /// Compute threads (0 = all cores).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    threads: Option<usize>,
    /// JSON log lines.
    #[arg(long)]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    log_json: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let flags = Flags::parse();
    let config: DraftConfig =
        sequoia_shared::config::load(&DraftConfig::default(), flags.config.as_deref(), &flags)?;
    sequoia_shared::telemetry::init_logging(config.log_json);
    let listener = tokio::net::TcpListener::bind(&config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    let state = draft_service::load_state(config)?;
    draft_service::serve(state, listener, shutdown_signal()).await
}

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

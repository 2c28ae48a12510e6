//! The `draft-service` command line: flags over the config file and environment, then serve.
//! `draft-service --model PATH --verify URL[,URL...] --listen ADDR [--config FILE]`

use crate::config::DraftConfig;
use clap::Parser;
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
    /// Verify nodes, comma-separated: URLs (http://host:port, https://host:port) or DNS names
    /// whose every address is a node (dns:///verify-service:50052).
    #[arg(long, value_delimiter = ',')]
    #[serde(skip_serializing_if = "Option::is_none")]
    verify: Option<Vec<String>>,
    /// Listen address, e.g. 0.0.0.0:50051.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    listen: Option<String>,
    /// OpenAI-compatible HTTP API and playground address, e.g. 0.0.0.0:8000 ("" = off).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    http_listen: Option<String>,
    /// Compute threads (0 = all cores).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    threads: Option<usize>,
    /// JSON log lines.
    #[arg(long)]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    log_json: bool,
}

/// Parse the command line and serve until SIGTERM or Ctrl-C (then drain).
pub fn main() -> anyhow::Result<()> {
    let flags = Flags::parse();
    let config: DraftConfig =
        sequoia_server::config::load(&DraftConfig::default(), flags.config.as_deref(), &flags)?;
    let listen = config.listen.clone();
    sequoia_server::process::run_server(&listen, config.log_json, |listener, shutdown| async move {
        // The HTTP port answers from the start (`/health` says 503 "loading" until the model is
        // in memory), so load balancers and users see why it is not ready yet.
        let http = crate::http::HttpServer::bind(&config).await?;
        let state = tokio::task::spawn_blocking(move || crate::load_state(config)).await??;
        crate::service::serve_with_http(state, listener, http, shutdown).await
    })
}

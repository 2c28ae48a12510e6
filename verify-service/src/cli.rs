//! The `verify-service` command line: flags over the config file and environment, then serve.
//! `verify-service --model PATH --listen ADDR [--config FILE]`

use crate::config::VerifyConfig;
use clap::Parser;
use serde::Serialize;
use std::path::PathBuf;

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

/// Parse the command line and serve until SIGTERM or Ctrl-C (then drain).
pub fn main() -> anyhow::Result<()> {
    let flags = Flags::parse();
    let config: VerifyConfig =
        sequoia_server::config::load(&VerifyConfig::default(), flags.config.as_deref(), &flags)?;
    let listen = config.listen.clone();
    sequoia_server::process::run_server(&listen, config.log_json, |listener, shutdown| async move {
        let state = crate::load_state(config)?;
        crate::serve(state, listener, shutdown).await
    })
}

//! `sequoia`: the command-line front end.
//!
//! - `tree plan` / `tree bench`: Sequoia tree shapes from an acceptance vector;
//! - `generate-local` / `engine-bench`: the target alone on this machine (the baseline);
//! - `generate` / `demo`: talk to the services over the `sequoia.v1` gRPC API.

mod tree_cmds;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "sequoia",
    version,
    about = "Exact tree speculative decoding (Sequoia) across machines"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Tree shapes: plan, benchmark the DP.
    Tree {
        #[command(subcommand)]
        command: TreeCommand,
    },
}

#[derive(Subcommand)]
enum TreeCommand {
    /// Best tree for an acceptance vector and node budget (Sequoia DP).
    Plan(tree_cmds::PlanArgs),
    /// Time the DP (prints measured seconds).
    Bench(tree_cmds::BenchArgs),
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Tree { command } => match command {
            TreeCommand::Plan(a) => tree_cmds::plan(&a),
            TreeCommand::Bench(a) => tree_cmds::bench(&a),
        },
    }
}

//! `sequoia`: the command-line front end.
//!
//! - `tree plan` / `tree bench`: Sequoia tree shapes from an acceptance vector;
//! - `generate-local` / `engine-bench`: the target alone on this machine (the baseline);
//! - `generate` / `demo`: talk to the services over the `sequoia.v1` gRPC API;
//! - `chaos`: verify nodes killed and restarted under load (issue 17's chaos run, longer).

mod acceptance_cmd;
mod bench_cmd;
mod chaos_cmd;
mod chaos_driver;
mod client_cmds;
mod delay_proxy;
mod engine_cmds;
mod tree_cmds;
mod tree_plot;
mod two_host;

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
    /// Generate through a draft-service (streams text).
    Generate(client_cmds::GenerateArgs),
    /// Start both services on the default models, generate, compare with the target alone.
    Demo(client_cmds::DemoArgs),
    /// Plain decoding with the target alone on this machine (the baseline).
    GenerateLocal(engine_cmds::GenerateLocalArgs),
    /// Decode speed and tree-forward cost t(n) of a model on this machine.
    EngineBench(engine_cmds::EngineBenchArgs),
    /// Benchmark methods (target-only, chain, k×d, Sequoia, auto) over a prompt set.
    Bench(bench_cmd::BenchArgs),
    /// TCP proxy that adds a round-trip delay (emulates the network between two hosts).
    NetDelay(delay_proxy::NetDelayArgs),
    /// Chaos run: verify nodes SIGKILLed and restarted at random under concurrent load; every
    /// generation must equal the target's greedy output or get a retriable status, and nothing
    /// may leak.
    Chaos(chaos_cmd::ChaosArgs),
}

#[derive(Subcommand)]
enum TreeCommand {
    /// Best tree for an acceptance vector and node budget (Sequoia DP).
    Plan(tree_cmds::PlanArgs),
    /// Time the DP (prints measured seconds).
    Bench(tree_cmds::BenchArgs),
    /// Measure t_v(n) and t_d(w) on this machine into a planner profile (JSON).
    Profile(tree_cmds::ProfileArgs),
    /// Measure the acceptance vector of a draft/target pair over a prompt file.
    MeasureAcceptance(acceptance_cmd::MeasureArgs),
    /// Charts: t_v(n)/t_d(w), acceptance by rank and depth, predicted speedup vs size per RTT.
    Plot(tree_plot::PlotArgs),
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Tree { command } => match command {
            TreeCommand::Plan(a) => tree_cmds::plan(&a),
            TreeCommand::Bench(a) => tree_cmds::bench(&a),
            TreeCommand::Profile(a) => tree_cmds::profile(&a),
            TreeCommand::MeasureAcceptance(a) => acceptance_cmd::measure(&a),
            TreeCommand::Plot(a) => tree_plot::plot(&a),
        },
        Command::Generate(a) => client_cmds::generate(&a),
        Command::Demo(a) => client_cmds::demo(&a),
        Command::GenerateLocal(a) => engine_cmds::generate_local(&a),
        Command::EngineBench(a) => engine_cmds::engine_bench(&a),
        Command::Bench(a) => bench_cmd::bench(&a),
        Command::NetDelay(a) => delay_proxy::net_delay(&a),
        Command::Chaos(a) => chaos_cmd::chaos(&a),
    }
}

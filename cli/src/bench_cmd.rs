//! `sequoia bench`: the benchmark harness.
//!
//! For a draft/target pair and a prompt file (Spec-Bench JSONL), runs every selected prompt with
//! every method at every temperature through a draft-service, and reports per category and
//! overall: tokens/s, speedup over target-only decoding measured in the same run, mean tokens per
//! step, acceptance by rank and the time split (draft, network, verify, overhead).
//!
//! Methods (the tree each step drafts, forced with `GenerateRequest.tree_parents` except `auto`):
//!
//! | method | tree |
//! |---|---|
//! | `target` | the root alone: plain target decoding (the baseline) |
//! | `chain:L` | a chain of L drafted tokens (Leviathan et al.) |
//! | `kxd:KxD` | K independent chains of D drafted tokens (SpecInfer-style) |
//! | `kxd-best:B` | the best K×D with K·D ≤ B under the acceptance vector |
//! | `sequoia:B` | the Sequoia-optimal tree of B drafted tokens (B + 1 nodes) |
//! | `auto` | whatever the draft-service's planner picks (tree.mode = "auto") |
//! | `M+pipe` | method M with pipelined drafting (`GenerateRequest.pipeline = true`) |
//!
//! Every request states `pipeline` explicitly (true only for `+pipe` methods), so the service's
//! `pipeline.enabled` default does not change what a method measures.
//!
//! Budgets count *drafted* tokens, so `chain:4`, `kxd:2x2` and `sequoia:4` all verify 5 nodes.
//! The Sequoia and `kxd-best` trees are planned from an acceptance vector measured at the start
//! of the run on held-out prompts (a wide "spine" tree through the same services, docs/ALGORITHMS.md
//! §6), per temperature, unless `--acceptance` gives one.
//!
//! Services: `--draft-addr` (already running, e.g. across the two-host emulation in
//! `deploy/local/two-hosts.sh`) with `--target-addr` for the target-only baseline (a draft-service
//! next to the verify node; root-only trees make it plain target decoding on the verify host), or
//! no address: both services are spawned here like `sequoia demo` (optionally with a delay proxy
//! between them, `--rtt-ms`, `--bandwidth-mbps`). `--two-host` runs the whole bench across the
//! two-host emulation instead (`crate::two_host`, which calls the script, which calls this
//! command again with `--draft-addr`).
//!
//! Every finished (prompt, method, temperature) run is appended to `OUT/results.jsonl`; a
//! restarted bench skips what is already there. The report (`report.json`, `report.md`, PNG
//! charts) is computed from that file, over the (prompt, temperature) groups in which every
//! method finished, so every ratio compares the same prompts.

mod capacity;
pub(crate) mod charts;
mod methods;
mod multi_turn;
mod prompts;
mod report;
mod results;
mod run;
mod services;

pub use capacity::{capacity, CapacityArgs};
pub use methods::*;
pub use multi_turn::{multi_turn, MultiTurnArgs};
pub use prompts::*;
pub use results::*;
use run::*;
use services::*;

use crate::client_cmds::{free_port, wait_ready, Service};
use crate::two_host::{self, TwoHostArgs};
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use sequoia_core::planner::{k_by_d_expected, SequoiaDp, EXAMPLE_ACCEPTANCE};
use sequoia_core::stats::{normalized_acceptance, RankCounts};
use sequoia_core::tree::Tree;
use sequoia_proto::v1::generation_client::GenerationClient;
use sequoia_proto::v1::{ChatMessage, GenerateRequest};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;
use tonic::transport::Channel;

/// Children per level of the calibration spine, i.e. the ranks whose acceptance is measured.
const CALIBRATION_WIDTH: usize = 8;
/// Levels below the root of the calibration spine.
const CALIBRATION_DEPTH: usize = 3;
/// New tokens per calibration prompt (at most).
const CALIBRATION_TOKENS: u32 = 64;

#[derive(clap::Args, Debug, Clone)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    /// `sequoia bench capacity ...`: the verify node's throughput under N concurrent sessions;
    /// `sequoia bench multi-turn ...`: a chat's second-turn TTFT with prefix reuse on and off.
    #[command(subcommand)]
    pub sub: Option<BenchSub>,
    /// Prompt file: JSONL with `question_id`, `category` and `turns` (the first turn is used).
    #[arg(long, default_value = "tests/data/spec_bench/question.jsonl")]
    pub prompts: PathBuf,
    /// Prompts per category (the first ones of each category in file order).
    #[arg(long, default_value_t = 2)]
    pub max_prompts_per_category: usize,
    /// Only these categories (comma-separated; default: all).
    #[arg(long, value_delimiter = ',')]
    pub categories: Vec<String>,
    /// New tokens per generation (fewer when the model ends its answer).
    #[arg(long, default_value_t = 128)]
    pub max_tokens: u32,
    /// Sampling temperatures (0 = greedy).
    #[arg(long, value_delimiter = ',', default_value = "0,0.7")]
    pub temperatures: Vec<f32>,
    /// Methods: target (root-only trees = plain target decoding, the baseline), chain:L (L
    /// drafted tokens in a chain), kxd:KxD (K chains of D), kxd-best:B (best K×D with K·D ≤ B),
    /// sequoia:B (Sequoia-optimal tree of B drafted tokens, B + 1 nodes), auto (the service's
    /// own planner); any of them with +pipe (e.g. auto+pipe) drafts pipelined.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "target,chain:2,chain:4,kxd:2x2,sequoia:4,sequoia:8,sequoia:16,auto"
    )]
    pub methods: Vec<String>,
    /// Base seed; a prompt's seed is this plus its question_id (the same for every method).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Level limit (root included) of the sequoia:B and kxd-best:B trees.
    #[arg(long, default_value_t = 8)]
    pub max_levels: usize,
    /// Acceptance vector for planning sequoia:B / kxd-best:B trees (comma-separated p_1, p_2,
    /// ...), used at every temperature; default: measured at the start of the run.
    #[arg(long, value_delimiter = ',')]
    pub acceptance: Option<Vec<f64>>,
    /// Held-out prompts per temperature used to measure the acceptance vector (0 = use the
    /// example vector of docs/ALGORITHMS.md §2 unless --acceptance is given).
    #[arg(long, default_value_t = 4)]
    pub calibration_prompts: usize,
    /// Send the prompt text raw instead of as a chat message (models without a chat template).
    #[arg(long)]
    pub raw: bool,

    /// A running draft-service to benchmark (e.g. http://127.0.0.1:50051). Without it, both
    /// services are started here.
    #[arg(long)]
    pub draft_addr: Option<String>,
    /// A draft-service for the target-only baseline (root-only trees), e.g. one running next to
    /// the verify node. Default: --draft-addr itself (then the baseline pays the network too).
    #[arg(long, requires = "draft_addr")]
    pub target_addr: Option<String>,
    /// Draft model when starting the services (path or default name); a label with --draft-addr.
    #[arg(long, default_value = sequoia_models::QWEN_CODER_0_5B)]
    pub draft: String,
    /// Target model when starting the services (path or default name); a label with
    /// --draft-addr.
    #[arg(long, default_value = sequoia_models::QWEN_CODER_1_5B)]
    pub target: String,
    /// Compute threads of the started draft-service (default: all cores; with --two-host one
    /// per CPU of --draft-cpus). With --draft-addr only recorded in the report.
    #[arg(long)]
    pub draft_threads: Option<usize>,
    /// Compute threads of the started verify-service (default: all cores; with --two-host one
    /// per CPU of --verify-cpus). With --draft-addr only recorded in the report.
    #[arg(long)]
    pub verify_threads: Option<usize>,
    /// Round-trip time (ms) added between the started services by an in-process delay proxy;
    /// the baseline then gets a draft-service of its own, connected without the delay. With
    /// --draft-addr it is only recorded (the network is set up outside, e.g. by two-hosts.sh).
    #[arg(long, default_value_t = 0.0)]
    pub rtt_ms: f64,
    /// Largest tree (nodes) the started draft-service's auto planner considers.
    #[arg(long)]
    pub auto_max_nodes: Option<usize>,

    /// Where results.jsonl, report.json, report.md and the charts go.
    #[arg(long, default_value = "bench-out")]
    pub out_dir: PathBuf,
    /// Free-form description of the setup, printed in the report (e.g. "two hosts, RTT 10 ms").
    #[arg(long)]
    pub label: Option<String>,
    /// Discard earlier results in --out-dir instead of resuming.
    #[arg(long)]
    pub restart: bool,
    /// Only recompute the report from --out-dir/results.jsonl.
    #[arg(long)]
    pub report_only: bool,
    /// Skip the PNG charts.
    #[arg(long)]
    pub no_charts: bool,

    #[command(flatten)]
    pub two: TwoHostArgs,
}

/// The default --out-dir; with --two-host the script then picks a directory per mode and RTT.
const DEFAULT_OUT_DIR: &str = "bench-out";

/// `sequoia bench --two-host`: hand everything to the two-host script.
fn bench_two_host(args: &BenchArgs) -> Result<()> {
    if args.draft_addr.is_some() {
        bail!("--two-host starts its own services; drop --draft-addr/--target-addr");
    }
    let join = |v: &[String]| v.join(",");
    let nums = |v: &[f64]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let mut a: Vec<String> = vec![
        "--prompts".into(),
        two_host::absolute(&args.prompts)?.display().to_string(),
        "--max-prompts-per-category".into(),
        args.max_prompts_per_category.to_string(),
        "--max-tokens".into(),
        args.max_tokens.to_string(),
        "--temperatures".into(),
        join(
            &args
                .temperatures
                .iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>(),
        ),
        "--methods".into(),
        join(&args.methods),
        "--seed".into(),
        args.seed.to_string(),
        "--max-levels".into(),
        args.max_levels.to_string(),
        "--calibration-prompts".into(),
        args.calibration_prompts.to_string(),
    ];
    if !args.categories.is_empty() {
        a.extend(["--categories".into(), join(&args.categories)]);
    }
    if let Some(p) = &args.acceptance {
        a.extend(["--acceptance".into(), join(&nums(p))]);
    }
    if let Some(l) = &args.label {
        a.extend(["--label".into(), l.clone()]);
    }
    for (on, flag) in [
        (args.raw, "--raw"),
        (args.restart, "--restart"),
        (args.no_charts, "--no-charts"),
    ] {
        if on {
            a.push(flag.into());
        }
    }
    let setup = two_host::Setup {
        mode: "bench",
        rtt_ms: args.rtt_ms,
        draft: model_arg(&args.draft)?,
        target: model_arg(&args.target)?,
        draft_threads: args.draft_threads,
        verify_threads: args.verify_threads,
        auto_max_nodes: args.auto_max_nodes,
        out_dir: (args.out_dir != Path::new(DEFAULT_OUT_DIR))
            .then(|| two_host::absolute(&args.out_dir))
            .transpose()?,
        bin: two_host::bin_dir()?,
    };
    two_host::run_script(&args.two, &setup, &a)
}

/// A model argument for the script: a file as an absolute path (the script runs from the
/// repository root), a default model name as it is.
pub(crate) fn model_arg(m: &str) -> Result<String> {
    let p = Path::new(m);
    Ok(if p.exists() {
        two_host::absolute(p)?.display().to_string()
    } else {
        m.to_string()
    })
}

/// The `sequoia bench` command.
/// Benchmarks other than the method comparison.
#[derive(clap::Subcommand, Debug, Clone)]
pub enum BenchSub {
    /// Verify-node capacity: N concurrent replayed sessions, batching on and off (no draft
    /// model runs during the measurement).
    Capacity(CapacityArgs),
    /// Time to first token of a chat's second turn (MT-Bench), prefix reuse on and off.
    MultiTurn(MultiTurnArgs),
}

pub fn bench(args: &BenchArgs) -> Result<()> {
    match &args.sub {
        Some(BenchSub::Capacity(a)) => return capacity(a),
        Some(BenchSub::MultiTurn(a)) => return multi_turn(a),
        None => {}
    }
    let methods = parse_methods(&args.methods)?;
    if args.temperatures.is_empty() {
        bail!("--temperatures is empty");
    }
    for &t in &args.temperatures {
        if !(t.is_finite() && t >= 0.0) {
            bail!("temperature {t} must be a non-negative number");
        }
    }
    if !(args.rtt_ms.is_finite() && args.rtt_ms >= 0.0) {
        bail!("--rtt-ms must be a non-negative number");
    }
    args.two.validate()?;
    if args.two.two_host && !args.report_only {
        return bench_two_host(args);
    }
    if args.draft_addr.is_none()
        && (args.two.draft_cpus.is_some() || args.two.verify_cpus.is_some())
    {
        bail!(
            "--draft-cpus/--verify-cpus pin the services of --two-host (or describe given \
             --draft-addr services); the services spawned here are not pinned"
        );
    }
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    std::fs::create_dir_all(&args.out_dir)
        .with_context(|| format!("creating {}", args.out_dir.display()))?;
    let results = args.out_dir.join("results.jsonl");
    if args.report_only {
        let records = ResultsLog::read(&results)?;
        if records.is_empty() {
            bail!("{} is missing or empty", results.display());
        }
        return report::write_reports(args, &methods, &records);
    }
    if args.restart && results.exists() {
        std::fs::remove_file(&results)?;
    }
    let all = load_prompts(&args.prompts)?;
    let (measured, heldout) = select_prompts(
        &all,
        &args.categories,
        args.max_prompts_per_category,
        args.calibration_prompts,
    )?;
    eprintln!(
        "== {} prompts × {} temperatures × {} methods = {} runs ({} calibration prompts)",
        measured.len(),
        args.temperatures.len(),
        methods.len(),
        measured.len() * args.temperatures.len() * methods.len(),
        if args.acceptance.is_some() {
            0
        } else {
            heldout.len()
        }
    );

    let rt = tokio::runtime::Runtime::new()?;
    let (spawned, draft_url, baseline_url, services, baseline) = match &args.draft_addr {
        Some(addr) => {
            let (base, how) = match &args.target_addr {
                Some(b) => (
                    b.clone(),
                    format!("root-only trees through the draft-service at {b}"),
                ),
                None => (
                    addr.clone(),
                    "root-only trees through the benchmarked draft-service (pays its network)"
                        .to_string(),
                ),
            };
            (None, addr.clone(), base, "given addresses".to_string(), how)
        }
        None => {
            let s = spawn_services(args, &rt)?;
            let (d, b) = (s.draft_url.clone(), s.baseline_url.clone());
            let how = if args.rtt_ms > 0.0 || args.two.bandwidth_mbps > 0.0 {
                "root-only trees through a draft-service connected to verify without the delay"
            } else {
                "root-only trees through the same draft-service"
            };
            (Some(s), d, b, "spawned".to_string(), how.to_string())
        }
    };
    let config = RunConfig {
        draft: args.draft.clone(),
        target: args.target.clone(),
        prompts: args.prompts.display().to_string(),
        max_tokens: args.max_tokens,
        seed: args.seed,
        max_levels: args.max_levels,
        raw: args.raw,
        services,
        baseline,
        rtt_ms: args.rtt_ms,
        label: args.label.clone(),
        machine: machine_description(),
        draft_cpus: args.two.draft_cpus.clone(),
        verify_cpus: args.two.verify_cpus.clone(),
        draft_threads: args.draft_threads,
        verify_threads: args.verify_threads,
        bandwidth_mbps: args.two.bandwidth_mbps,
    };
    let mut log = ResultsLog::open(&results, &config)?;
    let outcome = rt.block_on(run_all(
        args,
        &methods,
        &measured,
        &heldout,
        &draft_url,
        &baseline_url,
        &mut log,
    ));
    drop(spawned); // stop the services before writing the report
    outcome?;
    report::write_reports(args, &methods, &log.records)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// p_r = accepted at rank r / trials at rank r (docs/ALGORITHMS.md §6), rescaled if it sums
    /// over 1: what the calibration computes from the summaries' counts.
    fn acceptance_from_counts(accepted: &[u64], trials: &[u64], width: usize) -> Vec<f64> {
        let counts = RankCounts::new(accepted.to_vec(), trials.to_vec());
        normalized_acceptance(counts.rates(width))
    }
    use sequoia_core::planner::expected_tokens;

    #[test]
    fn methods_parse_and_print() {
        for s in [
            "target",
            "auto",
            "chain:4",
            "kxd:2x3",
            "kxd-best:8",
            "sequoia:16",
            "auto+pipe",
            "chain:4+pipe",
            "target+pipe",
        ] {
            let m: Method = s.parse().unwrap();
            assert_eq!(m.to_string(), s);
            assert_eq!(m.is_pipelined(), s.ends_with("+pipe"));
            assert_eq!(m.base().to_string(), s.trim_end_matches("+pipe"));
        }
        assert!(Method::Target.is_baseline());
        assert!(!"target+pipe".parse::<Method>().unwrap().is_baseline());
        assert_eq!(
            "sequoia:8+pipe".parse::<Method>().unwrap().family(),
            "sequoia"
        );
        assert_eq!(
            "kxd:2X3".parse::<Method>().unwrap(),
            Method::KxD { k: 2, d: 3 }
        );
        for bad in [
            "chain",
            "chain:0",
            "chain:x",
            "kxd:2",
            "kxd:0x3",
            "foo",
            "target:1",
            "sequoia:600",
            "auto+pipe+pipe",
            "+pipe",
            "chain:0+pipe",
        ] {
            assert!(bad.parse::<Method>().is_err(), "{bad} should not parse");
        }
        let ms = parse_methods(&["target".into(), "chain:2".into(), "target".into()]).unwrap();
        assert_eq!(ms, vec![Method::Target, Method::Chain(2)]);
        assert!(parse_methods(&[]).is_err());
    }

    #[test]
    fn method_trees_have_the_stated_budget() {
        let p = &EXAMPLE_ACCEPTANCE[..8];
        let nodes = |m: &str| {
            m.parse::<Method>()
                .unwrap()
                .tree(p, 8)
                .unwrap()
                .map(|t| t.len())
        };
        assert_eq!(nodes("target"), Some(1));
        assert_eq!(nodes("chain:4"), Some(5));
        assert_eq!(nodes("kxd:2x2"), Some(5));
        assert_eq!(nodes("sequoia:4"), Some(5));
        assert_eq!(nodes("sequoia:16"), Some(17));
        assert_eq!(nodes("auto"), None);
        assert_eq!(nodes("auto+pipe"), None);
        assert_eq!(nodes("sequoia:4+pipe"), nodes("sequoia:4"));
        let best = Method::KxDBest(8).tree(p, 8).unwrap().unwrap();
        assert!(best.len() <= 9);
        // Sequoia is at least as good as every same-budget baseline under its own vector.
        let seq = Method::Sequoia(8).tree(p, 8).unwrap().unwrap();
        let chain = Method::Chain(8).tree(p, 8).unwrap().unwrap();
        assert!(expected_tokens(&seq, p) >= expected_tokens(&best, p) - 1e-9);
        assert!(expected_tokens(&seq, p) >= expected_tokens(&chain, p) - 1e-9);
        assert!(best.levels() <= 8);
    }

    #[test]
    fn best_k_by_d_respects_limits() {
        let p = [0.9, 0.05];
        // A very accurate rank 1 favours one deep chain.
        assert_eq!(best_k_by_d_shape(&p, 6, 10), (1, 6));
        // ... unless the levels are capped.
        assert_eq!(best_k_by_d_shape(&p, 6, 3), (2, 2)); // a third chain adds nothing (p_3 = 0)
        let flat = [0.3, 0.3, 0.3];
        let (k, d) = best_k_by_d_shape(&flat, 6, 10);
        assert!(k * d <= 6 && k >= 2, "{k}x{d}");
    }

    fn prompts() -> Vec<Prompt> {
        let mut out = vec![];
        for (c, n) in [("a", 3), ("b", 1), ("c", 4)] {
            for i in 0..n {
                out.push(Prompt {
                    id: out.len() as u64 + 1,
                    category: c.into(),
                    text: format!("{c}{i}"),
                });
            }
        }
        out
    }

    #[test]
    fn prompt_selection_interleaves_and_holds_out() {
        let all = prompts();
        let (m, h) = select_prompts(&all, &[], 2, 10).unwrap();
        let names: Vec<&str> = m.iter().map(|p| p.text.as_str()).collect();
        assert_eq!(names, ["a0", "b0", "c0", "a1", "c1"]);
        let held: Vec<&str> = h.iter().map(|p| p.text.as_str()).collect();
        assert_eq!(held, ["a2", "c3", "c2"]);
        let (_, h) = select_prompts(&all, &[], 2, 1).unwrap();
        assert_eq!(h.len(), 1);
        // Everything measured: calibration falls back to measured prompts.
        let (m, h) = select_prompts(&all, &["b".into()], 5, 2).unwrap();
        assert_eq!(m.len(), 1);
        assert_eq!(h[0].text, "b0");
        assert!(select_prompts(&all, &["zzz".into()], 1, 0).is_err());
        assert!(select_prompts(&all, &[], 0, 0).is_err());
    }

    #[test]
    fn prompt_file_parses() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("q.jsonl");
        std::fs::write(
            &f,
            "{\"question_id\": 7, \"category\": \"qa\", \"turns\": [\"hi\", \"more\"]}\n\n\
             {\"turns\": [\"x\"]}\n",
        )
        .unwrap();
        let p = load_prompts(&f).unwrap();
        assert_eq!(p.len(), 2);
        assert_eq!(
            (p[0].id, p[0].category.as_str(), p[0].text.as_str()),
            (7, "qa", "hi")
        );
        assert_eq!(p[1].category, "all");
        std::fs::write(&f, "{\"turns\": 3}\n").unwrap();
        assert!(load_prompts(&f).is_err());
    }

    #[test]
    fn vendored_spec_bench_has_13_categories() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/spec_bench/question.jsonl");
        let all = load_prompts(&path).unwrap();
        assert_eq!(all.len(), 480);
        let (m, h) = select_prompts(&all, &[], 1, 3).unwrap();
        assert_eq!(m.len(), 13);
        assert_eq!(h.len(), 3);
        assert!(h.iter().all(|p| m.iter().all(|q| q.id != p.id)));
        let cats: std::collections::BTreeSet<&str> =
            h.iter().map(|p| p.category.as_str()).collect();
        assert_eq!(
            cats.len(),
            3,
            "calibration prompts come from different categories"
        );
    }

    #[test]
    fn acceptance_estimator() {
        let p = acceptance_from_counts(&[6, 1, 0], &[10, 4, 2], 4);
        assert_eq!(p, vec![0.6, 0.25, 0.0, 0.0]);
        // Sums above 1 (nodes whose q had fewer tokens than the width) are rescaled.
        let p = acceptance_from_counts(&[9, 2], &[10, 2], 2);
        assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12);
    }

    #[test]
    fn results_log_resumes_and_rejects_other_setups() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("results.jsonl");
        let config = RunConfig {
            draft: "d".into(),
            target: "t".into(),
            prompts: "p".into(),
            max_tokens: 16,
            seed: 0,
            max_levels: 8,
            raw: false,
            services: "spawned".into(),
            baseline: "b".into(),
            rtt_ms: 0.0,
            label: None,
            machine: String::new(),
            draft_cpus: None,
            verify_cpus: None,
            draft_threads: None,
            verify_threads: None,
            bandwidth_mbps: 0.0,
        };
        {
            let mut log = ResultsLog::open(&path, &config).unwrap();
            log.append(Record::Run(RunRecord {
                question_id: 3,
                method: "chain:2".into(),
                temperature: 0.7,
                ..RunRecord::default()
            }))
            .unwrap();
            log.append(Record::Run(RunRecord {
                question_id: 4,
                method: "chain:2".into(),
                error: Some("boom".into()),
                ..RunRecord::default()
            }))
            .unwrap();
        }
        // A torn last line is skipped.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"{\"kind\": \"ru")
            .unwrap();
        let mut log = ResultsLog::open(&path, &config).unwrap();
        log.append(Record::Run(RunRecord {
            question_id: 5,
            method: "auto".into(),
            ..RunRecord::default()
        }))
        .unwrap();
        drop(log);
        let log = ResultsLog::open(&path, &config).unwrap();
        let done = log.done();
        assert!(done.contains(&(5, "auto".to_string(), "0".to_string())));
        assert!(done.contains(&(3, "chain:2".to_string(), "0.7".to_string())));
        assert_eq!(done.len(), 2, "failed runs are retried");
        let other = RunConfig {
            max_tokens: 32,
            ..config.clone()
        };
        assert!(ResultsLog::open(&path, &other).is_err());
        let relabelled = RunConfig {
            label: Some("x".into()),
            ..config
        };
        assert!(ResultsLog::open(&path, &relabelled).is_ok());
    }

    /// The whole command against tiny random-weight services started in-process: calibration,
    /// every method kind at T = 0 and T = 0.7, the report, and a resumed run that has nothing
    /// left to do.
    #[test]
    fn end_to_end_on_tiny_services() {
        use clap::Parser;
        use sequoia_tests::{draft_config, start_draft, start_verify, verify_config, TinyPair};

        let pair = TinyPair::new();
        let verify = start_verify(verify_config(&pair.target));
        let mut cfg = draft_config(&pair.draft, &[verify.url()], 8, 4);
        cfg.tree.mode = "auto".into();
        let draft = start_draft(cfg);

        let dir = tempfile::tempdir().unwrap();
        let prompts = dir.path().join("q.jsonl");
        let mut lines = String::new();
        for (i, (cat, text)) in [
            ("a", "hello world"),
            ("a", "The quick brown fox"),
            ("b", "fn main() {}"),
            ("b", "a"),
        ]
        .iter()
        .enumerate()
        {
            lines.push_str(&format!(
                "{{\"question_id\": {}, \"category\": \"{cat}\", \"turns\": [\"{text}\"]}}\n",
                i + 1
            ));
        }
        std::fs::write(&prompts, lines).unwrap();
        let out = dir.path().join("out");
        #[derive(clap::Parser)]
        struct W {
            #[command(flatten)]
            a: BenchArgs,
        }
        let args = W::parse_from([
            "bench",
            "--draft-addr",
            &draft.url(),
            "--raw",
            "--prompts",
            prompts.to_str().unwrap(),
            "--max-prompts-per-category",
            "1",
            "--calibration-prompts",
            "1",
            "--max-tokens",
            "12",
            "--methods",
            "target,chain:2,kxd:2x2,kxd-best:4,sequoia:4,auto,chain:2+pipe",
            "--out-dir",
            out.to_str().unwrap(),
            "--no-charts",
        ])
        .a;
        bench(&args).unwrap();

        let records = ResultsLog::read(&out.join("results.jsonl")).unwrap();
        let runs: Vec<&RunRecord> = records
            .iter()
            .filter_map(|r| match r {
                Record::Run(r) => Some(r),
                _ => None,
            })
            .collect();
        assert_eq!(
            runs.len(),
            2 * 2 * 7,
            "2 prompts × 2 temperatures × 7 methods"
        );
        assert!(runs.iter().all(|r| r.error.is_none()));
        let cal = records
            .iter()
            .filter(|r| matches!(r, Record::Calibration(c) if c.source == "measured"))
            .count();
        assert_eq!(cal, 2, "one measured acceptance vector per temperature");
        for r in &runs {
            assert!(r.generated_tokens > 0 && r.total_ms > 0.0, "{r:?}");
            match r.method.as_str() {
                "target" => assert_eq!((r.nodes, r.plan_mode.as_str()), (1, "request")),
                "chain:2" => assert_eq!(r.nodes, 3),
                "kxd:2x2" => assert_eq!(r.nodes, 5),
                // The DP leaves out nodes worth nothing under the measured vector.
                "sequoia:4" | "kxd-best:4" => assert!((2..=5).contains(&r.nodes), "{r:?}"),
                "auto" => assert_eq!(r.plan_mode, "auto"),
                "chain:2+pipe" => {
                    assert_eq!(r.nodes, 3);
                    assert!(r.pipeline);
                    // Every step after the first either had its tree grown ahead or not.
                    assert!(r.pipeline_hits + r.pipeline_misses < r.steps, "{r:?}");
                }
                _ => {}
            }
        }
        // Exactness: at T = 0 every method emits the target-only tokens.
        for r in runs.iter().filter(|r| r.temperature == 0.0) {
            let target = runs
                .iter()
                .find(|t| {
                    t.temperature == 0.0 && t.method == "target" && t.question_id == r.question_id
                })
                .unwrap();
            assert_eq!(
                r.tokens, target.tokens,
                "{} on prompt {}",
                r.method, r.question_id
            );
        }
        let rep: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
        assert_eq!(rep["complete_groups"], 4);
        let cells = rep["cells"].as_array().unwrap();
        let pipe = cells
            .iter()
            .find(|c| c["method"] == "chain:2+pipe" && c["category"] == "overall")
            .unwrap();
        assert!(pipe["pipeline_hits"].is_u64(), "{pipe}");
        let auto = cells
            .iter()
            .find(|c| c["method"] == "auto" && c["category"] == "overall")
            .unwrap();
        assert!(auto["predicted_speedup"].as_f64().unwrap() > 0.0, "{auto}");
        let md = std::fs::read_to_string(out.join("report.md")).unwrap();
        assert!(md.contains("| **overall** |"), "{md}");

        // Resuming finds everything done: no new runs.
        bench(&args).unwrap();
        let again = ResultsLog::read(&out.join("results.jsonl")).unwrap();
        assert_eq!(again.len(), records.len());
    }
}

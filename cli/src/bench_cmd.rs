//! `sequoia bench`: the benchmark harness (issue 6).
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
//!
//! Budgets count *drafted* tokens, so `chain:4`, `kxd:2x2` and `sequoia:4` all verify 5 nodes.
//! The Sequoia and `kxd-best` trees are planned from an acceptance vector measured at the start
//! of the run on held-out prompts (a wide "spine" tree through the same services, ALGORITHMS.md
//! §6), per temperature, unless `--acceptance` gives one.
//!
//! Services: `--draft-addr` (already running, e.g. across the two-host emulation in
//! `deploy/local/two-hosts.sh`) with `--target-addr` for the target-only baseline (a draft-service
//! next to the verify node; root-only trees make it plain target decoding on the verify host), or
//! no address: both services are spawned here like `sequoia demo` (optionally with a delay proxy
//! between them, `--rtt-ms`).
//!
//! Every finished (prompt, method, temperature) run is appended to `OUT/results.jsonl`; a
//! restarted bench skips what is already there. The report (`report.json`, `report.md`, PNG
//! charts) is computed from that file, over the (prompt, temperature) groups in which every
//! method finished, so every ratio compares the same prompts.

pub(crate) mod charts;
mod report;

use crate::client_cmds::{free_port, wait_ready, Service};
use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use sequoia_proto::v1::generation_client::GenerationClient;
use sequoia_proto::v1::{ChatMessage, GenerateRequest};
use sequoia_shared::planner::{k_by_d_expected, SequoiaDp, EXAMPLE_ACCEPTANCE};
use sequoia_shared::tree::Tree;
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
pub struct BenchArgs {
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
    /// own planner).
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
    /// example vector of ALGORITHMS.md §2 unless --acceptance is given).
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
    #[arg(long, default_value = sequoia_shared::models::QWEN_CODER_0_5B)]
    pub draft: String,
    /// Target model when starting the services (path or default name); a label with
    /// --draft-addr.
    #[arg(long, default_value = sequoia_shared::models::QWEN_CODER_1_5B)]
    pub target: String,
    /// Compute threads of the started draft-service (default: all cores).
    #[arg(long)]
    pub draft_threads: Option<usize>,
    /// Compute threads of the started verify-service (default: all cores).
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
}

/// A speculation method: which tree each step drafts.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Method {
    /// Root-only trees: plain target decoding through the service pair.
    Target,
    /// A chain of `len` drafted tokens.
    Chain(usize),
    /// `k` independent chains of `d` drafted tokens.
    KxD { k: usize, d: usize },
    /// The best K×D with at most this many drafted tokens.
    KxDBest(usize),
    /// The Sequoia-optimal tree with this many drafted tokens.
    Sequoia(usize),
    /// The draft-service's own planner.
    Auto,
}

/// Forced trees are limited to this many drafted tokens (the draft-service accepts 512 nodes).
const MAX_BUDGET: usize = 511;

impl FromStr for Method {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let budget = |v: &str| -> Result<usize, String> {
            let n: usize = v
                .parse()
                .map_err(|_| format!("{s:?}: {v:?} is not a number"))?;
            if n == 0 || n > MAX_BUDGET {
                return Err(format!("{s:?}: budget must be 1..={MAX_BUDGET}"));
            }
            Ok(n)
        };
        let (name, arg) = s.split_once(':').unwrap_or((s, ""));
        match (name, arg) {
            ("target", "") => Ok(Method::Target),
            ("auto", "") => Ok(Method::Auto),
            ("chain", v) => Ok(Method::Chain(budget(v)?)),
            ("sequoia", v) => Ok(Method::Sequoia(budget(v)?)),
            ("kxd-best", v) => Ok(Method::KxDBest(budget(v)?)),
            ("kxd", v) => {
                let (k, d) = v
                    .split_once(['x', 'X'])
                    .ok_or_else(|| format!("{s:?}: expected kxd:KxD, e.g. kxd:2x3"))?;
                let (k, d) = (budget(k)?, budget(d)?);
                if k * d > MAX_BUDGET {
                    return Err(format!("{s:?}: K·D must be at most {MAX_BUDGET}"));
                }
                Ok(Method::KxD { k, d })
            }
            _ => Err(format!(
                "unknown method {s:?} (target, chain:L, kxd:KxD, kxd-best:B, sequoia:B, auto)"
            )),
        }
    }
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Method::Target => write!(f, "target"),
            Method::Chain(l) => write!(f, "chain:{l}"),
            Method::KxD { k, d } => write!(f, "kxd:{k}x{d}"),
            Method::KxDBest(b) => write!(f, "kxd-best:{b}"),
            Method::Sequoia(b) => write!(f, "sequoia:{b}"),
            Method::Auto => write!(f, "auto"),
        }
    }
}

impl Method {
    /// Chart series this method belongs to.
    pub fn family(&self) -> &'static str {
        match self {
            Method::Target => "target",
            Method::Chain(_) => "chain",
            Method::KxD { .. } | Method::KxDBest(_) => "kxd",
            Method::Sequoia(_) => "sequoia",
            Method::Auto => "auto",
        }
    }

    /// The tree to force, planned with acceptance vector `p`; None for `auto`.
    pub fn tree(&self, p: &[f64], max_levels: usize) -> Result<Option<Tree>> {
        Ok(Some(match *self {
            Method::Auto => return Ok(None),
            Method::Target => Tree::chain(1),
            Method::Chain(l) => Tree::chain(l + 1),
            Method::KxD { k, d } => Tree::k_by_d(k, d),
            Method::KxDBest(b) => {
                let (k, d) = best_k_by_d_shape(p, b, max_levels);
                Tree::k_by_d(k, d)
            }
            Method::Sequoia(b) => {
                let levels = max_levels.max(1);
                SequoiaDp::solve(p, b + 1, levels)?.tree(b + 1, levels)
            }
        }))
    }
}

/// K and D of the best K×D tree with K·D ≤ `budget` drafted tokens and D + 1 ≤ `max_levels`.
fn best_k_by_d_shape(p: &[f64], budget: usize, max_levels: usize) -> (usize, usize) {
    let mut best = (1, 1, f64::NEG_INFINITY);
    for d in 1..max_levels.max(2) {
        for k in 1..=budget / d {
            let g = k_by_d_expected(p, k, d);
            if g > best.2 + 1e-12 {
                best = (k, d, g);
            }
        }
    }
    (best.0, best.1)
}

/// Parse and de-duplicate the method list.
pub fn parse_methods(specs: &[String]) -> Result<Vec<Method>> {
    let mut out: Vec<Method> = Vec::new();
    for s in specs.iter().filter(|s| !s.trim().is_empty()) {
        let m: Method = s.parse().map_err(anyhow::Error::msg)?;
        if !out.contains(&m) {
            out.push(m);
        }
    }
    if out.is_empty() {
        bail!("--methods is empty");
    }
    Ok(out)
}

/// Key of a temperature in records and reports ("0", "0.7").
pub fn temp_key(t: f32) -> String {
    format!("{t}")
}

/// A prompt from the file.
#[derive(Debug, Clone)]
pub struct Prompt {
    pub id: u64,
    pub category: String,
    pub text: String,
}

/// Every prompt of a Spec-Bench style JSONL file, in file order.
pub fn load_prompts(path: &Path) -> Result<Vec<Prompt>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))?;
        let text = v
            .get("turns")
            .and_then(|t| t.get(0))
            .and_then(|t| t.as_str())
            .with_context(|| {
                format!("{}:{}: no \"turns\" list of strings", path.display(), i + 1)
            })?;
        out.push(Prompt {
            id: v
                .get("question_id")
                .and_then(|q| q.as_u64())
                .unwrap_or(i as u64 + 1),
            category: v
                .get("category")
                .and_then(|c| c.as_str())
                .unwrap_or("all")
                .to_string(),
            text: text.to_string(),
        });
    }
    if out.is_empty() {
        bail!("{} has no prompts", path.display());
    }
    Ok(out)
}

/// The measured prompts (the first `per_category` of each category, interleaved across
/// categories so a partial run covers all of them) and up to `heldout` other prompts for
/// calibration (the last ones of the categories, spread over them; the measured ones when none
/// are left).
pub fn select_prompts(
    all: &[Prompt],
    categories: &[String],
    per_category: usize,
    heldout: usize,
) -> Result<(Vec<Prompt>, Vec<Prompt>)> {
    let mut order: Vec<String> = Vec::new();
    let mut by_cat: BTreeMap<String, Vec<&Prompt>> = BTreeMap::new();
    for p in all {
        if !categories.is_empty() && !categories.contains(&p.category) {
            continue;
        }
        if !by_cat.contains_key(&p.category) {
            order.push(p.category.clone());
        }
        by_cat.entry(p.category.clone()).or_default().push(p);
    }
    for c in categories {
        if !by_cat.contains_key(c) {
            bail!("no prompts of category {c:?} in the prompt file");
        }
    }
    // Interleave across categories: the i-th prompt of every category, for i = 0, 1, ...
    let mut measured: Vec<Prompt> = Vec::new();
    for i in 0..per_category {
        for c in &order {
            if let Some(p) = by_cat[c].get(i) {
                measured.push((*p).clone());
            }
        }
    }
    if measured.is_empty() {
        bail!("no prompts selected (is --max-prompts-per-category 0?)");
    }
    // Calibration prompts come from the end of each category, so that a later run with more
    // prompts per category (resuming into the same results) does not measure them.
    let longest = by_cat.values().map(Vec::len).max().unwrap_or(0);
    let mut cal: Vec<Prompt> = Vec::new();
    for i in 0..longest {
        for c in &order {
            let v = &by_cat[c];
            if v.len() > per_category + i {
                cal.push(v[v.len() - 1 - i].clone());
            }
        }
    }
    if cal.is_empty() {
        cal = measured.clone();
    }
    // Spread the calibration prompts over the categories (the list is interleaved by category).
    let stride = (order.len().min(cal.len()) / heldout.max(1)).max(1);
    let cal = cal.into_iter().step_by(stride).take(heldout).collect();
    Ok((measured, cal))
}

/// Setup of a run (the first line of results.jsonl).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RunConfig {
    pub draft: String,
    pub target: String,
    pub prompts: String,
    pub max_tokens: u32,
    pub seed: u64,
    pub max_levels: usize,
    pub raw: bool,
    /// "spawned" or "given addresses".
    pub services: String,
    /// How the target-only baseline is measured.
    pub baseline: String,
    #[serde(default)]
    pub rtt_ms: f64,
    #[serde(default)]
    pub label: Option<String>,
    #[serde(default)]
    pub machine: String,
}

impl RunConfig {
    /// Settings that change results: a results file is only resumed with the same ones.
    fn same_experiment(&self, other: &RunConfig) -> bool {
        self.draft == other.draft
            && self.target == other.target
            && self.max_tokens == other.max_tokens
            && self.seed == other.seed
            && self.max_levels == other.max_levels
            && self.raw == other.raw
    }
}

/// The acceptance vector used to plan fixed trees at one temperature.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Calibration {
    pub temperature: f32,
    pub acceptance: Vec<f64>,
    /// "measured", "given" or "example".
    pub source: String,
    #[serde(default)]
    pub prompts: usize,
    #[serde(default)]
    pub accepted_by_rank: Vec<u64>,
    #[serde(default)]
    pub trials_by_rank: Vec<u64>,
}

/// One generation.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RunRecord {
    pub question_id: u64,
    pub category: String,
    pub method: String,
    pub temperature: f32,
    /// Tree nodes (root included) and levels used; for `auto` the final plan.
    pub nodes: u32,
    pub levels: u32,
    /// The plan's mode as the draft-service reports it ("request", "auto", "fixed").
    pub plan_mode: String,
    /// Auto mode: the planner's predicted speedup.
    pub predicted_speedup: f64,
    pub prompt_tokens: u32,
    pub generated_tokens: u32,
    pub steps: u32,
    pub accepted_by_rank: Vec<u64>,
    pub trials_by_rank: Vec<u64>,
    pub total_ms: f64,
    pub prefill_ms: f64,
    pub draft_ms: f64,
    pub verify_ms: f64,
    pub network_ms: f64,
    pub finish_reason: String,
    pub tokens: Vec<u32>,
    /// Set when the generation failed (the other fields are then empty).
    pub error: Option<String>,
}

impl RunRecord {
    /// Decode time: total minus prefill.
    pub fn decode_ms(&self) -> f64 {
        (self.total_ms - self.prefill_ms).max(0.0)
    }
}

/// A line of results.jsonl.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Record {
    Config(RunConfig),
    Calibration(Calibration),
    Run(RunRecord),
}

/// results.jsonl: read on start, appended (and flushed) after every run.
struct ResultsLog {
    file: std::fs::File,
    records: Vec<Record>,
}

impl ResultsLog {
    fn read(path: &Path) -> Result<Vec<Record>> {
        if !path.exists() {
            return Ok(vec![]);
        }
        let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let mut out = Vec::new();
        for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
            let line = line?;
            if line.trim().is_empty() {
                continue;
            }
            match serde_json::from_str(&line) {
                Ok(r) => out.push(r),
                // A run killed mid-write leaves a partial last line: ignore it.
                Err(e) => eprintln!("{}:{}: skipped ({e})", path.display(), i + 1),
            }
        }
        Ok(out)
    }

    /// Open for appending; a new file starts with `config`, an existing one must come from the
    /// same experiment.
    fn open(path: &Path, config: &RunConfig) -> Result<Self> {
        let records = Self::read(path)?;
        if let Some(Record::Config(old)) = records.first() {
            if !old.same_experiment(config) {
                bail!(
                    "{} holds results of a different setup ({} → {}, max_tokens {}, seed {}, \
                     max_levels {}, raw {}); use another --out-dir or --restart",
                    path.display(),
                    old.draft,
                    old.target,
                    old.max_tokens,
                    old.seed,
                    old.max_levels,
                    old.raw
                );
            }
        }
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        // Terminate a torn last line so the next record starts on a line of its own.
        let bytes = std::fs::read(path)?;
        if bytes.last().is_some_and(|&b| b != b'\n') {
            file.write_all(b"\n")?;
        }
        let mut log = Self {
            file,
            records: vec![],
        };
        if records.is_empty() {
            log.append(Record::Config(config.clone()))?;
        } else {
            log.records = records;
        }
        Ok(log)
    }

    fn append(&mut self, r: Record) -> Result<()> {
        let mut line = serde_json::to_string(&r)?;
        line.push('\n');
        self.file.write_all(line.as_bytes())?;
        self.file.flush()?;
        self.records.push(r);
        Ok(())
    }

    fn calibration(&self, t: f32) -> Option<&Calibration> {
        self.records.iter().rev().find_map(|r| match r {
            Record::Calibration(c) if temp_key(c.temperature) == temp_key(t) => Some(c),
            _ => None,
        })
    }

    /// (question_id, method, temperature key) of every successful run.
    fn done(&self) -> HashSet<(u64, String, String)> {
        self.records
            .iter()
            .filter_map(|r| match r {
                Record::Run(r) if r.error.is_none() => {
                    Some((r.question_id, r.method.clone(), temp_key(r.temperature)))
                }
                _ => None,
            })
            .collect()
    }
}

/// "N cores, CPU model" of this machine.
pub fn machine_description() -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    format!("{cores} cores, {model}")
}

/// Services started by the bench (stopped when dropped).
struct Spawned {
    _services: Vec<Service>,
    proxy_stop: Option<tokio::sync::oneshot::Sender<()>>,
    draft_url: String,
    baseline_url: String,
}

impl Drop for Spawned {
    fn drop(&mut self) {
        if let Some(tx) = self.proxy_stop.take() {
            let _ = tx.send(());
        }
    }
}

fn spawn_services(args: &BenchArgs, rt: &tokio::runtime::Runtime) -> Result<Spawned> {
    let draft = crate::engine_cmds::resolve_model(&args.draft)?;
    let target = crate::engine_cmds::resolve_model(&args.target)?;
    let logs = args.out_dir.join("logs");
    std::fs::create_dir_all(&logs)?;
    let threads = |t: Option<usize>| -> Vec<String> {
        t.map(|t| vec!["--threads".into(), t.to_string()])
            .unwrap_or_default()
    };
    let vport = free_port()?;
    let verify_url = format!("http://127.0.0.1:{vport}");
    eprintln!(
        "== starting verify-service ({}) on {verify_url}; logs in {}",
        target.display(),
        logs.display()
    );
    let mut verify_args = vec![
        "--model".into(),
        target.display().to_string(),
        "--listen".into(),
        format!("127.0.0.1:{vport}"),
    ];
    verify_args.extend(threads(args.verify_threads));
    let mut verify = Service::spawn("verify-service", &verify_args, &[], &logs)?;
    rt.block_on(wait_ready(
        &mut verify,
        &verify_url,
        Duration::from_secs(300),
    ))?;
    let mut services = vec![verify];

    // The delay proxy runs on the bench's runtime, between the draft-service and verify.
    let (mut proxy_stop, mut spec_verify_url) = (None, verify_url.clone());
    if args.rtt_ms > 0.0 {
        let rtt = Duration::from_secs_f64(args.rtt_ms / 1e3);
        let proxy = rt.block_on(crate::delay_proxy::DelayProxy::bind(
            "127.0.0.1:0",
            &format!("127.0.0.1:{vport}"),
            rtt,
        ))?;
        spec_verify_url = format!("http://{}", proxy.local_addr()?);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        rt.spawn(proxy.run(async move {
            let _ = rx.await;
        }));
        proxy_stop = Some(tx);
        eprintln!(
            "== delay proxy {spec_verify_url} -> {verify_url} adds {} ms round trip",
            args.rtt_ms
        );
    }
    let mut start_draft = |name: &'static str, verify: &str, auto: bool| -> Result<String> {
        let port = free_port()?;
        let url = format!("http://127.0.0.1:{port}");
        let mut a = vec![
            "--model".into(),
            draft.display().to_string(),
            "--verify".into(),
            verify.to_string(),
            "--listen".into(),
            format!("127.0.0.1:{port}"),
        ];
        a.extend(threads(args.draft_threads));
        let mut env = vec![(
            "SEQUOIA_TREE__MODE",
            if auto { "auto" } else { "fixed" }.into(),
        )];
        if let Some(n) = args.auto_max_nodes {
            env.push(("SEQUOIA_TREE__NODES", n.to_string()));
        }
        eprintln!("== starting {name} on {url} (verify: {verify})");
        // Each draft-service logs into its own folder (the log is named after the binary).
        let dir = logs.join(name);
        std::fs::create_dir_all(&dir)?;
        let mut svc = Service::spawn("draft-service", &a, &env, &dir)?;
        rt.block_on(wait_ready(&mut svc, &url, Duration::from_secs(300)))?;
        services.push(svc);
        Ok(url)
    };
    let draft_url = start_draft("draft-service", &spec_verify_url, true)?;
    let baseline_url = if proxy_stop.is_some() {
        start_draft("baseline-draft-service", &verify_url, false)?
    } else {
        draft_url.clone()
    };
    Ok(Spawned {
        _services: services,
        proxy_stop,
        draft_url,
        baseline_url,
    })
}

/// A finished generation as the bench records it.
async fn generate(
    client: &mut GenerationClient<Channel>,
    req: GenerateRequest,
) -> Result<RunRecord, tonic::Status> {
    let mut stream = client.generate(req).await?.into_inner();
    let mut rec = RunRecord::default();
    while let Some(chunk) = stream.message().await? {
        rec.tokens.extend(&chunk.token_ids);
        if let Some(s) = chunk.summary {
            rec.prompt_tokens = s.prompt_tokens;
            rec.generated_tokens = s.generated_tokens;
            rec.steps = s.steps;
            rec.accepted_by_rank = s.accepted_by_rank;
            rec.trials_by_rank = s.trials_by_rank;
            rec.finish_reason = s.finish_reason;
            if let Some(t) = s.timings {
                rec.total_ms = t.total_ms;
                rec.prefill_ms = t.prefill_ms;
                rec.draft_ms = t.draft_ms;
                rec.verify_ms = t.verify_ms;
                rec.network_ms = t.network_ms;
            }
            if let Some(p) = s.plan {
                rec.nodes = p.nodes;
                rec.levels = p.levels;
                rec.plan_mode = p.mode;
                rec.predicted_speedup = p.predicted_speedup;
            }
        }
    }
    Ok(rec)
}

fn request(
    args: &BenchArgs,
    prompt: &Prompt,
    t: f32,
    max_tokens: u32,
    tree: Option<&Tree>,
) -> GenerateRequest {
    let mut req = GenerateRequest {
        max_tokens,
        temperature: t,
        top_p: 1.0,
        seed: Some(args.seed.wrapping_add(prompt.id)),
        tree_parents: tree.map(|t| t.parents().to_vec()).unwrap_or_default(),
        ..Default::default()
    };
    if args.raw {
        req.prompt = prompt.text.clone();
    } else {
        req.messages = vec![ChatMessage {
            role: "user".into(),
            content: prompt.text.clone(),
        }];
    }
    req
}

/// A spine: `width` children at every level along the first child, `depth` levels deep.
fn spine(width: usize, depth: usize) -> Tree {
    let mut parents = vec![-1i32];
    let mut head = 0i32;
    for _ in 0..depth {
        let first = parents.len() as i32;
        parents.extend(std::iter::repeat_n(head, width));
        head = first;
    }
    Tree::from_parents(&parents).expect("a spine is a valid tree")
}

/// p_r = accepted at rank r / trials at rank r (ALGORITHMS.md §6), rescaled if it sums over 1.
pub fn acceptance_from_counts(accepted: &[u64], trials: &[u64], width: usize) -> Vec<f64> {
    let mut p: Vec<f64> = (0..width)
        .map(|r| {
            let (a, t) = (
                accepted.get(r).copied().unwrap_or(0),
                trials.get(r).copied().unwrap_or(0),
            );
            if t == 0 {
                0.0
            } else {
                a as f64 / t as f64
            }
        })
        .collect();
    let sum: f64 = p.iter().sum();
    if sum > 1.0 {
        p.iter_mut().for_each(|x| *x /= sum);
    }
    p
}

fn add_counts(into: &mut Vec<u64>, from: &[u64]) {
    if into.len() < from.len() {
        into.resize(from.len(), 0);
    }
    for (a, b) in into.iter_mut().zip(from) {
        *a += b;
    }
}

/// Acceptance vector for temperature `t`: given, stored from an earlier start, or measured now.
async fn calibrate(
    args: &BenchArgs,
    client: &mut GenerationClient<Channel>,
    prompts: &[Prompt],
    t: f32,
) -> Result<Calibration> {
    if let Some(p) = &args.acceptance {
        sequoia_shared::planner::validate_acceptance(p)?;
        return Ok(Calibration {
            temperature: t,
            acceptance: p.clone(),
            source: "given".into(),
            prompts: 0,
            accepted_by_rank: vec![],
            trials_by_rank: vec![],
        });
    }
    if prompts.is_empty() {
        return Ok(Calibration {
            temperature: t,
            acceptance: EXAMPLE_ACCEPTANCE[..CALIBRATION_WIDTH].to_vec(),
            source: "example".into(),
            prompts: 0,
            accepted_by_rank: vec![],
            trials_by_rank: vec![],
        });
    }
    let shape = spine(CALIBRATION_WIDTH, CALIBRATION_DEPTH);
    let (mut acc, mut trials) = (vec![], vec![]);
    for p in prompts {
        let req = request(
            args,
            p,
            t,
            args.max_tokens.min(CALIBRATION_TOKENS),
            Some(&shape),
        );
        let rec = generate(client, req)
            .await
            .map_err(|s| anyhow::anyhow!("calibration generation failed: {}", s.message()))?;
        add_counts(&mut acc, &rec.accepted_by_rank);
        add_counts(&mut trials, &rec.trials_by_rank);
    }
    Ok(Calibration {
        temperature: t,
        acceptance: acceptance_from_counts(&acc, &trials, CALIBRATION_WIDTH),
        source: "measured".into(),
        prompts: prompts.len(),
        accepted_by_rank: acc,
        trials_by_rank: trials,
    })
}

async fn connect(url: &str) -> Result<GenerationClient<Channel>> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())?
        .connect()
        .await
        .with_context(|| format!("cannot connect to draft-service at {url}"))?;
    Ok(GenerationClient::new(channel))
}

/// Errors that mean the services are gone: stop the bench instead of recording a failure.
fn is_fatal(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
    )
}

/// Run every missing (prompt, temperature, method) combination.
async fn run_all(
    args: &BenchArgs,
    methods: &[Method],
    measured: &[Prompt],
    heldout: &[Prompt],
    draft_url: &str,
    baseline_url: &str,
    log: &mut ResultsLog,
) -> Result<()> {
    let mut spec = connect(draft_url).await?;
    let mut base = connect(baseline_url).await?;

    // Acceptance vectors for the fixed trees, one per temperature (reused on resume).
    let mut trees: BTreeMap<(String, String), Option<Tree>> = BTreeMap::new();
    for &t in &args.temperatures {
        let cal = match log.calibration(t) {
            Some(c) if args.acceptance.is_none() => c.clone(),
            _ => {
                eprintln!("== acceptance vector at T = {t}");
                let c = calibrate(args, &mut spec, heldout, t).await?;
                log.append(Record::Calibration(c.clone()))?;
                c
            }
        };
        eprintln!(
            "T = {t}: acceptance ({}) {}",
            cal.source,
            cal.acceptance
                .iter()
                .map(|p| format!("{p:.3}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        for m in methods {
            let tree = m.tree(&cal.acceptance, args.max_levels)?;
            if let Some(tree) = &tree {
                eprintln!("  {m}: {} nodes, {} levels", tree.len(), tree.levels());
            }
            trees.insert((temp_key(t), m.to_string()), tree);
        }
    }

    let done = log.done();
    let total = measured.len() * args.temperatures.len() * methods.len();
    let todo: usize = measured
        .iter()
        .flat_map(|p| {
            args.temperatures.iter().flat_map(move |&t| {
                methods
                    .iter()
                    .map(move |m| (p.id, m.to_string(), temp_key(t)))
            })
        })
        .filter(|k| !done.contains(k))
        .count();
    if todo == 0 {
        eprintln!("== all {total} runs already in the results file");
        return Ok(());
    }

    // Warm-up (not recorded): connections, caches, and the auto planner's first-use profiling,
    // which would otherwise land in the first auto run's decode time.
    eprintln!("== warm-up");
    for &t in &args.temperatures {
        let p = &measured[0];
        for m in methods {
            let tree = &trees[&(temp_key(t), m.to_string())];
            let client = if *m == Method::Target {
                &mut base
            } else {
                &mut spec
            };
            generate(client, request(args, p, t, 8, tree.as_ref()))
                .await
                .map_err(|s| anyhow::anyhow!("warm-up generation ({m}) failed: {}", s.message()))?;
        }
    }

    let bar = ProgressBar::new(total as u64);
    bar.set_style(ProgressStyle::with_template(
        "{bar:30} {pos}/{len} runs {msg} [{elapsed_precise}, eta {eta}]",
    )?);
    bar.set_position((total - todo) as u64);
    let mut auto_fixed_warned = false;
    for (pi, prompt) in measured.iter().enumerate() {
        for &t in &args.temperatures {
            // Rotate the method order per prompt so no method always runs first.
            for j in 0..methods.len() {
                let m = &methods[(j + pi) % methods.len()];
                let key = (prompt.id, m.to_string(), temp_key(t));
                if done.contains(&key) {
                    continue;
                }
                bar.set_message(format!("{} #{} T={t} {m}", prompt.category, prompt.id));
                let tree = trees[&(temp_key(t), m.to_string())].as_ref();
                let client = if *m == Method::Target {
                    &mut base
                } else {
                    &mut spec
                };
                let req = request(args, prompt, t, args.max_tokens, tree);
                let mut rec = match generate(client, req).await {
                    Ok(r) => r,
                    Err(s) if is_fatal(&s) => {
                        bar.abandon();
                        bail!(
                            "{m} on prompt {} failed ({:?}): {}",
                            prompt.id,
                            s.code(),
                            s.message()
                        );
                    }
                    Err(s) => RunRecord {
                        error: Some(format!("{:?}: {}", s.code(), s.message())),
                        ..RunRecord::default()
                    },
                };
                if *m == Method::Auto && rec.plan_mode == "fixed" && !auto_fixed_warned {
                    bar.println(
                        "warning: the draft-service runs tree.mode = \"fixed\"; `auto` measures \
                         its configured tree",
                    );
                    auto_fixed_warned = true;
                }
                rec.question_id = prompt.id;
                rec.category = prompt.category.clone();
                rec.method = m.to_string();
                rec.temperature = t;
                if let Some(e) = &rec.error {
                    bar.println(format!("{m} on prompt {} failed: {e}", prompt.id));
                }
                log.append(Record::Run(rec))?;
                bar.inc(1);
            }
        }
    }
    bar.finish();
    Ok(())
}

/// The `sequoia bench` command.
pub fn bench(args: &BenchArgs) -> Result<()> {
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
            let how = if args.rtt_ms > 0.0 {
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
    use sequoia_shared::planner::expected_tokens;

    #[test]
    fn methods_parse_and_print() {
        for s in [
            "target",
            "auto",
            "chain:4",
            "kxd:2x3",
            "kxd-best:8",
            "sequoia:16",
        ] {
            let m: Method = s.parse().unwrap();
            assert_eq!(m.to_string(), s);
        }
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
    fn spine_shape() {
        let s = spine(3, 2);
        assert_eq!(s.len(), 7);
        assert_eq!(s.levels(), 3);
        assert_eq!(s.children(0).len(), 3);
        assert_eq!(s.children(1).len(), 3);
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
            "target,chain:2,kxd:2x2,kxd-best:4,sequoia:4,auto",
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
            2 * 2 * 6,
            "2 prompts × 2 temperatures × 6 methods"
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
        let md = std::fs::read_to_string(out.join("report.md")).unwrap();
        assert!(md.contains("| **overall** |"), "{md}");

        // Resuming finds everything done: no new runs.
        bench(&args).unwrap();
        let again = ResultsLog::read(&out.join("results.jsonl")).unwrap();
        assert_eq!(again.len(), records.len());
    }
}

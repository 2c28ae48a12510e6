//! `sequoia bench capacity`: how many committed tokens per second one verify node delivers to
//! N concurrent sessions, with its batch scheduler on and off, measured on the verify node alone.
//!
//! At T = 0 the committed text is the target's greedy continuation whatever the trees propose, so
//! the draft side can be replayed instead of run: once per prompt, the target's continuation is
//! computed, and for every position of it the draft model's tree from that prefix is recorded
//! (`OUT/trees.json`, reused by later runs with the same settings). A replayed session opens
//! with the prompt, sends the recorded tree for its current position, and moves on by what the
//! verdict accepted. No draft model runs during the measurement, so the figures are the verify
//! node's. Each verdict is checked against the recorded continuation: a replay that diverges
//! means the node is not exact, and the bench stops with an error.
//!
//! Rows: for N in `--sessions`, with batching on and off, against verify-service processes
//! started here with the same threads and the prefix cache off (every session pays its prefill):
//! - `tree`: the recorded trees, whole;
//! - `load-aware`: before each step the session cuts the recorded tree to the size n that
//!   maximizes expected tokens / t_v(n · S), where t_v is the node's measured forward time
//!   (`Profile`), S the sessions in its last batch (the verdict's `batch_sessions`): every
//!   session sending a tree like this one, and the expected tokens are what the recorded trees
//!   cut to n nodes commit on average over the recording (the acceptance the draft's running
//!   estimate converges to). This is the rule the draft's planner follows;
//! - `plain`: root-only trees, i.e. the target alone decoding N sessions.
//!
//! The batched and unbatched nodes run side by side and take turns row by row, so that a slow
//! spell of the host does not fall on one side of a ratio only. Besides the figures from each
//! row's start (prefill included), a row reports the stretch in which every session was
//! decoding: the node's throughput under the full load.

use super::*;
use sequoia_core::planner::cost::{tree_pays_under_load, CostCurve};
use sequoia_core::sampling::SamplingParams;
use sequoia_core::tree::Tree;
use sequoia_engine::drafting::DraftSession;
use sequoia_engine::tokenizer::{ChatMessage, TextTokenizer};
use sequoia_engine::{LoadOptions, Model};
use sequoia_proto::v1 as pb;
use sequoia_proto::v1::verifier_client::VerifierClient;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::time::Instant;
use tokio_stream::wrappers::ReceiverStream;

#[derive(clap::Args, Debug, Clone)]
pub struct CapacityArgs {
    /// Draft model (records the trees; not run during the measurement).
    #[arg(long, default_value = "qwen2.5-coder-0.5b")]
    pub draft: String,
    /// Target model (served by the verify-service under test).
    #[arg(long, default_value = "qwen2.5-coder-1.5b")]
    pub target: String,
    /// Prompt file (Spec-Bench JSONL); the first prompt of each category is used, in turn.
    #[arg(long, default_value = "tests/data/spec_bench/question.jsonl")]
    pub prompts: PathBuf,
    /// Distinct prompts (sessions take them in turn).
    #[arg(long, default_value_t = 4)]
    pub prompt_count: usize,
    /// New tokens per session.
    #[arg(long, default_value_t = 48)]
    pub max_tokens: usize,
    /// Tree size (nodes, root included) of the recorded Sequoia trees.
    #[arg(long, default_value_t = 8)]
    pub nodes: usize,
    /// Concurrent sessions per row.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    pub sessions: Vec<usize>,
    /// Compute threads of the verify-service (default: all cores) and of the recording.
    #[arg(long)]
    pub threads: Option<usize>,
    /// Output folder (trees.json, capacity.json, capacity.md, logs/).
    #[arg(long, default_value = "bench-out/capacity")]
    pub out_dir: PathBuf,
    /// Which verify-node settings to measure: `on`, `off` or both (default).
    #[arg(long, value_delimiter = ',', default_value = "on,off")]
    pub batching: Vec<String>,
    /// The batched node's `batch.max_wait_us` (default: the service's own).
    #[arg(long)]
    pub max_wait_us: Option<u64>,
    /// Print the JSON report to stdout instead of the table. (Every row's steps are written to
    /// `OUT/logs/steps-N-METHOD-on|off.csv`.)
    #[arg(long)]
    pub json: bool,
}

/// The recorded draft side of one prompt.
#[derive(Serialize, Deserialize)]
struct Recorded {
    prompt: Vec<u32>,
    /// The target's greedy continuation.
    continuation: Vec<u32>,
    /// `trees[c]`: the draft's tree (parents, tokens) once `c` tokens of the continuation are
    /// committed (root = the last committed token).
    trees: Vec<(Vec<i32>, Vec<u32>)>,
}

#[derive(Serialize, Deserialize)]
struct Recording {
    draft: String,
    target: String,
    nodes: usize,
    max_tokens: usize,
    prompts: Vec<Recorded>,
}

impl Recording {
    /// Mean tokens a step commits (accepted nodes plus the target's own token) with the
    /// recorded trees cut to their first n nodes, n = 1..=`full`, over every recorded position:
    /// the acceptance these trees actually have on these prompts, which is what the draft's
    /// running estimate converges to (the planner's input in the service).
    fn tokens_per_step(&self, full: usize) -> Vec<f64> {
        let mut sums = vec![0.0; full];
        let mut positions = 0usize;
        for p in &self.prompts {
            for (c, (parents, tokens)) in p.trees.iter().enumerate() {
                positions += 1;
                let ahead = p.continuation.get(c..).unwrap_or_default();
                for (i, sum) in sums.iter_mut().enumerate() {
                    // A BFS prefix of a tree is a tree.
                    let n = (i + 1).min(parents.len()).min(tokens.len());
                    let Ok(cut) = Tree::from_parents(&parents[..n]) else {
                        continue;
                    };
                    let (_, accepted) = cut.follow_chain(&tokens[..n], ahead);
                    // The step commits the accepted path and one token of the target's, but
                    // never past the continuation's end.
                    *sum += (accepted + 1).min(ahead.len()) as f64;
                }
            }
        }
        sums.iter().map(|s| s / positions.max(1) as f64).collect()
    }
}

/// How a replayed session picks each step's tree.
#[derive(Clone, Copy, PartialEq)]
enum Method {
    Tree,
    LoadAware,
    Plain,
}

impl Method {
    fn name(self) -> &'static str {
        match self {
            Method::Tree => "tree",
            Method::LoadAware => "load-aware",
            Method::Plain => "plain",
        }
    }
}

#[derive(Clone)]
struct Policy {
    method: Method,
    /// The node's forward time by rows.
    curve: CostCurve,
    /// Expected tokens per step of the recorded shape cut to its first n nodes (index n − 1).
    expected: Vec<f64>,
}

impl Policy {
    /// Nodes of the recorded tree to send, given the sessions in the node's last batch.
    fn nodes(&self, full: usize, sessions: usize) -> usize {
        match self.method {
            Method::Tree => full,
            Method::Plain => 1,
            Method::LoadAware => {
                let rate = |n: usize| self.expected[n - 1] / self.curve.at(n * sessions);
                let best = (1..=full.min(self.expected.len()))
                    .max_by(|&a, &b| rate(a).total_cmp(&rate(b)))
                    .unwrap_or(1);
                // The planner's margin under load (`LOAD_MARGIN`).
                if tree_pays_under_load(sessions as f64, rate(best), rate(1)) {
                    best
                } else {
                    1
                }
            }
        }
    }
}

/// The node's forward time at a range of row counts (its `Profile` RPC), at a typical context.
async fn verify_curve(url: &str, rec: &Recording) -> Result<CostCurve> {
    let mut client = VerifierClient::connect(url.to_string()).await?;
    let context = rec
        .prompts
        .iter()
        .map(|p| p.prompt.len())
        .max()
        .unwrap_or(64) as u32;
    let sizes = vec![1u32, 2, 4, 8, 16, 32, 64, 128];
    let r = client
        .profile(pb::ProfileRequest {
            tree_sizes: sizes.clone(),
            context_length: context,
            repeats: 2,
        })
        .await?
        .into_inner();
    Ok(CostCurve::new(sizes, r.forward_ms)?)
}

/// One row of the report.
#[derive(Serialize, Debug, Clone)]
pub struct CapacityRow {
    pub sessions: usize,
    pub batched: bool,
    /// "tree" (recorded draft trees), "load-aware" (cut to the node's load) or "plain"
    /// (root-only: the target alone).
    pub method: String,
    pub aggregate_tokens_per_second: f64,
    pub mean_tokens_per_step: f64,
    pub p50_step_ms: f64,
    pub p99_step_ms: f64,
    pub steps: usize,
    pub tokens: usize,
    pub wall_s: f64,
    /// Mean sessions per forward, as the verdicts reported them.
    pub mean_batch_sessions: f64,
    /// Seconds until every session had its prompt prefilled (its `open` answered).
    pub all_open_s: f64,
    /// The stretch in which every session was decoding: from the last session's first tree
    /// to the first session's last verdict (0 where the sessions never all decoded at once).
    pub steady_s: f64,
    /// Committed tokens per second in that stretch (verdicts that arrived in it): the node's
    /// throughput with all N sessions running, without the prompts' prefill or the tail.
    pub steady_tokens_per_second: f64,
    /// Mean sessions per forward in that stretch.
    pub steady_batch_sessions: f64,
}

pub fn capacity(args: &CapacityArgs) -> Result<()> {
    if args.sessions.is_empty() || args.sessions.contains(&0) {
        bail!("--sessions needs positive counts, e.g. 1,2,4,8");
    }
    if args.nodes == 0 || args.nodes > 512 {
        bail!("--nodes must be in 1..=512");
    }
    if args.prompt_count == 0 || args.max_tokens == 0 {
        bail!("--prompt-count and --max-tokens must be positive");
    }
    std::fs::create_dir_all(args.out_dir.join("logs"))?;
    let target = crate::engine_cmds::resolve_model(&args.target)?;
    let recording = record(args, &target)?;
    let rt = tokio::runtime::Runtime::new()?;
    let mut rows = Vec::new();
    let mut settings = Vec::new();
    for b in &args.batching {
        match b.as_str() {
            "on" => settings.push(true),
            "off" => settings.push(false),
            other => bail!("--batching takes on and/or off, got {other:?}"),
        }
    }
    // Both nodes up at once and the settings alternated row by row, so a slow spell of the
    // host lands on both sides of a ratio rather than on one.
    let mut nodes = Vec::new();
    for &batched in &settings {
        let (svc, url) = start_verify(args, &target, batched, &rt)?;
        let curve = rt.block_on(verify_curve(&url, &recording))?;
        eprintln!(
            "== verify forward times (batching {batched}): {:?} ms at sizes {:?}",
            curve.ms, curve.sizes
        );
        nodes.push((batched, svc, url, curve));
    }
    let shape = Tree::from_parents(&recording.prompts[0].trees[0].0)?;
    let expected = recording.tokens_per_step(shape.len());
    eprintln!(
        "== tokens per step of the recorded trees cut to n nodes, n = 1..{}: {}",
        shape.len(),
        expected
            .iter()
            .map(|e| format!("{e:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    for &n in &args.sessions {
        for method in [Method::Tree, Method::LoadAware, Method::Plain] {
            for (batched, _svc, url, curve) in &nodes {
                eprintln!(
                    "== {n} sessions, {}, batching {}",
                    method.name(),
                    if *batched { "on" } else { "off" }
                );
                let policy = Policy {
                    method,
                    curve: curve.clone(),
                    expected: expected.clone(),
                };
                let row = rt.block_on(replay(
                    url,
                    &recording,
                    n,
                    policy,
                    *batched,
                    &args.out_dir.join("logs"),
                ))?;
                eprintln!(
                    "   {:.1} tok/s, {:.2} tokens/step, p50 {:.0} ms, p99 {:.0} ms, {:.1} sessions per forward; \
                     all prompts in at {:.1} s; all decoding for {:.1} s: {:.1} tok/s, {:.1} sessions per forward",
                    row.aggregate_tokens_per_second,
                    row.mean_tokens_per_step,
                    row.p50_step_ms,
                    row.p99_step_ms,
                    row.mean_batch_sessions,
                    row.all_open_s,
                    row.steady_s,
                    row.steady_tokens_per_second,
                    row.steady_batch_sessions
                );
                rows.push(row);
            }
        }
    }
    // The table lists rows by setting, then sessions, as before.
    rows.sort_by_key(|r| (!r.batched, r.sessions));
    let report = serde_json::json!({
        "draft": args.draft,
        "target": args.target,
        "nodes": args.nodes,
        "max_tokens": args.max_tokens,
        "prompts": recording.prompts.len(),
        "threads": args.threads,
        "rows": rows,
    });
    std::fs::write(
        args.out_dir.join("capacity.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    let md = markdown(args, &rows);
    std::fs::write(args.out_dir.join("capacity.md"), &md)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!("{md}");
    }
    Ok(())
}

fn markdown(args: &CapacityArgs, rows: &[CapacityRow]) -> String {
    let mut s = format!(
        "Verify node capacity: target {}, trees of {} nodes recorded with {}, {} new tokens per session, verify threads {}.\n\n\
         Tokens/s counts from the row's start (every prompt's prefill included) to its last verdict; \
         \"all decoding\" counts only the stretch in which every session was past its prefill and \
         not yet done.\n\n\
         | sessions | method | batching | tokens/s | vs same method, batching off | vs plain (same N, same batching) | tokens/step | p50 step ms | p99 step ms | all decoding: tokens/s | vs same method, batching off | sessions per forward |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
        args.target,
        args.nodes,
        args.draft,
        args.max_tokens,
        args.threads.map_or("all".to_string(), |t| t.to_string())
    );
    let find = |n: usize, method: &str, batched: bool| {
        rows.iter()
            .find(|r| r.sessions == n && r.method == method && r.batched == batched)
    };
    for r in rows {
        let ratio = |other: Option<&CapacityRow>| {
            other.map_or("—".to_string(), |o| {
                format!(
                    "{:.2}×",
                    r.aggregate_tokens_per_second / o.aggregate_tokens_per_second
                )
            })
        };
        // Against the same method with batching off, and against the target alone (plain
        // decoding with the same batching).
        let vs_off = if r.batched {
            ratio(find(r.sessions, &r.method, false))
        } else {
            "—".into()
        };
        let steady_vs_off = match (r.batched, find(r.sessions, &r.method, false)) {
            (true, Some(o)) if o.steady_tokens_per_second > 0.0 => format!(
                "{:.2}×",
                r.steady_tokens_per_second / o.steady_tokens_per_second
            ),
            _ => "—".into(),
        };
        let vs_plain = if r.method != "plain" {
            ratio(find(r.sessions, "plain", r.batched))
        } else {
            "—".into()
        };
        s += &format!(
            "| {} | {} | {} | {:.1} | {} | {} | {:.2} | {:.0} | {:.0} | {:.1} | {} | {:.1} |\n",
            r.sessions,
            r.method,
            if r.batched { "on" } else { "off" },
            r.aggregate_tokens_per_second,
            vs_off,
            vs_plain,
            r.mean_tokens_per_step,
            r.p50_step_ms,
            r.p99_step_ms,
            r.steady_tokens_per_second,
            steady_vs_off,
            r.steady_batch_sessions
        );
    }
    s
}

/// Record (or reuse) the target's continuations and the draft's trees along them.
fn record(args: &CapacityArgs, target: &std::path::Path) -> Result<Recording> {
    let file = args.out_dir.join("trees.json");
    if let Ok(text) = std::fs::read_to_string(&file) {
        if let Ok(r) = serde_json::from_str::<Recording>(&text) {
            if r.draft == args.draft
                && r.target == args.target
                && r.nodes == args.nodes
                && r.max_tokens == args.max_tokens
                && r.prompts.len() == args.prompt_count
            {
                eprintln!("== reusing recorded trees from {}", file.display());
                return Ok(r);
            }
        }
    }
    let draft = crate::engine_cmds::resolve_model(&args.draft)?;
    let opts = LoadOptions {
        threads: args.threads,
        ..LoadOptions::default()
    };
    let tmodel = Model::load(target, &opts)?;
    let dmodel = Model::load(&draft, &opts)?;
    let tok = TextTokenizer::load_for_model(target)?;
    let all = load_prompts(&args.prompts)?;
    let (picked, _) = select_prompts(&all, &[], 1, 0)?;
    if picked.is_empty() {
        bail!("no prompts in {}", args.prompts.display());
    }
    let shape = if args.nodes == 1 {
        Tree::chain(1)
    } else {
        SequoiaDp::solve(&EXAMPLE_ACCEPTANCE, args.nodes, 8)?.tree(args.nodes, 8)
    };
    let greedy = SamplingParams::default();
    let total = (args.prompt_count * args.max_tokens) as u64;
    let bar = ProgressBar::new(total).with_style(
        ProgressStyle::with_template("recording {bar:30} {pos}/{len} positions {eta}")
            .expect("valid template"),
    );
    let mut prompts = Vec::new();
    for i in 0..args.prompt_count {
        let p = &picked[i % picked.len()];
        let text = tok
            .apply_chat_template(&[ChatMessage::user(p.text.clone())], true)
            .unwrap_or_else(|_| p.text.clone());
        let ids = tok.encode(&text, true)?;
        if ids.len() < 2 {
            bail!("prompt {} encodes to fewer than 2 tokens", p.id);
        }
        let (prefix, last) = (&ids[..ids.len() - 1], ids[ids.len() - 1]);
        // The target's greedy continuation.
        let mut cache = tmodel.new_cache();
        let mut logits = tmodel.forward_chain_last(&mut cache, &ids)?;
        let mut continuation = Vec::new();
        while continuation.len() < args.max_tokens {
            let next = sequoia_core::sampling::argmax(&logits);
            continuation.push(next);
            if tok.eos_ids().contains(&next) {
                break;
            }
            logits = tmodel.forward_chain_last(&mut cache, &[next])?;
        }
        // The draft's tree at every position along it.
        let mut session = DraftSession::new(&dmodel, prefix, greedy.clone(), 0, 0)?;
        let mut trees = Vec::new();
        let mut root = last;
        for &next in &continuation {
            let drafted = session.grow(&dmodel, root, &shape)?;
            trees.push((drafted.tree.parents().to_vec(), drafted.tokens.clone()));
            session.commit(&drafted, &[])?;
            root = next;
            bar.inc(1);
        }
        prompts.push(Recorded {
            prompt: ids,
            continuation,
            trees,
        });
    }
    bar.finish_and_clear();
    let recording = Recording {
        draft: args.draft.clone(),
        target: args.target.clone(),
        nodes: args.nodes,
        max_tokens: args.max_tokens,
        prompts,
    };
    std::fs::write(&file, serde_json::to_string(&recording)?)?;
    Ok(recording)
}

fn start_verify(
    args: &CapacityArgs,
    target: &std::path::Path,
    batched: bool,
    rt: &tokio::runtime::Runtime,
) -> Result<(Service, String)> {
    let port = free_port()?;
    let url = format!("http://127.0.0.1:{port}");
    let mut a = vec![
        "--model".into(),
        target.display().to_string(),
        "--listen".into(),
        format!("127.0.0.1:{port}"),
    ];
    if let Some(t) = args.threads {
        a.extend(["--threads".into(), t.to_string()]);
    }
    let logs = args
        .out_dir
        .join("logs")
        .join(if batched { "batched" } else { "unbatched" });
    std::fs::create_dir_all(&logs)?;
    // No prefix cache: the runs reopen the same prompts one after the other, and whether an
    // ended session's cache is kept before the next session asks for it is a race between the
    // two streams. A lost race cost one row 0.45 s of prefill that its twin did not pay (1,669
    // against 1,295 ms for the same session, batched and not, session 19). Reuse's gain is
    // what `sequoia bench multi-turn` measures.
    let mut env = vec![
        ("SEQUOIA_BATCH__ENABLED", batched.to_string()),
        ("SEQUOIA_MAX_SESSIONS", "256".to_string()),
        ("SEQUOIA_PREFIX_CACHE__ENABLED", "false".to_string()),
    ];
    if let Some(w) = args.max_wait_us {
        env.push(("SEQUOIA_BATCH__MAX_WAIT_US", w.to_string()));
    }
    let mut svc = Service::spawn("verify-service", &a, &env, &logs)?;
    rt.block_on(wait_ready(&mut svc, &url, Duration::from_secs(300)))?;
    Ok((svc, url))
}

/// Run `n` concurrent replayed sessions to the end of their continuations.
async fn replay(
    url: &str,
    rec: &Recording,
    n: usize,
    policy: Policy,
    batched: bool,
    steps_dir: &std::path::Path,
) -> Result<CapacityRow> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())?
        .connect()
        .await?;
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..n {
        let prompt = &rec.prompts[i % rec.prompts.len()];
        let client = VerifierClient::new(channel.clone());
        let (ids, cont, trees) = (
            prompt.prompt.clone(),
            prompt.continuation.clone(),
            prompt.trees.clone(),
        );
        let policy = policy.clone();
        tasks.push(tokio::spawn(async move {
            replay_session(client, ids, cont, trees, &policy, t0).await
        }));
    }
    let mut runs = Vec::new();
    for t in tasks {
        runs.push(t.await??);
    }
    let wall = t0.elapsed().as_secs_f64();
    // Every step of the row, for a look at where the slow ones fall.
    let mut csv = String::from("session,opened_s,start_s,end_s,tokens,batch_sessions\n");
    for (i, r) in runs.iter().enumerate() {
        for st in &r.steps {
            csv += &format!(
                "{i},{:.4},{:.4},{:.4},{},{}\n",
                r.opened, st.start, st.end, st.tokens, st.sessions
            );
        }
    }
    let name = format!(
        "steps-{n}-{}-{}.csv",
        policy.method.name(),
        if batched { "on" } else { "off" }
    );
    std::fs::write(steps_dir.join(name), csv)?;
    let steps: usize = runs.iter().map(|r| r.steps.len()).sum();
    let tokens: usize = runs.iter().map(|r| r.committed).sum();
    let batch_sessions: usize = runs.iter().flat_map(|r| &r.steps).map(|s| s.sessions).sum();
    let mut steps_ms: Vec<f64> = runs
        .iter()
        .flat_map(|r| &r.steps)
        .map(|s| (s.end - s.start) * 1e3)
        .collect();
    let all_open = runs.iter().map(|r| r.opened).fold(0.0, f64::max);
    // Every session decoding: after the last one's first tree, before the first one's end.
    let from = runs
        .iter()
        .filter_map(|r| r.steps.first().map(|s| s.start))
        .fold(0.0, f64::max);
    let to = runs
        .iter()
        .filter_map(|r| r.steps.last().map(|s| s.end))
        .fold(f64::INFINITY, f64::min);
    let steady: Vec<&StepRecord> = runs
        .iter()
        .flat_map(|r| &r.steps)
        .filter(|s| s.end > from && s.end <= to)
        .collect();
    let steady_s = (to - from).max(0.0);
    let steady_tokens: usize = steady.iter().map(|s| s.tokens).sum();
    steps_ms.sort_by(f64::total_cmp);
    let pct = |q: f64| steps_ms[((steps_ms.len() as f64 - 1.0) * q).round() as usize];
    Ok(CapacityRow {
        sessions: n,
        batched,
        method: policy.method.name().into(),
        aggregate_tokens_per_second: tokens as f64 / wall,
        mean_tokens_per_step: tokens as f64 / steps.max(1) as f64,
        p50_step_ms: pct(0.5),
        p99_step_ms: pct(0.99),
        steps,
        tokens,
        wall_s: wall,
        mean_batch_sessions: batch_sessions as f64 / steps.max(1) as f64,
        all_open_s: all_open,
        steady_s,
        steady_tokens_per_second: if steady_s > 0.0 {
            steady_tokens as f64 / steady_s
        } else {
            0.0
        },
        steady_batch_sessions: steady.iter().map(|s| s.sessions).sum::<usize>() as f64
            / steady.len().max(1) as f64,
    })
}

/// One replayed step, times in seconds since the row started.
struct StepRecord {
    start: f64,
    end: f64,
    /// Tokens the step committed.
    tokens: usize,
    /// Sessions in the forward that verified it.
    sessions: usize,
}

/// One replayed session.
struct SessionRun {
    /// When its `open` (the prompt's prefill) was answered, seconds since the row started.
    opened: f64,
    steps: Vec<StepRecord>,
    committed: usize,
}

/// One session, to the end of its continuation; times are taken from `t0`, the row's start.
async fn replay_session(
    mut client: VerifierClient<tonic::transport::Channel>,
    ids: Vec<u32>,
    cont: Vec<u32>,
    trees: Vec<(Vec<i32>, Vec<u32>)>,
    policy: &Policy,
    t0: Instant,
) -> Result<SessionRun> {
    let (tx, rx) = tokio::sync::mpsc::channel(2);
    tx.send(pb::SessionRequest {
        msg: Some(pb::session_request::Msg::Open(pb::OpenSession {
            prefix_tokens: ids[..ids.len() - 1].to_vec(),
            sampling: None,
            seed: 0,
            max_new_tokens: cont.len() as u32 + 1,
            protocol_version: sequoia_core::limits::PROTOCOL_VERSION,
            // Its sessions are there to load the node; whether it decodes while they wait
            // is the node's business.
            draft_shares_cpus: false,
        })),
    })
    .await?;
    let mut inbound = client.session(ReceiverStream::new(rx)).await?.into_inner();
    match inbound.message().await?.and_then(|m| m.msg) {
        Some(pb::session_response::Msg::Opened(_)) => {}
        other => bail!("expected the session to open, got {other:?}"),
    }
    let opened = t0.elapsed().as_secs_f64();
    let mut committed = 0usize;
    let mut records = Vec::new();
    let mut step = 0u64;
    let mut sessions = 1usize;
    while committed < cont.len() {
        let (parents, tokens) = &trees[committed];
        let n = policy.nodes(parents.len(), sessions);
        // A BFS prefix of a tree is a tree; the recorded root is the last committed token.
        let (parents, tokens) = (parents[..n].to_vec(), tokens[..n].to_vec());
        let start = t0.elapsed().as_secs_f64();
        tx.send(pb::SessionRequest {
            msg: Some(pb::session_request::Msg::Tree(pb::VerifyTree {
                step,
                parents,
                tokens: tokens.clone(),
                draft_dists: Vec::new(),
                assumes: None,
            })),
        })
        .await?;
        let v = match inbound.message().await?.and_then(|m| m.msg) {
            Some(pb::session_response::Msg::Verdict(v)) => v,
            other => bail!("expected a verdict, got {other:?}"),
        };
        let end = t0.elapsed().as_secs_f64();
        sessions = (v.batch_sessions as usize).clamp(1, 1024);
        // Exactness: the accepted tokens and the next one are the target's continuation.
        let mut got: Vec<u32> = v
            .accepted_nodes
            .iter()
            .map(|&i| tokens.get(i as usize).copied().unwrap_or(u32::MAX))
            .collect();
        got.push(v.next_token);
        let last = (committed + got.len()).min(cont.len());
        if got[..last - committed] != cont[committed..last] {
            bail!(
                "replay diverged from the target's greedy continuation at token {committed}: the verify node is not exact"
            );
        }
        records.push(StepRecord {
            start,
            end,
            tokens: last - committed,
            sessions,
        });
        committed = last;
        step += 1;
    }
    Ok(SessionRun {
        opened,
        steps: records,
        committed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_per_step_follow_the_continuation_through_each_cut() {
        // Root 0 with children 1 ("a") and 2 ("b"); node 3 ("c") under 2.
        let tree = (vec![-1, 0, 0, 2], vec![9, 10, 11, 12]);
        let rec = Recording {
            draft: String::new(),
            target: String::new(),
            nodes: 4,
            max_tokens: 4,
            prompts: vec![Recorded {
                prompt: vec![1, 9],
                // Position 0 follows node 2 then 3; position 1 matches nothing; position 2 is
                // one token from the end.
                continuation: vec![11, 12, 5, 6],
                trees: vec![tree.clone(), tree.clone(), tree.clone(), tree],
            }],
        };
        let e = rec.tokens_per_step(4);
        // n = 1: every step commits the target's token only. n = 2: node 1 ("10") never
        // matches. n = 3: position 0 accepts node 2. n = 4: position 0 accepts 2 and 3.
        assert_eq!(e, vec![1.0, 1.0, 1.25, 1.5]);
    }
}

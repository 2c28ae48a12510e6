//! `sequoia bench multi-turn`: time to first token of a chat's second turn with prefix reuse on
//! and off (docs/ALGORITHMS.md §11, prefix reuse).
//!
//! For each MT-Bench question (two user turns), through a freshly started service pair: turn 1
//! is the first user message; turn 2 is what a chat client sends next, the whole history (turn 1,
//! the generated answer, the second user message) through the chat template. Turn 2's time to
//! first token (request sent → first text) is the figure. The pair runs once with
//! `prefix_cache.enabled` on both services and once with it off; at T = 0 both runs produce the
//! same answers (verification is exact), so both turn 2s send the same prompts.
//!
//! Between the turns the client pauses briefly ([`READING_PAUSE`]), as a user reading the
//! answer would: the services keep an ended generation's caches right after it ends, and the
//! pause keeps the measurement from depending on how fast a client can fire its next request.

use super::*;
use crate::client_cmds::{free_port, wait_ready, Service};
use std::time::Instant;

/// Pause between the end of turn 1 and the start of turn 2.
const READING_PAUSE: Duration = Duration::from_millis(300);

#[derive(clap::Args, Debug, Clone)]
pub struct MultiTurnArgs {
    /// Draft model.
    #[arg(long, default_value = "qwen2.5-coder-0.5b")]
    pub draft: String,
    /// Target model.
    #[arg(long, default_value = "qwen2.5-coder-1.5b")]
    pub target: String,
    /// MT-Bench question file (JSONL; `turns` holds the two user messages).
    #[arg(long, default_value = "../shared/data/mt_bench/question.jsonl")]
    pub prompts: PathBuf,
    /// Questions to run (the first ones in file order).
    #[arg(long, default_value_t = 8)]
    pub max_prompts: usize,
    /// New tokens per turn (fewer when the model ends its answer).
    #[arg(long, default_value_t = 128)]
    pub max_tokens: u32,
    /// Compute threads of each service (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Output folder (multi_turn.json, logs/).
    #[arg(long, default_value = "bench-out/multi-turn")]
    pub out_dir: PathBuf,
    /// Print the JSON report to stdout instead of the summary.
    #[arg(long)]
    pub json: bool,
}

#[derive(Deserialize)]
struct Question {
    question_id: u64,
    turns: Vec<String>,
}

/// One conversation's second turn.
#[derive(Serialize, Clone)]
struct TurnTwo {
    question_id: u64,
    prompt_tokens: u32,
    ttft_ms: f64,
    total_ms: f64,
    generated_tokens: u32,
    /// Turn 2's generated text, to check both runs answered alike.
    #[serde(skip)]
    text: String,
}

#[derive(Serialize)]
struct Run {
    prefix_reuse: bool,
    mean_ttft_ms: f64,
    p50_ttft_ms: f64,
    mean_total_ms: f64,
    wall_s: f64,
    turns: Vec<TurnTwo>,
}

pub fn multi_turn(args: &MultiTurnArgs) -> Result<()> {
    if args.max_prompts == 0 || args.max_tokens == 0 {
        bail!("--max-prompts and --max-tokens must be at least 1");
    }
    let text = std::fs::read_to_string(&args.prompts).with_context(|| {
        format!(
            "reading {} (MT-Bench questions; pass --prompts FILE)",
            args.prompts.display()
        )
    })?;
    let mut questions = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let q: Question = serde_json::from_str(line).with_context(|| {
            format!(
                "{}:{}: not an MT-Bench question",
                args.prompts.display(),
                i + 1
            )
        })?;
        if q.turns.len() >= 2 {
            questions.push(q);
        }
        if questions.len() == args.max_prompts {
            break;
        }
    }
    if questions.is_empty() {
        bail!(
            "{} holds no question with two turns",
            args.prompts.display()
        );
    }
    std::fs::create_dir_all(&args.out_dir)?;
    let rt = tokio::runtime::Runtime::new()?;
    let mut runs = Vec::new();
    for reuse in [false, true] {
        eprintln!("== prefix reuse {}", if reuse { "on" } else { "off" });
        let (_services, url) = start_pair(args, reuse, &rt)?;
        let t0 = Instant::now();
        let turns = rt.block_on(conversations(args, &url, &questions))?;
        runs.push(summarize(reuse, turns, t0.elapsed()));
    }
    let (off, on) = (&runs[0], &runs[1]);
    let differ: Vec<u64> = off
        .turns
        .iter()
        .zip(&on.turns)
        .filter(|(a, b)| a.text != b.text)
        .map(|(a, _)| a.question_id)
        .collect();
    if !differ.is_empty() {
        bail!("turn 2 answers differ with prefix reuse on and off (questions {differ:?}): the reuse is not exact");
    }
    let ratio = off.mean_ttft_ms / on.mean_ttft_ms.max(1e-9);
    let report = serde_json::json!({
        "draft": args.draft,
        "target": args.target,
        "max_tokens": args.max_tokens,
        "questions": questions.len(),
        "threads": args.threads,
        "ttft_ratio_mean": ratio,
        "ttft_ratio_p50": off.p50_ttft_ms / on.p50_ttft_ms.max(1e-9),
        "runs": runs,
    });
    std::fs::write(
        args.out_dir.join("multi_turn.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "turn 2 time to first token over {} MT-Bench conversations ({} tokens per turn):",
            questions.len(),
            args.max_tokens
        );
        for r in &runs {
            println!(
                "  prefix reuse {:>3}: mean {:8.1} ms, p50 {:8.1} ms; turn 2 total mean {:8.1} ms; whole run {:.1} s",
                if r.prefix_reuse { "on" } else { "off" },
                r.mean_ttft_ms,
                r.p50_ttft_ms,
                r.mean_total_ms,
                r.wall_s
            );
        }
        println!("  speedup of turn 2 TTFT with reuse: {ratio:.2}x (mean)");
    }
    Ok(())
}

fn summarize(reuse: bool, turns: Vec<TurnTwo>, wall: Duration) -> Run {
    let mut ttft: Vec<f64> = turns.iter().map(|t| t.ttft_ms).collect();
    ttft.sort_by(f64::total_cmp);
    let n = turns.len().max(1) as f64;
    Run {
        prefix_reuse: reuse,
        mean_ttft_ms: ttft.iter().sum::<f64>() / n,
        p50_ttft_ms: ttft.get(ttft.len() / 2).copied().unwrap_or(0.0),
        mean_total_ms: turns.iter().map(|t| t.total_ms).sum::<f64>() / n,
        wall_s: wall.as_secs_f64(),
        turns,
    }
}

/// Both services, with prefix reuse set on both; stopped when the returned services drop.
fn start_pair(
    args: &MultiTurnArgs,
    reuse: bool,
    rt: &tokio::runtime::Runtime,
) -> Result<(Vec<Service>, String)> {
    let draft = crate::engine_cmds::resolve_model(&args.draft)?;
    let target = crate::engine_cmds::resolve_model(&args.target)?;
    let logs = args
        .out_dir
        .join("logs")
        .join(if reuse { "reuse-on" } else { "reuse-off" });
    std::fs::create_dir_all(&logs)?;
    let threads: Vec<String> = args
        .threads
        .map(|t| vec!["--threads".into(), t.to_string()])
        .unwrap_or_default();
    let env = [("SEQUOIA_PREFIX_CACHE__ENABLED", reuse.to_string())];
    let vport = free_port()?;
    let verify_url = format!("http://127.0.0.1:{vport}");
    let mut a = vec![
        "--model".into(),
        target.display().to_string(),
        "--listen".into(),
        format!("127.0.0.1:{vport}"),
    ];
    a.extend(threads.clone());
    let mut verify = Service::spawn("verify-service", &a, &env, &logs)?;
    rt.block_on(wait_ready(
        &mut verify,
        &verify_url,
        Duration::from_secs(300),
    ))?;
    let dport = free_port()?;
    let url = format!("http://127.0.0.1:{dport}");
    let mut a = vec![
        "--model".into(),
        draft.display().to_string(),
        "--verify".into(),
        verify_url,
        "--listen".into(),
        format!("127.0.0.1:{dport}"),
        "--http-listen".into(),
        String::new(),
    ];
    a.extend(threads);
    let mut draft_svc = Service::spawn("draft-service", &a, &env, &logs)?;
    rt.block_on(wait_ready(&mut draft_svc, &url, Duration::from_secs(300)))?;
    Ok((vec![verify, draft_svc], url))
}

async fn conversations(
    args: &MultiTurnArgs,
    url: &str,
    questions: &[Question],
) -> Result<Vec<TurnTwo>> {
    let mut client = connect(url).await?;
    let mut out = Vec::new();
    for q in questions {
        let user = |text: &str| ChatMessage {
            role: "user".into(),
            content: text.to_string(),
        };
        let mut history = vec![user(&q.turns[0])];
        let (answer, _) = turn(&mut client, args, history.clone()).await?;
        history.push(ChatMessage {
            role: "assistant".into(),
            content: answer,
        });
        history.push(user(&q.turns[1]));
        tokio::time::sleep(READING_PAUSE).await;
        let (text, mut t2) = turn(&mut client, args, history).await?;
        t2.question_id = q.question_id;
        eprintln!(
            "   question {}: turn 2 ({} prompt tokens) first token after {:.1} ms",
            q.question_id, t2.prompt_tokens, t2.ttft_ms
        );
        t2.text = text;
        out.push(t2);
    }
    Ok(out)
}

/// One greedy generation; its text and timings.
async fn turn(
    client: &mut GenerationClient<Channel>,
    args: &MultiTurnArgs,
    messages: Vec<ChatMessage>,
) -> Result<(String, TurnTwo)> {
    let req = GenerateRequest {
        messages,
        max_tokens: args.max_tokens,
        temperature: 0.0,
        top_p: 1.0,
        seed: Some(1),
        ..Default::default()
    };
    let t0 = Instant::now();
    let mut stream = client.generate(req).await?.into_inner();
    let (mut text, mut first, mut summary) = (String::new(), None, None);
    while let Some(chunk) = stream.message().await? {
        if first.is_none() && (!chunk.text.is_empty() || !chunk.token_ids.is_empty()) {
            first = Some(t0.elapsed());
        }
        text.push_str(&chunk.text);
        if chunk.summary.is_some() {
            summary = chunk.summary;
        }
    }
    let total = t0.elapsed();
    let s = summary.context("the generation ended without its summary")?;
    Ok((
        text,
        TurnTwo {
            question_id: 0,
            prompt_tokens: s.prompt_tokens,
            ttft_ms: first.unwrap_or(total).as_secs_f64() * 1e3,
            total_ms: total.as_secs_f64() * 1e3,
            generated_tokens: s.generated_tokens,
            text: String::new(),
        },
    ))
}

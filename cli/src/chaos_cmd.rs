//! `sequoia chaos`: the chaos run of `tests/tests/chaos.rs` for as long as you like, by hand.
//! N verify-service processes and one draft-service on loopback, C concurrent greedy clients,
//! verify nodes SIGKILLed and restarted at random. Every generation must complete with the
//! target's own greedy output or get a retriable status; afterwards no node may hold a session
//! and the draft no running generation. Exit status 1 when any of that fails.

use crate::chaos_driver::{chaos_loop, run_clients, Case, Outcome};
use crate::client_cmds::{free_port, resolve, wait_ready, Service};
use anyhow::{bail, Context, Result};
use clap::Args;
use sequoia_core::sampling::argmax;
use sequoia_engine::tokenizer::TextTokenizer;
use sequoia_engine::{LoadOptions, Model};
use sequoia_proto::v1::verifier_client::VerifierClient;
use sequoia_proto::v1::InfoRequest;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

const DEFAULT_PROMPTS: [&str; 6] = [
    "hello world",
    "The quick brown fox",
    "fn main() { println!(\"hi\"); }",
    "a",
    "world hello world",
    "quick fox",
];

#[derive(Args)]
pub struct ChaosArgs {
    /// Draft model (path or default model name); ignored with --tiny.
    #[arg(long, default_value = sequoia_models::QWEN_CODER_0_5B)]
    draft: String,
    /// Target model (path or default model name); ignored with --tiny.
    #[arg(long, default_value = sequoia_models::QWEN_CODER_1_5B)]
    target: String,
    /// Use the tiny random-weight test models (written to the log directory; no download).
    #[arg(long)]
    tiny: bool,
    /// Verify-service processes.
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// Concurrent clients.
    #[arg(long, default_value_t = 16)]
    clients: usize,
    /// How long the clients run while nodes are killed, in seconds.
    #[arg(long, default_value_t = 300)]
    duration_secs: u64,
    /// Tokens per generation (short generations: many start and end during the run).
    #[arg(long, default_value_t = 40)]
    max_tokens: usize,
    /// Pause between kill/restart events: uniform between these, in milliseconds.
    #[arg(long, default_value_t = 500)]
    min_pause_ms: u64,
    #[arg(long, default_value_t = 3000)]
    max_pause_ms: u64,
    /// Seed of the kill schedule (a run can be repeated).
    #[arg(long, default_value_t = 17)]
    seed: u64,
    /// Prompts (repeatable); default: six short built-in prompts.
    #[arg(long = "prompt")]
    prompts: Vec<String>,
    /// Compute threads per service process.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Where the services' logs (and the tiny models) go; default: a new temp directory.
    #[arg(long)]
    logs: Option<PathBuf>,
}

pub fn chaos(args: &ChaosArgs) -> Result<()> {
    if args.nodes < 2 {
        bail!("--nodes must be at least 2: one node is always kept up while another is down");
    }
    if args.clients == 0 || args.max_tokens == 0 {
        bail!("--clients and --max-tokens must be at least 1");
    }
    if args.min_pause_ms > args.max_pause_ms {
        bail!("--min-pause-ms must not exceed --max-pause-ms");
    }
    let logs = args.logs.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("sequoia-chaos-{}", std::process::id()))
    });
    std::fs::create_dir_all(&logs)?;
    let (draft, target) = if args.tiny {
        tiny_models(&logs)?
    } else {
        (resolve(&args.draft)?, resolve(&args.target)?)
    };
    let prompts: Vec<String> = if args.prompts.is_empty() {
        DEFAULT_PROMPTS.iter().map(|p| p.to_string()).collect()
    } else {
        args.prompts.clone()
    };
    eprintln!(
        "== reference: the target's greedy output for {} prompts",
        prompts.len()
    );
    let cases = references(&target, &prompts, args.max_tokens, args.threads)?;

    let rt = tokio::runtime::Runtime::new()?;
    let ports: Vec<u16> = (0..args.nodes)
        .map(|_| free_port())
        .collect::<Result<_>>()?;
    let urls: Vec<String> = ports
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    let verify_args = |port: u16| -> Vec<String> {
        vec![
            "--model".into(),
            target.display().to_string(),
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--threads".into(),
            args.threads.to_string(),
        ]
    };
    eprintln!(
        "== starting {} verify-service processes and a draft-service (logs in {})",
        args.nodes,
        logs.display()
    );
    let start_node = |i: usize| -> Result<Service> {
        let node_logs = logs.join(format!("node{i}"));
        std::fs::create_dir_all(&node_logs)?;
        let mut svc = Service::spawn("verify-service", &verify_args(ports[i]), &[], &node_logs)?;
        rt.block_on(wait_ready(&mut svc, &urls[i], Duration::from_secs(300)))?;
        Ok(svc)
    };
    let mut nodes: Vec<Service> = (0..args.nodes).map(&start_node).collect::<Result<_>>()?;
    let (dport, mport) = (free_port()?, free_port()?);
    let draft_url = format!("http://127.0.0.1:{dport}");
    let metrics_addr = format!("127.0.0.1:{mport}");
    let mut draft_args = vec![
        "--model".into(),
        draft.display().to_string(),
        "--listen".into(),
        format!("127.0.0.1:{dport}"),
        "--http-listen".into(),
        String::new(),
        "--threads".into(),
        args.threads.to_string(),
    ];
    draft_args.extend(["--verify".into(), urls.join(",")]);
    let env = [
        ("SEQUOIA_METRICS_LISTEN", metrics_addr.clone()),
        ("SEQUOIA_MAX_SESSIONS", (2 * args.clients).to_string()),
        ("SEQUOIA_STEP_TIMEOUT_SECS", "10".to_string()),
        ("SEQUOIA_CONNECT_TIMEOUT_SECS", "2".to_string()),
    ];
    let mut drafter = Service::spawn("draft-service", &draft_args, &env, &logs)?;
    rt.block_on(wait_ready(
        &mut drafter,
        &draft_url,
        Duration::from_secs(300),
    ))?;
    let baseline = rt.block_on(draft_running(&metrics_addr))?;

    eprintln!(
        "== {} clients for {} s; nodes killed and restarted every {}-{} ms (seed {})",
        args.clients, args.duration_secs, args.min_pause_ms, args.max_pause_ms, args.seed
    );
    let stop = Arc::new(AtomicBool::new(false));
    let mut restart_errors = Vec::new();
    let (outcome, kills) = std::thread::scope(|scope| {
        let stop_k = stop.clone();
        let restart_errors = &mut restart_errors;
        let nodes = &mut nodes;
        let start_node = &start_node;
        let urls = &urls;
        let killer = scope.spawn(move || {
            let (kills, up) = chaos_loop(
                nodes.len(),
                args.seed,
                (
                    Duration::from_millis(args.min_pause_ms),
                    Duration::from_millis(args.max_pause_ms),
                ),
                &stop_k,
                |i, kill| {
                    if kill {
                        eprintln!("   kill    node {i} ({})", urls[i]);
                        nodes[i].kill();
                    } else {
                        eprintln!("   restart node {i}");
                        match start_node(i) {
                            Ok(s) => nodes[i] = s,
                            Err(e) => restart_errors.push(format!("node {i}: {e:#}")),
                        }
                    }
                },
            );
            for (i, up) in up.into_iter().enumerate() {
                if !up {
                    match start_node(i) {
                        Ok(s) => nodes[i] = s,
                        Err(e) => restart_errors.push(format!("node {i}: {e:#}")),
                    }
                }
            }
            kills
        });
        let outcome = {
            // A runtime of its own: `start_node` blocks on `rt` from the killer thread.
            let clients_rt = tokio::runtime::Runtime::new().expect("tokio runtime");
            clients_rt.block_on(run_clients(
                &draft_url,
                &cases,
                args.clients,
                Duration::from_secs(args.duration_secs),
            ))
        };
        stop.store(true, Ordering::Relaxed);
        (outcome, killer.join().expect("kill/restart loop"))
    });

    report(&outcome, kills);
    let mut problems: Vec<String> = outcome.failures.clone();
    problems.extend(restart_errors);
    if outcome.completed == 0 {
        problems.push("no generation completed".into());
    }
    // No leak: every node's sessions and the draft's running generations go back.
    let leaks = rt.block_on(async {
        let mut leaks = Vec::new();
        for url in &urls {
            if !settles(|| async { open_sessions(url).await == Some(0) }).await {
                leaks.push(format!(
                    "{url}: {:?} sessions still open",
                    open_sessions(url).await
                ));
            }
        }
        let back =
            settles(|| async { draft_running(&metrics_addr).await.ok() == Some(baseline) }).await;
        if !back {
            leaks.push(format!(
                "draft-service: {:?} generations still counted as running (baseline {baseline})",
                draft_running(&metrics_addr).await.ok()
            ));
        }
        leaks
    });
    if leaks.is_empty() {
        println!("no leak: 0 open sessions on every node, draft back to {baseline} running");
    }
    problems.extend(leaks);
    drop(drafter);
    drop(nodes);
    if !problems.is_empty() {
        bail!("chaos run failed:\n{}", problems.join("\n"));
    }
    println!("chaos run passed");
    Ok(())
}

fn report(o: &Outcome, kills: usize) {
    println!(
        "kills: {kills}; generations: {} (completed with the reference output: {}, retriable status: {}, failures: {}); failovers in completed generations: {}",
        o.total(),
        o.completed,
        o.retriable,
        o.failures.len(),
        o.failovers
    );
}

/// Poll `ok` for up to 30 s.
async fn settles<F: std::future::Future<Output = bool>>(ok: impl Fn() -> F) -> bool {
    for _ in 0..300 {
        if ok().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

async fn open_sessions(url: &str) -> Option<u32> {
    let mut c = VerifierClient::connect(url.to_string()).await.ok()?;
    Some(
        c.info(InfoRequest {})
            .await
            .ok()?
            .into_inner()
            .active_sessions,
    )
}

/// The draft's running generations (`sequoia_active_sessions` on its metrics endpoint).
async fn draft_running(addr: &str) -> Result<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr)
        .await
        .with_context(|| format!("draft-service metrics on {addr}"))?;
    conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: chaos\r\n\r\n")
        .await?;
    let mut text = String::new();
    conn.read_to_string(&mut text).await?;
    let series = format!(
        "{}{{service=\"draft-service\"}} ",
        sequoia_server::metrics::ACTIVE_SESSIONS
    );
    text.lines()
        .find_map(|l| l.strip_prefix(&series)?.trim().parse().ok())
        .with_context(|| format!("no {series} in the draft's metrics"))
}

/// The tiny test models (a target and a draft that is the target plus noise), as the
/// integration tests write them.
fn tiny_models(dir: &Path) -> Result<(PathBuf, PathBuf)> {
    use sequoia_engine::testing::{write_tiny_model, TinyArch, TinySpec};
    use sequoia_engine::tokenizer::testing::{write_tiny_tokenizer, TINY_VOCAB_SIZE};
    let target = dir.join("tiny-target");
    let draft = dir.join("tiny-draft");
    let spec = |seed| TinySpec {
        arch: TinyArch::Qwen2,
        seed,
        vocab_size: TINY_VOCAB_SIZE,
        ..TinySpec::default()
    };
    for p in [&target, &draft] {
        std::fs::create_dir_all(p)?;
        write_tiny_tokenizer(p)?;
    }
    write_tiny_model(&target, &spec(1))?;
    write_tiny_model(
        &draft,
        &TinySpec {
            perturb_of: Some(1),
            noise: 0.5,
            arch: TinyArch::Llama,
            ..spec(2)
        },
    )?;
    Ok((draft, target))
}

/// Plain greedy decoding with the target alone: what every completed generation must equal.
fn references(
    target: &Path,
    prompts: &[String],
    max_tokens: usize,
    threads: usize,
) -> Result<Vec<Case>> {
    let opts = LoadOptions {
        threads: Some(threads.max(1)),
        ..LoadOptions::default()
    };
    let model =
        Model::load(target, &opts).with_context(|| format!("loading {}", target.display()))?;
    let tok = TextTokenizer::load_for_model(target)?;
    let mut cases = Vec::new();
    for prompt in prompts {
        let ids = tok.encode(prompt, true)?;
        let mut cache = model.new_cache();
        let mut logits = model.forward_chain_last(&mut cache, &ids)?;
        let mut out = Vec::new();
        while out.len() < max_tokens {
            let next = argmax(&logits);
            if tok.eos_ids().contains(&next) {
                break;
            }
            out.push(next);
            logits = model.forward_chain_last(&mut cache, &[next])?;
        }
        cases.push(Case {
            prompt: prompt.clone(),
            reference: out,
        });
    }
    Ok(cases)
}

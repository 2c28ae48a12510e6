//! `sequoia generate` (a client of draft-service's Generation API) and `sequoia demo` (both
//! services on this machine, one generation through them, and the target alone for comparison;
//! or the same across the two-host emulation with `--two-host`, where the script starts the
//! services and runs `sequoia demo --draft-addr ... --target-addr ...` on the draft host).

use anyhow::{bail, Context, Result};
use sequoia_core::sampling::{
    argmax, probs_from_logits, sample_dense, SamplingParams, SessionRng, VERIFY_STREAM,
};
use sequoia_engine::tokenizer::{ChatMessage, TextTokenizer};
use sequoia_engine::{LoadOptions, Model};
use sequoia_models as models;
use sequoia_proto::v1::generation_client::GenerationClient;
use sequoia_proto::v1::{GenerateRequest, GenerateSummary};
use sequoia_server::security::{self, BearerToken, ClientSecurity};
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug, Clone)]
pub struct GenerateArgs {
    /// draft-service address, e.g. http://127.0.0.1:50051.
    #[arg(long, default_value = "http://127.0.0.1:50051")]
    pub addr: String,
    #[arg(long)]
    pub prompt: String,
    /// Send the prompt raw instead of as a chat message.
    #[arg(long)]
    pub raw: bool,
    #[arg(long, default_value_t = 256)]
    pub max_tokens: u32,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop strings (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// Bearer token, for a draft-service with auth_tokens set.
    #[arg(long, env = "SEQUOIA_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// CA certificate (PEM) to trust for an https:// address, besides the system roots.
    #[arg(long)]
    pub ca_cert: Option<PathBuf>,
}

/// TLS for https:// addresses (--ca-cert) and the bearer token (--token / SEQUOIA_TOKEN).
fn client_security(args: &GenerateArgs) -> Result<ClientSecurity> {
    let none = Path::new("");
    let tls = args
        .ca_cert
        .as_deref()
        .map(|ca| security::client_tls(ca, none, none, ""))
        .transpose()?;
    let token = BearerToken::new(args.token.as_deref().unwrap_or(""), none)?;
    Ok(ClientSecurity { tls, token })
}

#[derive(Serialize)]
struct GenerateReport {
    text: String,
    tokens: Vec<u32>,
    steps: u32,
    mean_tokens_per_step: f64,
    tokens_per_second: f64,
    finish_reason: String,
    summary: Option<GenerateSummary>,
}

fn request_of(args: &GenerateArgs) -> GenerateRequest {
    let mut req = GenerateRequest {
        max_tokens: args.max_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        seed: args.seed,
        stop: args.stop.clone(),
        ..Default::default()
    };
    if args.raw {
        req.prompt = args.prompt.clone();
    } else {
        req.messages = vec![sequoia_proto::v1::ChatMessage {
            role: "user".into(),
            content: args.prompt.clone(),
        }];
    }
    req
}

/// Stream one generation; text goes to stdout as it arrives unless `quiet`.
async fn run_generate(
    addr: &str,
    security: &ClientSecurity,
    req: GenerateRequest,
    quiet: bool,
) -> Result<GenerateReport> {
    let channel = security
        .endpoint(addr)?
        .connect()
        .await
        .with_context(|| format!("cannot connect to draft-service at {addr}"))?;
    let mut client = GenerationClient::with_interceptor(channel, security.token.clone());
    let mut stream = client
        .generate(req)
        .await
        .map_err(|s| anyhow::anyhow!("Generate failed ({:?}): {}", s.code(), s.message()))?
        .into_inner();
    let mut report = GenerateReport {
        text: String::new(),
        tokens: vec![],
        steps: 0,
        mean_tokens_per_step: 0.0,
        tokens_per_second: 0.0,
        finish_reason: String::new(),
        summary: None,
    };
    let mut out = std::io::stdout().lock();
    loop {
        let chunk = match stream.message().await {
            Ok(Some(c)) => c,
            Ok(None) => break,
            Err(s) => bail!("generation failed ({:?}): {}", s.code(), s.message()),
        };
        if !quiet {
            write!(out, "{}", chunk.text)?;
            out.flush()?;
        }
        report.text.push_str(&chunk.text);
        report.tokens.extend(&chunk.token_ids);
        if let Some(s) = chunk.summary {
            report.steps = s.steps;
            report.mean_tokens_per_step = s.mean_tokens_per_step;
            report.tokens_per_second = s.timings.as_ref().map_or(0.0, |t| t.tokens_per_second);
            report.finish_reason = s.finish_reason.clone();
            report.summary = Some(s);
        }
    }
    if !quiet {
        writeln!(out)?;
    }
    Ok(report)
}

pub fn generate(args: &GenerateArgs) -> Result<()> {
    let rt = tokio::runtime::Runtime::new()?;
    let security = client_security(args)?;
    let report = rt.block_on(run_generate(
        &args.addr,
        &security,
        request_of(args),
        args.json,
    ))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        eprintln!(
            "[{} tokens in {} steps, {:.2} tokens/step, {:.2} tokens/s, finish: {}]",
            report.tokens.len(),
            report.steps,
            report.mean_tokens_per_step,
            report.tokens_per_second,
            report.finish_reason
        );
    }
    Ok(())
}

#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    #[arg(
        long,
        default_value = "Write a Python function that checks whether a number is prime, with a short docstring."
    )]
    pub prompt: String,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: u32,
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Draft model (path or default name).
    #[arg(long, default_value = models::QWEN_CODER_0_5B)]
    pub draft: String,
    /// Target model (path or default name).
    #[arg(long, default_value = models::QWEN_CODER_1_5B)]
    pub target: String,
    /// Largest tree (nodes) the draft-service's planner may use (auto mode picks the size).
    #[arg(long, default_value_t = 6)]
    pub nodes: usize,
    /// Skip the target-only comparison run.
    #[arg(long)]
    pub no_baseline: bool,
    /// Send the prompt text raw instead of as a chat message (models without a chat template).
    #[arg(long)]
    pub raw: bool,
    /// Draft pipelined (GenerateRequest.pipeline = true): grow the next tree while the current
    /// one is verified.
    #[arg(long)]
    pub pipeline: bool,
    /// Round-trip time (ms) added between the hosts; needs --two-host.
    #[arg(long, default_value_t = 0.0)]
    pub rtt_ms: f64,
    /// Compute threads of the draft-service (default: all cores; with --two-host: one per CPU
    /// of --draft-cpus).
    #[arg(long)]
    pub draft_threads: Option<usize>,
    /// Compute threads of the verify-service (as --draft-threads, for --verify-cpus).
    #[arg(long)]
    pub verify_threads: Option<usize>,
    /// Use this running draft-service instead of starting the services (what --two-host does
    /// on the draft host).
    #[arg(long)]
    pub draft_addr: Option<String>,
    /// With --draft-addr: a draft-service next to the verify node for the target-only baseline
    /// (root-only trees); default: the target alone in this process.
    #[arg(long, requires = "draft_addr")]
    pub target_addr: Option<String>,
    #[command(flatten)]
    pub two: crate::two_host::TwoHostArgs,
}

/// `sequoia demo --two-host`: the script starts the services and runs the demo on the draft
/// host against them.
fn demo_two_host(args: &DemoArgs) -> Result<()> {
    if args.draft_addr.is_some() {
        bail!("--two-host starts its own services; drop --draft-addr/--target-addr");
    }
    let mut a = vec![
        "--prompt".to_string(),
        args.prompt.clone(),
        "--max-tokens".into(),
        args.max_tokens.to_string(),
        "--temperature".into(),
        args.temperature.to_string(),
    ];
    for (on, flag) in [
        (args.no_baseline, "--no-baseline"),
        (args.pipeline, "--pipeline"),
        (args.raw, "--raw"),
    ] {
        if on {
            a.push(flag.into());
        }
    }
    let setup = crate::two_host::Setup {
        mode: "demo",
        rtt_ms: args.rtt_ms,
        draft: crate::bench_cmd::model_arg(&args.draft)?,
        target: crate::bench_cmd::model_arg(&args.target)?,
        draft_threads: args.draft_threads,
        verify_threads: args.verify_threads,
        auto_max_nodes: Some(args.nodes),
        out_dir: None,
        bin: crate::two_host::bin_dir()?,
    };
    crate::two_host::run_script(&args.two, &setup, &a)
}

/// The demo's request through the service pair.
fn demo_request(args: &DemoArgs) -> GenerateRequest {
    let gen_args = GenerateArgs {
        addr: String::new(),
        prompt: args.prompt.clone(),
        raw: args.raw,
        max_tokens: args.max_tokens,
        temperature: args.temperature,
        top_p: 1.0,
        top_k: 0,
        seed: Some(0),
        stop: vec![],
        json: false,
        token: None,
        ca_cert: None,
    };
    let mut req = request_of(&gen_args);
    if args.pipeline {
        req.pipeline = Some(true);
    }
    req
}

/// One line about the generation through the pair, with the pipeline counters if it pipelined.
fn print_pair_report(report: &GenerateReport) {
    let pipe = report
        .summary
        .as_ref()
        .filter(|s| s.pipeline_hits + s.pipeline_misses > 0)
        .map_or(String::new(), |s| {
            format!(
                ", pipeline {} hits / {} misses ({:.1} ms drafted ahead in vain)",
                s.pipeline_hits, s.pipeline_misses, s.pipeline_wasted_ms
            )
        });
    eprintln!(
        "\n[service pair: {} tokens in {} steps, {:.2} tokens/step, {:.2} tokens/s{pipe}]",
        report.tokens.len(),
        report.steps,
        report.mean_tokens_per_step,
        report.tokens_per_second
    );
}

/// Compare the pair's output and speed with the target-only run.
fn compare_with_baseline(args: &DemoArgs, report: &GenerateReport, tokens: &[u32], tps: f64) {
    if args.temperature == 0.0 {
        let same = tokens == report.tokens.as_slice();
        eprintln!(
            "greedy outputs {}",
            if same {
                "identical".to_string()
            } else {
                format!(
                    "differ (first difference at token {})",
                    first_diff(tokens, &report.tokens)
                )
            }
        );
    }
    if report.tokens_per_second > 0.0 && tps > 0.0 {
        eprintln!(
            "speedup of the service pair over the target alone: {:.2}x",
            report.tokens_per_second / tps
        );
    }
}

/// `sequoia demo --draft-addr`: the demo against services that are already running.
fn demo_given(args: &DemoArgs, addr: &str) -> Result<()> {
    let rt = tokio::runtime::Runtime::new()?;
    let side = |cpus: &Option<String>, threads: Option<usize>| {
        format!(
            "CPUs {}, {} threads",
            cpus.as_deref().unwrap_or("any"),
            threads.map_or("default".to_string(), |t| t.to_string())
        )
    };
    eprintln!(
        "== setup: draft {}; verify {}; RTT +{} ms; bandwidth {}",
        side(&args.two.draft_cpus, args.draft_threads),
        side(&args.two.verify_cpus, args.verify_threads),
        args.rtt_ms,
        if args.two.bandwidth_mbps > 0.0 {
            format!("{} Mbit/s", args.two.bandwidth_mbps)
        } else {
            "unlimited".into()
        }
    );
    eprintln!(
        "== generating through the draft-service at {addr} (T = {}{})\n",
        args.temperature,
        if args.pipeline { ", pipelined" } else { "" }
    );
    let security = ClientSecurity::default();
    let report = rt.block_on(run_generate(addr, &security, demo_request(args), false))?;
    print_pair_report(&report);
    if args.no_baseline {
        return Ok(());
    }
    let (tokens, tps) = match &args.target_addr {
        Some(base) => {
            eprintln!("== the same prompt, target only (root-only trees through {base})");
            let mut req = demo_request(args);
            req.tree_parents = sequoia_core::tree::Tree::chain(1).parents().to_vec();
            req.pipeline = Some(false);
            let r = rt.block_on(run_generate(base, &security, req, true))?;
            (r.tokens, r.tokens_per_second)
        }
        None => {
            eprintln!("== the same prompt decoded by the target alone (in this process)");
            let params = SamplingParams {
                temperature: args.temperature,
                top_k: 0,
                top_p: 1.0,
            };
            let target = resolve(&args.target)?;
            let (tokens, secs) = target_alone(
                &target,
                &args.prompt,
                args.raw,
                args.max_tokens as usize,
                &params,
            )?;
            let tps = tokens.len() as f64 / secs;
            (tokens, tps)
        }
    };
    eprintln!(
        "[target alone: {} tokens, {:.2} tokens/s]",
        tokens.len(),
        tps
    );
    compare_with_baseline(args, &report, &tokens, tps);
    Ok(())
}

pub(crate) fn resolve(arg: &str) -> Result<PathBuf> {
    let p = PathBuf::from(arg);
    if p.exists() {
        return Ok(p);
    }
    models::ensure_model(arg)
        .with_context(|| format!("model {arg:?} is neither a file nor a default model name"))
}

/// A child service process, killed if still running when dropped.
pub(crate) struct Service {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Service {
    pub(crate) fn spawn(
        name: &'static str,
        args: &[String],
        env: &[(&str, String)],
        logs: &Path,
    ) -> Result<Self> {
        let bin = sibling_binary(name)?;
        let log = logs.join(format!("{name}.log"));
        let file = std::fs::File::create(&log)?;
        let child = Command::new(&bin)
            .args(args)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(file.try_clone()?)
            .stderr(file)
            .stdin(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        Ok(Self { name, child, log })
    }

    fn check_alive(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(15).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            bail!(
                "{} exited ({status}); last log lines:\n{}",
                self.name,
                tail.join("\n")
            );
        }
        Ok(())
    }

    /// SIGKILL and reap: the process dies at once, like a lost machine (`sequoia chaos`).
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then wait up to 10 s, then kill.
    fn stop(&mut self) {
        #[cfg(unix)]
        {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(self.child.id().to_string())
                .status();
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(10) {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.stop();
        }
    }
}

/// The service binaries live next to `sequoia` (same cargo target directory).
fn sibling_binary(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let bin = exe.with_file_name(name);
    if !bin.exists() {
        bail!(
            "{} not found next to {}; build the workspace first: cargo build --release --workspace",
            name,
            exe.display()
        );
    }
    Ok(bin)
}

pub(crate) fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Wait until the service answers a gRPC health check.
pub(crate) async fn wait_ready(svc: &mut Service, url: &str, timeout: Duration) -> Result<()> {
    let t0 = Instant::now();
    loop {
        svc.check_alive()?;
        if let Ok(channel) = tonic::transport::Endpoint::from_shared(url.to_string())?
            .connect()
            .await
        {
            let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
            let req = tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            };
            if let Ok(r) = health.check(req).await {
                if r.into_inner().status
                    == tonic_health::pb::health_check_response::ServingStatus::Serving as i32
                {
                    return Ok(());
                }
            }
        }
        if t0.elapsed() > timeout {
            bail!(
                "{} did not become ready within {timeout:?}; see {}",
                svc.name,
                svc.log.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Target-only decoding in this process: the baseline the demo compares against. Returns the
/// tokens (EOS excluded) and the decode seconds after the prompt's prefill.
fn target_alone(
    path: &Path,
    prompt_text: &str,
    raw: bool,
    max_tokens: usize,
    params: &SamplingParams,
) -> Result<(Vec<u32>, f64)> {
    let tok = TextTokenizer::load_for_model(path)?;
    let model = Model::load(path, &LoadOptions::default())?;
    let text = if raw {
        prompt_text.to_string()
    } else {
        tok.apply_chat_template(&[ChatMessage::user(prompt_text.to_string())], true)?
    };
    let ids = tok.encode(&text, false)?;
    let mut cache = model.new_cache();
    let mut logits = model.forward_chain_last(&mut cache, &ids)?;
    // Timed from the first token on, like the service pair's tokens_per_second.
    let t0 = Instant::now();
    let mut rng = SessionRng::new(0, VERIFY_STREAM);
    let mut out = Vec::new();
    while out.len() < max_tokens {
        let next = if params.is_greedy() {
            argmax(&logits)
        } else {
            sample_dense(&probs_from_logits(&logits, params), &mut rng)
        };
        if tok.is_eos(next) {
            break;
        }
        out.push(next);
        logits = model.forward_chain_last(&mut cache, &[next])?;
    }
    Ok((out, t0.elapsed().as_secs_f64()))
}

pub fn demo(args: &DemoArgs) -> Result<()> {
    args.two.validate()?;
    if !(args.rtt_ms.is_finite() && args.rtt_ms >= 0.0) {
        bail!("--rtt-ms must be a non-negative number");
    }
    if args.two.two_host {
        return demo_two_host(args);
    }
    if let Some(addr) = &args.draft_addr {
        return demo_given(args, addr);
    }
    if args.rtt_ms > 0.0
        || args.two.bandwidth_mbps > 0.0
        || args.two.draft_cpus.is_some()
        || args.two.verify_cpus.is_some()
    {
        bail!("--rtt-ms, --bandwidth-mbps and --draft-cpus/--verify-cpus need --two-host");
    }
    let threads = |t: Option<usize>| -> Vec<String> {
        t.map(|t| vec!["--threads".into(), t.to_string()])
            .unwrap_or_default()
    };
    eprintln!("== models");
    let draft = resolve(&args.draft)?;
    let target = resolve(&args.target)?;
    eprintln!("draft  {}\ntarget {}", draft.display(), target.display());
    let logs = std::env::temp_dir().join(format!("sequoia-demo-{}", std::process::id()));
    std::fs::create_dir_all(&logs)?;
    let (vport, dport, hport) = (free_port()?, free_port()?, free_port()?);
    let verify_url = format!("http://127.0.0.1:{vport}");
    let draft_url = format!("http://127.0.0.1:{dport}");
    let http_url = format!("http://127.0.0.1:{hport}");
    let rt = tokio::runtime::Runtime::new()?;

    eprintln!(
        "== starting verify-service on {verify_url} and draft-service on {draft_url} (logs in {})",
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
    let mut draft_args = vec![
        "--model".into(),
        draft.display().to_string(),
        "--verify".into(),
        verify_url.clone(),
        "--listen".into(),
        format!("127.0.0.1:{dport}"),
        "--http-listen".into(),
        format!("127.0.0.1:{hport}"),
    ];
    draft_args.extend(threads(args.draft_threads));
    let mut drafter = Service::spawn(
        "draft-service",
        &draft_args,
        // The tree budget goes through the environment layer of the config.
        &[("SEQUOIA_TREE__NODES", args.nodes.to_string())],
        &logs,
    )?;
    rt.block_on(wait_ready(
        &mut drafter,
        &draft_url,
        Duration::from_secs(300),
    ))?;

    eprintln!(
        "== HTTP API (OpenAI-compatible) and playground on {http_url}/ (while the demo runs)\n   \
         curl -N {http_url}/v1/chat/completions -d '{{\"model\": \"...\", \"stream\": true, \
         \"messages\": [{{\"role\": \"user\", \"content\": \"hi\"}}]}}'"
    );
    eprintln!(
        "== generating through the service pair (T = {})\n",
        args.temperature
    );
    let report = rt.block_on(run_generate(
        &draft_url,
        &ClientSecurity::default(),
        demo_request(args),
        false,
    ))?;
    drafter.stop();
    verify.stop();
    print_pair_report(&report);
    if args.no_baseline {
        return Ok(());
    }
    eprintln!("== the same prompt decoded by the target alone");
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: 0,
        top_p: 1.0,
    };
    let (tokens, secs) = target_alone(
        &target,
        &args.prompt,
        args.raw,
        args.max_tokens as usize,
        &params,
    )?;
    let tps = tokens.len() as f64 / secs;
    eprintln!(
        "[target alone: {} tokens, {:.2} tokens/s]",
        tokens.len(),
        tps
    );
    compare_with_baseline(args, &report, &tokens, tps);
    Ok(())
}

fn first_diff(a: &[u32], b: &[u32]) -> usize {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .unwrap_or(a.len().min(b.len()))
}

//! Test harness for cross-service tests: tiny random-weight models written by the tests, both
//! services started in-process on ephemeral ports (each in its own runtime, so a test can kill
//! one abruptly), and plain target-only decoding to compare against.

use draft_service::config::{DraftConfig, TreeConfig};
use sequoia_core::sampling::{argmax, probs_from_logits, SamplingParams};
use sequoia_engine::testing::{write_tiny_model, TinyArch, TinySpec};
use sequoia_engine::tokenizer::testing::{
    write_tiny_tokenizer, write_tiny_tokenizer_variant, TINY_VOCAB_SIZE,
};
use sequoia_engine::tokenizer::TextTokenizer;
use sequoia_engine::{LoadOptions, Model};
use sequoia_proto::v1::generation_client::GenerationClient;
use sequoia_proto::v1::{GenerateChunk, GenerateRequest, GenerateSummary};
use sequoia_server::metrics::Metrics;
use sequoia_server::security::ClientSecurity;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use verify_service::config::VerifyConfig;

/// A tiny target and a draft that is the target plus noise (so acceptance is realistic).
pub struct TinyPair {
    pub dir: tempfile::TempDir,
    pub target: PathBuf,
    pub draft: PathBuf,
    /// A model with a tokenizer whose merges differ.
    pub other: PathBuf,
}

pub fn tiny_spec(seed: u64) -> TinySpec {
    TinySpec {
        arch: TinyArch::Qwen2,
        seed,
        vocab_size: TINY_VOCAB_SIZE,
        ..TinySpec::default()
    }
}

impl TinyPair {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let target = dir.path().join("target");
        let draft = dir.path().join("draft");
        let other = dir.path().join("other");
        for p in [&target, &draft, &other] {
            std::fs::create_dir_all(p).unwrap();
        }
        write_tiny_model(&target, &tiny_spec(1)).unwrap();
        write_tiny_tokenizer(&target).unwrap();
        let draft_spec = TinySpec {
            seed: 2,
            perturb_of: Some(1),
            noise: 0.5,
            arch: TinyArch::Llama,
            ..tiny_spec(2)
        };
        write_tiny_model(&draft, &draft_spec).unwrap();
        write_tiny_tokenizer(&draft).unwrap();
        write_tiny_model(&other, &tiny_spec(3)).unwrap();
        write_tiny_tokenizer_variant(&other).unwrap();
        Self {
            dir,
            target,
            draft,
            other,
        }
    }
}

impl Default for TinyPair {
    fn default() -> Self {
        Self::new()
    }
}

/// A service running on its own runtime; dropping or [`kill`](Self::kill)ing it tears down
/// every connection at once, like a crashed process.
pub struct Running {
    pub addr: SocketAddr,
    /// The `/metrics` endpoint, when the config enables it.
    pub metrics: Option<SocketAddr>,
    /// draft-service's HTTP API, when the config enables it.
    pub http: Option<SocketAddr>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Running {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The URL for a service with TLS ([`TestPki`] certificates name 127.0.0.1).
    pub fn https_url(&self) -> String {
        format!("https://{}", self.addr)
    }

    pub fn kill(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Where a service's `/metrics` listens once `serve` has bound it (`None`: metrics off).
fn metrics_addr(rt: &tokio::runtime::Runtime, metrics: &Metrics) -> Option<SocketAddr> {
    metrics.is_enabled().then(|| {
        rt.block_on(within(10, async {
            loop {
                match metrics.local_addr() {
                    Some(a) => return a,
                    None => tokio::time::sleep(Duration::from_millis(5)).await,
                }
            }
        }))
    })
}

/// GET `/metrics` (Prometheus text) from a service's metrics endpoint.
pub async fn scrape(addr: SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: test\r\n\r\n")
        .await
        .unwrap();
    let mut response = String::new();
    conn.read_to_string(&mut response).await.unwrap();
    assert!(response.starts_with("HTTP/1.0 200"), "{response}");
    response
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

pub fn verify_config(model: &Path) -> VerifyConfig {
    VerifyConfig {
        model: model.to_path_buf(),
        listen: "127.0.0.1:0".into(),
        max_context: 1024,
        ..VerifyConfig::default()
    }
}

pub fn start_verify(config: VerifyConfig) -> Running {
    start_verify_state(verify_service::load_state(config).expect("verify-service loads"))
}

/// A verify-service around a state built by the test (e.g. a random-weight quantized model).
pub fn start_verify_state(state: std::sync::Arc<verify_service::service::VerifyState>) -> Running {
    let rt = runtime();
    let metrics = state.metrics.clone();
    launch(rt, "verify-service", &metrics, move |listener| {
        verify_service::serve(state, listener, std::future::pending())
    })
}

/// Bind an ephemeral port on `rt` and serve there until the runtime is dropped.
fn launch<F>(
    rt: tokio::runtime::Runtime,
    name: &'static str,
    metrics: &Metrics,
    serve: impl FnOnce(tokio::net::TcpListener) -> F,
) -> Running
where
    F: std::future::Future<Output = anyhow::Result<()>> + Send + 'static,
{
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let fut = serve(listener);
    rt.spawn(async move {
        if let Err(e) = fut.await {
            eprintln!("{name} stopped: {e:#}");
        }
    });
    Running {
        addr,
        metrics: metrics_addr(&rt, metrics),
        http: None,
        runtime: Some(rt),
    }
}

/// A draft-service drafting fixed trees of `nodes` nodes and `levels` levels.
pub fn draft_config(model: &Path, verify: &[String], nodes: usize, levels: usize) -> DraftConfig {
    DraftConfig {
        model: model.to_path_buf(),
        verify: verify.to_vec(),
        listen: "127.0.0.1:0".into(),
        max_context: 1024,
        step_timeout_secs: 20.0,
        http_listen: "127.0.0.1:0".into(),
        tree: TreeConfig {
            mode: "fixed".into(),
            nodes,
            max_levels: levels,
            ..TreeConfig::default()
        },
        ..DraftConfig::default()
    }
}

pub fn start_draft(config: DraftConfig) -> Running {
    let rt = runtime();
    let _in_runtime = rt.enter(); // verify channels are created inside a runtime
    let state = draft_service::load_state(config).expect("draft-service loads");
    let metrics = state.metrics.clone();
    let http_on = !state.config.http_listen.trim().is_empty();
    let served = state.clone();
    drop(_in_runtime);
    let mut running = launch(rt, "draft-service", &metrics, move |listener| {
        draft_service::serve(served, listener, std::future::pending())
    });
    if http_on {
        let rt = running.runtime.as_ref().unwrap();
        running.http = Some(rt.block_on(within(10, async {
            loop {
                match state.http_addr.get() {
                    Some(a) => return *a,
                    None => tokio::time::sleep(Duration::from_millis(5)).await,
                }
            }
        })));
    }
    running
}

/// Result of one Generate call, collected from the stream.
#[derive(Debug, Default)]
pub struct Generated {
    pub text: String,
    pub tokens: Vec<u32>,
    pub summary: Option<GenerateSummary>,
    pub chunks: Vec<GenerateChunk>,
}

pub async fn generate(url: &str, req: GenerateRequest) -> Result<Generated, tonic::Status> {
    generate_with(url, &ClientSecurity::default(), req).await
}

/// [`generate`] over TLS (for `https://` URLs) and/or with a bearer token.
pub async fn generate_with(
    url: &str,
    security: &ClientSecurity,
    req: GenerateRequest,
) -> Result<Generated, tonic::Status> {
    let channel = security
        .endpoint(url)
        .map_err(|e| tonic::Status::invalid_argument(e.to_string()))?
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(format!("{e:?}")))?;
    let mut client = GenerationClient::with_interceptor(channel, security.token.clone());
    let mut stream = client.generate(req).await?.into_inner();
    let mut out = Generated::default();
    while let Some(chunk) = stream.message().await? {
        out.text.push_str(&chunk.text);
        out.tokens.extend(&chunk.token_ids);
        if chunk.summary.is_some() {
            out.summary = chunk.summary.clone();
        }
        out.chunks.push(chunk);
    }
    Ok(out)
}

pub fn request(prompt: &str, max_tokens: u32, temperature: f32, seed: u64) -> GenerateRequest {
    GenerateRequest {
        prompt: prompt.into(),
        max_tokens,
        temperature,
        seed: Some(seed),
        ..Default::default()
    }
}

/// Target-only greedy decoding with the engine (what `sequoia generate-local` does at T = 0).
pub fn plain_greedy(model_dir: &Path, prompt: &str, max_tokens: usize) -> Vec<u32> {
    let model = Model::load(model_dir, &LoadOptions::default()).unwrap();
    let tok = TextTokenizer::load_for_model(model_dir).unwrap();
    let ids = tok.encode(prompt, true).unwrap();
    let mut cache = model.new_cache();
    let mut logits = model.forward_chain_last(&mut cache, &ids).unwrap();
    let mut out = Vec::new();
    while out.len() < max_tokens {
        let next = argmax(&logits);
        if tok.eos_ids().contains(&next) {
            break;
        }
        out.push(next);
        logits = model.forward_chain_last(&mut cache, &[next]).unwrap();
    }
    out
}

/// The target's distribution of the first generated token, and the marginal of the second given
/// that the first is not an end-of-sequence token (EOS ends a generation).
pub fn target_first_two(
    model_dir: &Path,
    prompt: &str,
    params: &SamplingParams,
) -> (Vec<f64>, Vec<f64>) {
    let model = Model::load(model_dir, &LoadOptions::default()).unwrap();
    let tok = TextTokenizer::load_for_model(model_dir).unwrap();
    let ids = tok.encode(prompt, true).unwrap();
    let mut cache = model.new_cache();
    let first = probs_from_logits(&model.forward_chain_last(&mut cache, &ids).unwrap(), params);
    let base = cache.len();
    let mut second = vec![0.0f64; first.len()];
    for (a, &pa) in first.iter().enumerate() {
        if pa <= 0.0 || tok.eos_ids().contains(&(a as u32)) {
            continue;
        }
        let l = model.forward_chain_last(&mut cache, &[a as u32]).unwrap();
        cache.truncate(base);
        for (b, &pb) in probs_from_logits(&l, params).iter().enumerate() {
            second[b] += pa as f64 * pb as f64;
        }
    }
    let total: f64 = second.iter().sum();
    second.iter_mut().for_each(|p| *p /= total);
    (first.iter().map(|&p| p as f64).collect(), second)
}

/// The target's marginal distribution of the third generated token, given that neither of the
/// first two is an end-of-sequence token: Σ p(a) p(b | a) p(· | a, b) over every a, b (a
/// forward per pair, fine for the tiny test vocabularies).
pub fn target_third(model_dir: &Path, prompt: &str, params: &SamplingParams) -> Vec<f64> {
    let model = Model::load(model_dir, &LoadOptions::default()).unwrap();
    let tok = TextTokenizer::load_for_model(model_dir).unwrap();
    let eos = tok.eos_ids();
    let ids = tok.encode(prompt, true).unwrap();
    let mut cache = model.new_cache();
    let first = probs_from_logits(&model.forward_chain_last(&mut cache, &ids).unwrap(), params);
    let base = cache.len();
    let mut third = vec![0.0f64; first.len()];
    for (a, &pa) in first.iter().enumerate() {
        if pa <= 0.0 || eos.contains(&(a as u32)) {
            continue;
        }
        let la = model.forward_chain_last(&mut cache, &[a as u32]).unwrap();
        let second = probs_from_logits(&la, params);
        for (b, &pb) in second.iter().enumerate() {
            if pb <= 0.0 || eos.contains(&(b as u32)) {
                continue;
            }
            let lb = model.forward_chain_last(&mut cache, &[b as u32]).unwrap();
            cache.truncate(base + 1);
            let w = pa as f64 * pb as f64;
            for (c, &pc) in probs_from_logits(&lb, params).iter().enumerate() {
                third[c] += w * pc as f64;
            }
        }
        cache.truncate(base);
    }
    let total: f64 = third.iter().sum();
    third.iter_mut().for_each(|p| *p /= total);
    third
}

/// Largest |f − p| over cells in units of the binomial standard deviation sqrt(p(1−p)/n);
/// infinity when a cell of probability 0 was observed. Cells expected fewer than 10 times are
/// pooled into one cell first, so the normal approximation behind a σ bound holds everywhere.
pub fn worst_sigma(counts: &[usize], expected: &[f64], n: usize) -> f64 {
    let mut cells: Vec<(usize, f64)> = Vec::new();
    let mut pooled = (0usize, 0.0f64);
    for (&c, &p) in counts.iter().zip(expected) {
        if p <= 1e-12 {
            if c > 0 {
                return f64::INFINITY;
            }
        } else if p * (n as f64) < 10.0 {
            pooled.0 += c;
            pooled.1 += p;
        } else {
            cells.push((c, p));
        }
    }
    if pooled.1 > 0.0 {
        cells.push(pooled);
    }
    let mut worst = 0.0f64;
    for (c, p) in cells {
        let f = c as f64 / n as f64;
        let sd = (p * (1.0 - p) / n as f64).sqrt().max(1e-12);
        worst = worst.max((f - p).abs() / sd);
    }
    worst
}

/// Wait for a future with a deadline, failing the test on a hang.
pub async fn within<T>(secs: u64, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .expect("call hung past its deadline")
}

/// A `Verifier.Session` on `url`, opened at protocol `version` for `prompt` (its last token is
/// the first tree's root, so it is not sent) with room for 40 new tokens; returns the request
/// sender and the response stream after `opened`.
pub async fn open_session(
    url: &str,
    prompt: &[u32],
    version: u32,
) -> (
    tokio::sync::mpsc::Sender<sequoia_proto::v1::SessionRequest>,
    tonic::Streaming<sequoia_proto::v1::SessionResponse>,
) {
    use sequoia_proto::v1 as pb;
    let mut c = pb::verifier_client::VerifierClient::connect(url.to_string())
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    tx.send(pb::SessionRequest {
        msg: Some(pb::session_request::Msg::Open(pb::OpenSession {
            prefix_tokens: prompt[..prompt.len() - 1].to_vec(),
            max_new_tokens: 40,
            protocol_version: version,
            ..Default::default()
        })),
    })
    .await
    .unwrap();
    let mut s = c
        .session(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    match s.message().await.unwrap().unwrap().msg {
        Some(pb::session_response::Msg::Opened(_)) => {}
        other => panic!("expected opened, got {other:?}"),
    }
    (tx, s)
}

/// The address of a proxy, run on `rt`, that holds every message to and from the verify node at
/// `verify_url` for half of `rtt_ms` each way: a verify node that far away.
pub fn far_away(rt: &tokio::runtime::Runtime, verify_url: &str, rtt_ms: u64) -> String {
    let upstream = verify_url.trim_start_matches("http://").to_string();
    let rtt = Duration::from_millis(rtt_ms);
    let proxy = rt
        .block_on(sequoia_server::delay_proxy::DelayProxy::bind(
            "127.0.0.1:0",
            &upstream,
            rtt,
            0.0,
        ))
        .expect("bind the delay proxy");
    let url = format!("http://{}", proxy.local_addr().unwrap());
    rt.spawn(proxy.run(std::future::pending()));
    url
}

/// Target-only greedy decoding from given prompt ids; also returns, at each generated position,
/// the gap between the best and second-best logit (to recognize near-ties).
pub fn plain_greedy_ids(
    model: &Model,
    eos: &[u32],
    ids: &[u32],
    max_tokens: usize,
) -> (Vec<u32>, Vec<f32>) {
    let mut cache = model.new_cache();
    let mut logits = model.forward_chain_last(&mut cache, ids).unwrap();
    let (mut out, mut gaps) = (Vec::new(), Vec::new());
    while out.len() < max_tokens {
        let next = argmax(&logits);
        let best = logits[next as usize];
        let second = logits
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != next as usize)
            .map(|(_, &x)| x)
            .fold(f32::NEG_INFINITY, f32::max);
        if eos.contains(&next) {
            break;
        }
        out.push(next);
        gaps.push(best - second);
        logits = model.forward_chain_last(&mut cache, &[next]).unwrap();
    }
    (out, gaps)
}

/// The first turn of the first prompt of each category in a Spec-Bench style JSONL file.
pub fn spec_bench_prompts(path: &Path, count: usize) -> Vec<(String, String)> {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let mut seen = std::collections::BTreeSet::new();
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let cat = v["category"].as_str().unwrap_or("").to_string();
        if seen.insert(cat.clone()) {
            out.push((cat, v["turns"][0].as_str().unwrap().to_string()));
        }
        if out.len() == count {
            break;
        }
    }
    out
}

/// Certificates for TLS tests, written as PEM files: a CA, a server certificate for localhost
/// and 127.0.0.1, and client certificates signed by the CA or by an unrelated one.
pub struct TestPki {
    pub dir: tempfile::TempDir,
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    /// A client certificate from another CA: mutual TLS must refuse it.
    pub rogue_cert: PathBuf,
    pub rogue_key: PathBuf,
}

impl TestPki {
    pub fn new() -> Self {
        use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, pem: String| {
            let path = dir.path().join(name);
            std::fs::write(&path, pem).unwrap();
            path
        };
        let new_ca = |name: &str| {
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, name);
            CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
        };
        let leaf = |issuer: &CertifiedIssuer<'_, KeyPair>, names: &[&str]| {
            let key = KeyPair::generate().unwrap();
            let params =
                CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                    .unwrap();
            (
                params.signed_by(&key, issuer).unwrap().pem(),
                key.serialize_pem(),
            )
        };
        let ca = new_ca("sequoia test CA");
        let rogue_ca = new_ca("some other CA");
        let (server_cert, server_key) = leaf(&ca, &["localhost", "127.0.0.1"]);
        let (client_cert, client_key) = leaf(&ca, &["draft-service"]);
        let (rogue_cert, rogue_key) = leaf(&rogue_ca, &["draft-service"]);
        Self {
            ca: write("ca.crt", ca.pem()),
            server_cert: write("server.crt", server_cert),
            server_key: write("server.key", server_key),
            client_cert: write("client.crt", client_cert),
            client_key: write("client.key", client_key),
            rogue_cert: write("rogue.crt", rogue_cert),
            rogue_key: write("rogue.key", rogue_key),
            dir,
        }
    }
}

impl Default for TestPki {
    fn default() -> Self {
        Self::new()
    }
}

/// verify-service as a separate OS process running the real command line, for tests that kill
/// it (SIGKILL) or shut it down (SIGTERM). Killed when dropped.
pub struct VerifyProcess {
    pub addr: SocketAddr,
    child: std::process::Child,
}

impl VerifyProcess {
    /// Start `exe` (in integration tests: `env!("CARGO_BIN_EXE_verify-node-under-test")`,
    /// the real verify-service command line) for `model` on a free local port, with extra
    /// `SEQUOIA_*` settings, and wait until it answers `Info`.
    pub fn start(exe: &str, model: &Path, env: &[(&str, &str)]) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        Self::start_at(exe, model, ([127, 0, 0, 1], port).into(), env)
    }

    /// [`start`](Self::start) on a given address: a node restarted after a kill comes back
    /// where the draft-service's configuration points.
    pub fn start_at(exe: &str, model: &Path, addr: SocketAddr, env: &[(&str, &str)]) -> Self {
        let child = std::process::Command::new(exe)
            .arg("--model")
            .arg(model)
            .args(["--listen", &addr.to_string(), "--max-context", "1024"])
            .args(["--threads", "1"])
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("verify-node-under-test starts");
        let mut process = Self { addr, child };
        let url = process.url();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let ready = rt.block_on(async {
            for _ in 0..600 {
                if let Ok(mut c) =
                    sequoia_proto::v1::verifier_client::VerifierClient::connect(url.clone()).await
                {
                    if c.info(sequoia_proto::v1::InfoRequest {}).await.is_ok() {
                        return true;
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            false
        });
        if !ready {
            let status = process.child.try_wait();
            panic!(
                "verify-service process on {addr} did not answer within 60 s (exit: {status:?})"
            );
        }
        process
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// SIGKILL: the process dies at once, like a lost machine.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM: what Kubernetes sends before it stops a pod.
    pub fn terminate(&self) {
        let status = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill(1) runs");
        assert!(status.success(), "kill -TERM failed");
    }

    /// The exit status, waiting at most `secs`.
    pub fn wait_exit(&mut self, secs: u64) -> Option<std::process::ExitStatus> {
        for _ in 0..secs * 20 {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for VerifyProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The value of one Prometheus series (`name{labels}` exactly as rendered), if present.
pub fn series_value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// An in-memory sink for a test's process-wide log subscriber
/// (`sequoia_server::telemetry::subscriber(json, move || sink.clone())`): every byte written,
/// in order, shared by its clones.
#[derive(Clone, Default)]
pub struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// Everything logged so far, as text (the services log UTF-8 only).
    pub fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).expect("the log is UTF-8")
    }

    /// A sink installed as this test binary's process-wide log subscriber, in the services'
    /// own text format (one per binary: the first call wins, a second panics).
    pub fn install() -> Self {
        let log = Self::default();
        let sink = log.clone();
        tracing::subscriber::set_global_default(sequoia_server::telemetry::subscriber(
            false,
            move || sink.clone(),
        ))
        .expect("the only subscriber in this test binary");
        log
    }
}

//! Test harness for cross-service tests: tiny random-weight models written by the tests, both
//! services started in-process on ephemeral ports (each in its own runtime, so a test can kill
//! one abruptly), and plain target-only decoding to compare against.

use draft_service::config::{DraftConfig, TreeConfig};
use sequoia_proto::v1::generation_client::GenerationClient;
use sequoia_proto::v1::{GenerateChunk, GenerateRequest, GenerateSummary};
use sequoia_shared::engine::testing::{write_tiny_model, TinyArch, TinySpec};
use sequoia_shared::engine::{LoadOptions, Model};
use sequoia_shared::sampling::{argmax, probs_from_logits, SamplingParams};
use sequoia_shared::tokenizer::testing::{
    write_tiny_tokenizer, write_tiny_tokenizer_variant, TINY_VOCAB_SIZE,
};
use sequoia_shared::tokenizer::TextTokenizer;
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
    runtime: Option<tokio::runtime::Runtime>,
}

impl Running {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
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
    let rt = runtime();
    let state = verify_service::load_state(config).expect("verify-service loads");
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(async move {
        let _ = verify_service::serve(state, listener, std::future::pending()).await;
    });
    Running {
        addr,
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
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(async move {
        let _ = draft_service::serve(state, listener, std::future::pending()).await;
    });
    Running {
        addr,
        runtime: Some(rt),
    }
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
    let mut client = GenerationClient::connect(url.to_string())
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
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

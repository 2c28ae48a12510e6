//! `generate-local` and `engine-bench`: the engine alone on this machine.
//!
//! `generate-local` is the baseline every speedup is measured against: plain autoregressive
//! decoding of the target model with the same engine, sampler and cores as the services.
//! `engine-bench` measures what the planner needs: decode speed and the cost `t(n)` of one
//! tree-masked forward over `n` nodes at a working context length.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use sequoia_core::sampling::{
    argmax, probs_from_logits, sample_dense, SamplingParams, SessionRng, VERIFY_STREAM,
};
use sequoia_core::tree::Tree;
use sequoia_core::types::FinishReason;
use sequoia_engine::tokenizer::{ChatMessage, IncrementalDecoder, TextTokenizer};
use sequoia_engine::{kernels, roofline};
use sequoia_engine::{LoadOptions, Model};
use serde::Serialize;

/// A model argument: a path (GGUF file or Hugging Face folder) or a default model's short name
/// (`qwen2.5-coder-1.5b`, ...), fetched on first use.
pub fn resolve_model(arg: &str) -> Result<PathBuf> {
    let path = PathBuf::from(arg);
    if path.exists() {
        return Ok(path);
    }
    if sequoia_models::spec(arg).is_ok() {
        return sequoia_models::ensure_model(arg).with_context(|| format!("fetching model {arg}"));
    }
    bail!("model {arg:?} is neither an existing path nor a known model name")
}

fn load_model(arg: &str, threads: Option<usize>, cuda: bool, max_context: usize) -> Result<Model> {
    let path = resolve_model(arg)?;
    let opts = LoadOptions {
        threads,
        cuda,
        max_context,
    };
    Model::load(&path, &opts).with_context(|| format!("loading {}", path.display()))
}

/// `--random-weights SHAPE` / `--random-format F`: a model of a real architecture's shape with
/// random weights, made in memory (no download), for cost measurements on machines without
/// network access.
pub fn load_random(
    shape: &str,
    format: &str,
    threads: Option<usize>,
    cuda: bool,
    max_context: usize,
) -> Result<Model> {
    use sequoia_engine::random::RandomSpec;
    let spec = RandomSpec {
        quant: format.parse()?,
        ..RandomSpec::named(shape)?
    };
    let opts = LoadOptions {
        threads,
        cuda,
        max_context,
    };
    Model::random(&spec, &opts, sequoia_engine::Kernels::Native)
        .with_context(|| format!("random weights of shape {shape}"))
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct GenerateLocalArgs {
    /// GGUF file, Hugging Face folder, or a default model name (e.g. qwen2.5-coder-1.5b).
    #[arg(long)]
    pub model: String,
    /// The prompt (raw text unless --chat).
    #[arg(long)]
    pub prompt: String,
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// CPU threads (rayon pool size).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Use the prompt text as is (the default; accepted for explicitness).
    #[arg(long, conflicts_with = "chat")]
    pub raw: bool,
    /// Keep going after an end-of-sequence token (fixed-length benchmarks).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Run on the first CUDA device.
    #[arg(long)]
    pub cuda: bool,
    #[arg(long, default_value_t = 4096)]
    pub max_context: usize,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct GenerateReport {
    model: String,
    text: String,
    tokens: Vec<u32>,
    prompt_tokens: usize,
    generated_tokens: usize,
    /// "eos", "length" (max_tokens) or "context" (context limit reached).
    finish_reason: FinishReason,
    prefill_ms: f64,
    /// Time of the single-token forwards after the first token.
    decode_ms: f64,
    /// Single-token forwards per second (the decode speed).
    tokens_per_second: f64,
    total_ms: f64,
    threads: usize,
}

/// Plain autoregressive decoding with the target alone (the baseline).
pub fn generate_local(args: &GenerateLocalArgs) -> Result<()> {
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
    };
    params.validate()?;
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let path = resolve_model(&args.model)?;
    let tok = TextTokenizer::load_for_model(&path)
        .with_context(|| format!("tokenizer for {}", path.display()))?;
    let model = load_model(&args.model, args.threads, args.cuda, args.max_context)?;
    let prompt_ids = if args.chat {
        let text = tok.apply_chat_template(&[ChatMessage::user(args.prompt.clone())], true)?;
        tok.encode(&text, false)?
    } else {
        tok.encode(&args.prompt, true)?
    };
    if prompt_ids.is_empty() {
        bail!("the prompt encodes to no tokens");
    }

    let start = Instant::now();
    let mut cache = model.new_cache();
    let mut logits = model.forward_chain_last(&mut cache, &prompt_ids)?;
    let prefill_ms = ms(start);

    let mut rng = SessionRng::new(args.seed, VERIFY_STREAM);
    let mut out: Vec<u32> = Vec::with_capacity(args.max_tokens);
    let mut stream = IncrementalDecoder::new(&tok, true);
    let mut stdout = std::io::stdout().lock();
    let decode_start = Instant::now();
    let mut forwards = 0usize;
    let finish_reason = loop {
        let next = if params.is_greedy() {
            argmax(&logits)
        } else {
            sample_dense(&probs_from_logits(&logits, &params), &mut rng)
        };
        out.push(next);
        if !args.json {
            write!(stdout, "{}", stream.push(&[next])?)?;
            stdout.flush()?;
        }
        if tok.is_eos(next) && !args.ignore_eos {
            break FinishReason::Eos;
        }
        if out.len() >= args.max_tokens {
            break FinishReason::Length;
        }
        if cache.len() >= cache.capacity() {
            break FinishReason::Context;
        }
        logits = model.forward_chain_last(&mut cache, &[next])?;
        forwards += 1;
    };
    let decode_ms = ms(decode_start);
    let total_ms = ms(start);
    let text = tok.decode(&out, true)?;
    let report = GenerateReport {
        model: model.info().name.clone(),
        text,
        prompt_tokens: prompt_ids.len(),
        generated_tokens: out.len(),
        tokens: out,
        finish_reason,
        prefill_ms,
        decode_ms,
        tokens_per_second: if decode_ms > 0.0 {
            forwards as f64 / (decode_ms / 1e3)
        } else {
            0.0
        },
        total_ms,
        threads: rayon_threads(),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        writeln!(stdout, "{}", stream.flush()?)?;
        eprintln!(
            "[{} prompt tokens, prefill {:.0} ms; {} tokens, {:.2} tokens/s; finish: {}]",
            report.prompt_tokens,
            report.prefill_ms,
            report.generated_tokens,
            report.tokens_per_second,
            report.finish_reason
        );
    }
    Ok(())
}

/// Threads the engine's CPU kernels actually run on (rayon's global pool).
fn rayon_threads() -> usize {
    sequoia_engine::current_threads()
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchTree {
    /// The Sequoia-optimal tree of n nodes for a typical acceptance vector.
    Sequoia,
    /// A chain of n nodes.
    Chain,
}

#[derive(clap::Args, Debug, Clone)]
pub struct EngineBenchArgs {
    /// GGUF file, Hugging Face folder, or a default model name (e.g. qwen2.5-coder-1.5b).
    #[arg(long, required_unless_present_any = ["kernels", "random_weights"], default_value = "")]
    pub model: String,
    /// Instead of --model: random weights of a real architecture's shape, made in memory (no
    /// download): qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, qwen2.5-14b (real layer counts,
    /// widths, heads, KV heads, vocabulary), or tiny.
    #[arg(long, conflicts_with = "model")]
    pub random_weights: Option<String>,
    /// Weight format of --random-weights: q4_k_m (llama.cpp's Q4_K_M mix: Q4_K, Q6_K, with
    /// Q5_0/Q8_0 where rows are not a multiple of 256) or q8_0.
    #[arg(long, default_value = "q4_k_m")]
    pub random_format: String,
    /// Instead of a model: each matmul kernel on each ISA path this CPU has, single-threaded,
    /// in G MAC/s and GB/s and as a share of this machine's peaks (measured first: read
    /// bandwidth and an int8 dot-product peak loop per ISA).
    #[arg(long)]
    pub kernels: bool,
    /// With --kernels: the weight shape `NxK` (output columns × input values). Default
    /// 8960x1536, the gate/up shape of Qwen2.5-1.5B; 1536x8960 is its down projection,
    /// 2048x1536 its fused Q/K/V. K must be a multiple of 256 (the K-quant block).
    #[arg(long, requires = "kernels", value_parser = parse_kernel_shape, default_value = "8960x1536")]
    pub shape: (usize, usize),
    /// After the t(n) timings: measure this machine's read bandwidth (all threads) and the
    /// int8 peak of the kernels' ISA, and print each t(n)'s roofline, max(weight bytes /
    /// bandwidth, n · weights / (threads · peak)), and how far above it the median is.
    #[arg(long, conflicts_with = "kernels")]
    pub roofline: bool,
    /// CPU threads (rayon pool size).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Committed context length before each measured forward.
    #[arg(long, default_value_t = 128)]
    pub context: usize,
    /// Tree sizes n to time.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64,128")]
    pub sizes: Vec<usize>,
    /// Timed repeats per size (after one warm-up); the median is reported.
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// Single-token decode steps timed for tokens/s.
    #[arg(long, default_value_t = 32)]
    pub decode_tokens: usize,
    /// Tree shape.
    #[arg(long, value_enum, default_value = "sequoia")]
    pub tree: BenchTree,
    /// Run on the first CUDA device.
    #[arg(long)]
    pub cuda: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct TreeTiming {
    n: usize,
    levels: usize,
    ms_median: f64,
    ms_min: f64,
    /// t(n) / t(1).
    ratio: f64,
    /// With --roofline: max(weight bytes / read bandwidth, n · weights / int8 peak of all
    /// threads), ms.
    roofline_ms: Option<f64>,
    /// With --roofline: median over the roofline.
    over_roofline: Option<f64>,
}

#[derive(Serialize)]
struct BenchReport {
    model: String,
    weights: String,
    device: String,
    /// Tree rows bit-identical to sequential decoding (see `ModelInfo::batch_invariant`).
    batch_invariant: bool,
    /// The hidden/layer shape when the weights were random (`--random-weights`).
    random_weights: Option<String>,
    threads: usize,
    context: usize,
    load_ms: f64,
    prefill_tokens_per_second: f64,
    decode_ms_median: f64,
    decode_tokens_per_second: f64,
    tree: &'static str,
    /// Of `load_ms`: repacking quantized weights into the kernels' layout.
    repack_ms: f64,
    /// t(n): one tree-masked forward over n nodes (logits for every node), median over repeats.
    t: Vec<TreeTiming>,
}

fn bench_tree(kind: BenchTree, n: usize) -> Result<Tree> {
    Ok(match kind {
        BenchTree::Chain => Tree::chain(n),
        BenchTree::Sequoia => {
            use sequoia_core::planner::{SequoiaDp, EXAMPLE_ACCEPTANCE};
            let levels = n.min(16);
            SequoiaDp::solve(&EXAMPLE_ACCEPTANCE, n, levels)?.tree(n, levels)
        }
    })
}

/// Deterministic filler tokens (the cost of a forward does not depend on the ids).
fn filler_tokens(n: usize, vocab: usize, salt: u64) -> Vec<u32> {
    (0..n as u64)
        .map(|i| {
            let x = (i + 1 + salt * 7919).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            ((x >> 20) % vocab.min(30_000) as u64) as u32
        })
        .collect()
}

/// Decode speed and the tree-forward cost curve t(n).
pub fn engine_bench(args: &EngineBenchArgs) -> Result<()> {
    if args.kernels {
        return kernel_bench(args);
    }
    if args.repeats == 0 {
        bail!("--repeats must be at least 1");
    }
    let max_n = args.sizes.iter().copied().max().unwrap_or(1);
    let needed = args.context + max_n.max(args.decode_tokens) + 1;
    let t0 = Instant::now();
    let model = match &args.random_weights {
        Some(shape) => load_random(
            shape,
            &args.random_format,
            args.threads,
            args.cuda,
            needed.max(4096),
        )?,
        None => load_model(&args.model, args.threads, args.cuda, needed.max(4096))?,
    };
    let load_ms = ms(t0);
    let info = model.info().clone();
    let vocab = info.vocab_size;
    let (repack, repacked_bytes) = kernels::repack_stats();
    if !args.json {
        eprintln!(
            "{} ({}, {} layers, {}, on {}{}), {} threads, loaded in {:.1} s ({:.1} s of it repacking {:.0} MB of weights for the kernels)",
            info.name,
            info.architecture,
            info.n_layers,
            info.weights,
            info.device,
            if info.batch_invariant { ", batch-invariant" } else { "" },
            rayon_threads(),
            load_ms / 1e3,
            repack.as_secs_f64(),
            repacked_bytes as f64 / 1e6
        );
    }

    // Committed context.
    let mut cache = model.new_cache();
    let ctx_tokens = filler_tokens(args.context.max(1), vocab, 1);
    let t = Instant::now();
    let mut logits = model.forward_chain_last(&mut cache, &ctx_tokens)?;
    let prefill_tps = ctx_tokens.len() as f64 / t.elapsed().as_secs_f64();
    let base = cache.len();

    // Decode: feed back the argmax like a greedy generation.
    let mut steps = Vec::with_capacity(args.decode_tokens);
    for _ in 0..args.decode_tokens {
        let next = argmax(&logits);
        let t = Instant::now();
        logits = model.forward_chain_last(&mut cache, &[next])?;
        steps.push(ms(t));
    }
    cache.truncate(base);
    let decode_ms_median = median(&mut steps);

    // Tree forwards: warm-up once, then the median of `repeats`, truncating back each time.
    let mut timings = Vec::new();
    let mut t1 = None;
    for &n in &args.sizes {
        if n == 0 {
            continue;
        }
        let tree = bench_tree(args.tree, n)?;
        let tokens = filler_tokens(tree.len(), vocab, 2 + n as u64);
        let mut xs = Vec::with_capacity(args.repeats);
        for rep in 0..=args.repeats {
            let t = Instant::now();
            model.forward_tree(&mut cache, &tokens, &tree)?;
            let e = ms(t);
            cache.truncate(base);
            if rep > 0 {
                xs.push(e);
            }
        }
        let ms_min = xs.iter().copied().fold(f64::INFINITY, f64::min);
        let ms_median = median(&mut xs);
        if tree.len() == 1 {
            t1 = Some(ms_median);
        }
        let ratio = ms_median / t1.unwrap_or(decode_ms_median);
        let row = TreeTiming {
            n: tree.len(),
            levels: tree.levels(),
            ms_median,
            ms_min,
            ratio,
            roofline_ms: None,
            over_roofline: None,
        };
        if !args.json {
            eprintln!(
                "t({:>3}) = {:>8.2} ms  (min {:>8.2}, {:>2} levels, {:>5.2} x t(1))",
                row.n, row.ms_median, row.ms_min, row.levels, row.ratio
            );
        }
        timings.push(row);
    }
    if args.roofline {
        let isa = kernels::active_isa();
        let peaks = roofline::measure(rayon_threads());
        let weights = model.matmul_weights();
        match (peaks.int8_peak(isa.peak_family()), weights) {
            (Some(peak), Some((bytes, weights))) => {
                let (bytes, weights) = (bytes as f64, weights as f64);
                let threads = rayon_threads() as f64;
                let memory_ms = bytes / (peaks.read_gbps_all_threads * 1e9) * 1e3;
                let per_row_ms = weights / (threads * peak * 1e9) * 1e3;
                for row in &mut timings {
                    let roof = memory_ms.max(row.n as f64 * per_row_ms);
                    row.roofline_ms = Some(roof);
                    row.over_roofline = Some(row.ms_median / roof);
                }
                if !args.json {
                    eprintln!(
                        "roofline: {:.0} MB of weights at {:.1} GB/s ({} threads) = {:.1} ms; {:.2} G multiply-adds per row at {:.0} G MAC/s per core ({}) = {:.1} ms per row",
                        bytes / 1e6,
                        peaks.read_gbps_all_threads,
                        peaks.threads,
                        memory_ms,
                        weights / 1e9,
                        peak,
                        isa.name(),
                        per_row_ms
                    );
                }
            }
            _ => eprintln!(
                "roofline: not available (needs every projection on the CPU quantized kernels and a measured int8 peak for {})",
                isa.name()
            ),
        }
    }
    let report = BenchReport {
        model: info.name.clone(),
        weights: info.weights.clone(),
        device: info.device.clone(),
        batch_invariant: info.batch_invariant,
        random_weights: args.random_weights.clone(),
        threads: rayon_threads(),
        context: base,
        load_ms,
        prefill_tokens_per_second: prefill_tps,
        decode_ms_median,
        decode_tokens_per_second: 1e3 / decode_ms_median,
        tree: match args.tree {
            BenchTree::Sequoia => "sequoia",
            BenchTree::Chain => "chain",
        },
        repack_ms: repack.as_secs_f64() * 1e3,
        t: timings,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "model {}  weights {}  threads {}  context {}",
            report.model, report.weights, report.threads, report.context
        );
        println!(
            "prefill {:.1} tokens/s   decode {:.2} tokens/s ({:.2} ms/token)",
            report.prefill_tokens_per_second, report.decode_tokens_per_second, decode_ms_median
        );
        let roof = args.roofline && report.t.iter().any(|r| r.roofline_ms.is_some());
        print!(
            "{:>5} {:>7} {:>11} {:>11} {:>9}",
            "n", "levels", "median ms", "min ms", "t(n)/t(1)"
        );
        println!(
            "{}",
            if roof {
                "  roofline ms  x roofline"
            } else {
                ""
            }
        );
        for r in &report.t {
            print!(
                "{:>5} {:>7} {:>11.2} {:>11.2} {:>9.2}",
                r.n, r.levels, r.ms_median, r.ms_min, r.ratio
            );
            match (r.roofline_ms, r.over_roofline) {
                (Some(ms), Some(x)) => println!(" {ms:>12.2} {x:>10.2}"),
                _ => println!(),
            }
        }
    }
    Ok(())
}

#[derive(Serialize)]
struct KernelRow {
    format: &'static str,
    isa: &'static str,
    n: usize,
    k: usize,
    m: usize,
    ms: f64,
    gmacs_per_core: f64,
    gbps: f64,
    /// The kernel alone, on activations quantized beforehand (`ms` and `gmacs_per_core` include
    /// the quantization of the call's activations).
    kernel_ms: f64,
    kernel_gmacs_per_core: f64,
    /// G MAC/s over the measured int8 peak of this ISA (None for the scalar reference).
    share_of_int8_peak: Option<f64>,
    /// GB/s over the measured one-thread read bandwidth.
    share_of_bandwidth: f64,
}

#[derive(Serialize)]
struct KernelReport {
    peaks: roofline::Peaks,
    rows: Vec<KernelRow>,
}

/// `--shape NxK`: two positive sizes, K a multiple of 256 (every format's block divides it).
fn parse_kernel_shape(s: &str) -> Result<(usize, usize), String> {
    let parse = |v: &str| v.trim().parse::<usize>().ok().filter(|&x| x > 0);
    let (n, k) = s
        .split_once(['x', 'X'])
        .and_then(|(n, k)| Some((parse(n)?, parse(k)?)))
        .ok_or_else(|| {
            format!("shape '{s}': expected NxK with two positive integers, e.g. 1536x8960")
        })?;
    if k % 256 != 0 {
        return Err(format!(
            "shape '{s}': K = {k} is not a multiple of 256 (the K-quant block)"
        ));
    }
    Ok((n, k))
}

/// `engine-bench --kernels`: per format, ISA path and row count, on one weight shape (`--shape`,
/// by default the gate/up shape of Qwen2.5-1.5B, 8960 × 1536), weights cycled through enough
/// copies to stream from DRAM as in a forward pass.
fn kernel_bench(args: &EngineBenchArgs) -> Result<()> {
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    if !args.json {
        eprintln!("measuring this machine's peaks ({threads} threads for bandwidth) ...");
    }
    let peaks = roofline::measure(threads);
    let (n, k) = args.shape;
    let mut rows = Vec::new();
    for format in kernels::FORMATS {
        for isa in kernels::Isa::ALL.into_iter().filter(|i| i.available()) {
            for m in [1usize, 4, 8, 16, 32] {
                // The scalar reference is slow: one row count shows its level.
                if isa == kernels::Isa::Scalar && m != 8 {
                    continue;
                }
                let t = kernels::bench(isa, format, n, k, m, 8)?;
                rows.push(KernelRow {
                    format,
                    isa: isa.name(),
                    n,
                    k,
                    m,
                    ms: t.ns / 1e6,
                    gmacs_per_core: t.gmacs,
                    gbps: t.gbps,
                    kernel_ms: t.kernel_ns / 1e6,
                    kernel_gmacs_per_core: t.kernel_gmacs,
                    share_of_int8_peak: peaks.int8_peak(isa.peak_family()).map(|p| t.gmacs / p),
                    share_of_bandwidth: t.gbps / peaks.read_gbps_one_thread,
                });
            }
        }
    }
    if args.json {
        let report = KernelReport { peaks, rows };
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "peaks: read {:.1} GB/s (1 thread), {:.1} GB/s ({} threads); int8 per core: {}",
        peaks.read_gbps_one_thread,
        peaks.read_gbps_all_threads,
        peaks.threads,
        peaks
            .int8_gmacs_per_core
            .iter()
            .map(|(i, g)| format!("{i} {g:.0} G MAC/s"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!("kernels, one thread, {n} x {k} weights streamed from memory:");
    println!("(ms, G MAC/s, GB/s: one call, quantizing its activations; kernel alone: on activations quantized once)");
    println!("| format | isa | m | ms | G MAC/s | kernel alone, G MAC/s | % int8 peak | GB/s | % bandwidth |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {:.3} | {:.1} | {:.1} | {} | {:.1} | {:.0}% |",
            r.format,
            r.isa,
            r.m,
            r.ms,
            r.gmacs_per_core,
            r.kernel_gmacs_per_core,
            r.share_of_int8_peak
                .map_or("–".to_string(), |s| format!("{:.0}%", 100.0 * s)),
            r.gbps,
            100.0 * r.share_of_bandwidth
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_kernel_shape;

    #[test]
    fn kernel_shapes_parse_and_bad_ones_say_why() {
        assert_eq!(parse_kernel_shape("1536x8960"), Ok((1536, 8960)));
        assert_eq!(parse_kernel_shape("37X512"), Ok((37, 512)));
        for bad in ["", "1536", "x8960", "0x256", "1536x-256", "axb"] {
            let err = parse_kernel_shape(bad).unwrap_err();
            assert!(err.contains("expected NxK"), "{bad}: {err}");
        }
        let err = parse_kernel_shape("1536x1000").unwrap_err();
        assert!(err.contains("multiple of 256"), "{err}");
    }
}

//! What a run records: its configuration, the calibration, one record per (prompt, method,
//! temperature) in `OUT/results.jsonl`, and resuming from that file.

use super::*;

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
    /// CPU sets (taskset -c lists) and compute threads of the draft and verify sides, where
    /// known (None: not pinned / the service's default).
    #[serde(default)]
    pub draft_cpus: Option<String>,
    #[serde(default)]
    pub verify_cpus: Option<String>,
    #[serde(default)]
    pub draft_threads: Option<usize>,
    #[serde(default)]
    pub verify_threads: Option<usize>,
    /// Link rate between the sides in Mbit/s per direction (0 = unlimited).
    #[serde(default)]
    pub bandwidth_mbps: f64,
}

impl RunConfig {
    /// Settings that change results: a results file is only resumed with the same ones.
    pub(super) fn same_experiment(&self, other: &RunConfig) -> bool {
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
    /// Auto mode: the tokens per step and step time (ms) behind that prediction, so the report
    /// can say which half of it missed.
    #[serde(default)]
    pub predicted_tokens_per_step: f64,
    #[serde(default)]
    pub predicted_step_ms: f64,
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
    /// Whether the request asked for pipelined drafting (`+pipe` methods), and the summary's
    /// pipeline counters.
    #[serde(default)]
    pub pipeline: bool,
    #[serde(default)]
    pub pipeline_hits: u32,
    #[serde(default)]
    pub pipeline_misses: u32,
    #[serde(default)]
    pub pipeline_wasted_ms: f64,
    /// The first tree was grown (whole or in part) during the verify node's prefill.
    #[serde(default)]
    pub first_tree_early: bool,
    /// That first tree went to the verify node with the `open` (whole before its prefill ended).
    #[serde(default)]
    pub first_tree_with_open: bool,
    /// Trees sent ahead of the verdict they assumed, and how many that verdict confirmed.
    #[serde(default)]
    pub trees_sent_ahead: u32,
    #[serde(default)]
    pub trees_taken_ahead: u32,
    /// Prompt-lookup nodes sent in the trees, and how many of them were accepted.
    #[serde(default)]
    pub lookup_proposed: u64,
    #[serde(default)]
    pub lookup_accepted: u64,
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
pub(super) struct ResultsLog {
    pub(super) file: std::fs::File,
    pub(super) records: Vec<Record>,
}

impl ResultsLog {
    pub(super) fn read(path: &Path) -> Result<Vec<Record>> {
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
    pub(super) fn open(path: &Path, config: &RunConfig) -> Result<Self> {
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

    pub(super) fn append(&mut self, r: Record) -> Result<()> {
        let mut line = serde_json::to_string(&r)?;
        line.push('\n');
        self.file.write_all(line.as_bytes())?;
        self.file.flush()?;
        self.records.push(r);
        Ok(())
    }

    pub(super) fn calibration(&self, t: f32) -> Option<&Calibration> {
        self.records.iter().rev().find_map(|r| match r {
            Record::Calibration(c) if temp_key(c.temperature) == temp_key(t) => Some(c),
            _ => None,
        })
    }

    /// (question_id, method, temperature key) of every successful run.
    pub(super) fn done(&self) -> HashSet<(u64, String, String)> {
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

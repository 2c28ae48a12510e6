//! `--two-host` for `sequoia bench` and `sequoia demo`: run the command across the two-host
//! emulation of `deploy/local/two-hosts.sh` (a draft host and a verify host in network
//! namespaces, each pinned to its own CPUs, with added RTT and an optional bandwidth cap).
//!
//! This is a thin wrapper on purpose: the script does the work (namespaces, pinning, services,
//! delay) and runs the same `sequoia` binary inside the draft namespace; here we only find the
//! script, check the preconditions it has (root, `ip`, `taskset`) so the error comes before any
//! model is fetched, and turn the parsed flags into the script's argument list.

use anyhow::{bail, Context, Result};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Where the script lives in the repository.
const SCRIPT: &str = "deploy/local/two-hosts.sh";

/// Flags shared by `bench` and `demo` for the two-host emulation.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct TwoHostArgs {
    /// Run across the two-host emulation (deploy/local/two-hosts.sh: network namespaces, one CPU
    /// set per host, added RTT and bandwidth cap). Needs root, iproute2 and taskset.
    #[arg(long)]
    pub two_host: bool,
    /// The two-host script (default: deploy/local/two-hosts.sh next to the executable's
    /// repository, or under the current directory).
    #[arg(long, requires = "two_host")]
    pub two_host_script: Option<PathBuf>,
    /// CPUs of the draft host, as taskset -c takes them ("0", "0-1", "0,2"). With --two-host
    /// the draft side is pinned to them (default 0); otherwise only recorded in the report.
    #[arg(long)]
    pub draft_cpus: Option<String>,
    /// CPUs of the verify host, as for --draft-cpus (default with --two-host: 1).
    #[arg(long)]
    pub verify_cpus: Option<String>,
    /// Link rate between the hosts in Mbit/s per direction (0 = unlimited), on top of the RTT.
    #[arg(long, default_value_t = 0.0)]
    pub bandwidth_mbps: f64,
}

impl TwoHostArgs {
    /// Check the values that do not depend on the mode.
    pub fn validate(&self) -> Result<()> {
        if !(self.bandwidth_mbps.is_finite() && self.bandwidth_mbps >= 0.0) {
            bail!("--bandwidth-mbps must be a non-negative number (0 = unlimited)");
        }
        for (flag, v) in [
            ("--draft-cpus", &self.draft_cpus),
            ("--verify-cpus", &self.verify_cpus),
        ] {
            if let Some(v) = v {
                cpu_count(v).with_context(|| format!("{flag} {v:?}"))?;
            }
        }
        Ok(())
    }
}

/// Number of CPUs in a taskset-style list ("0", "0-3", "0,2-3"); an error for anything else.
pub fn cpu_count(list: &str) -> Result<usize> {
    let mut n = 0;
    for part in list.split(',') {
        let num = |s: &str| -> Result<usize> {
            s.trim()
                .parse::<usize>()
                .map_err(|_| anyhow::anyhow!("expected CPU numbers like 0, 0-1 or 0,2, got {s:?}"))
        };
        n += match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if b < a {
                    bail!("CPU range {part:?} runs backwards");
                }
                b - a + 1
            }
            None => {
                num(part)?;
                1
            }
        };
    }
    Ok(n)
}

/// The setup both commands hand to the script.
#[derive(Debug, Clone, PartialEq)]
pub struct Setup {
    /// "bench" or "demo": what the script runs in the draft namespace.
    pub mode: &'static str,
    pub rtt_ms: f64,
    pub draft: String,
    pub target: String,
    pub draft_threads: Option<usize>,
    pub verify_threads: Option<usize>,
    pub auto_max_nodes: Option<usize>,
    pub out_dir: Option<PathBuf>,
    /// Directory of the `sequoia`, `draft-service` and `verify-service` binaries.
    pub bin: PathBuf,
}

/// The script's argument list: its own flags, then `--` and the command's flags.
pub fn script_args(two: &TwoHostArgs, setup: &Setup, command_args: &[String]) -> Vec<String> {
    let mut a: Vec<String> = vec![
        "--mode".into(),
        setup.mode.into(),
        "--rtt".into(),
        setup.rtt_ms.to_string(),
        "--bandwidth-mbps".into(),
        two.bandwidth_mbps.to_string(),
        "--draft".into(),
        setup.draft.clone(),
        "--target".into(),
        setup.target.clone(),
        "--bin".into(),
        setup.bin.display().to_string(),
    ];
    let mut opt = |flag: &str, v: Option<String>| {
        if let Some(v) = v {
            a.push(flag.into());
            a.push(v);
        }
    };
    opt("--draft-cpus", two.draft_cpus.clone());
    opt("--verify-cpus", two.verify_cpus.clone());
    opt(
        "--draft-threads",
        setup.draft_threads.map(|t| t.to_string()),
    );
    opt(
        "--verify-threads",
        setup.verify_threads.map(|t| t.to_string()),
    );
    opt(
        "--auto-max-nodes",
        setup.auto_max_nodes.map(|t| t.to_string()),
    );
    opt(
        "--out",
        setup.out_dir.as_ref().map(|p| p.display().to_string()),
    );
    a.push("--".into());
    a.extend(command_args.iter().cloned());
    a
}

/// Absolute form of `p` (relative to the current directory): the script runs from the
/// repository root, not from where the command was started.
pub fn absolute(p: &Path) -> Result<PathBuf> {
    Ok(if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()?.join(p)
    })
}

/// Find the script: `--two-host-script`, else relative to the executable (target/release/ in a
/// checkout), the current directory, or the source tree this binary was built from.
pub fn find_script(given: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = given {
        if !p.is_file() {
            bail!("--two-host-script {}: no such file", p.display());
        }
        return absolute(p);
    }
    let mut tried = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        for up in exe.ancestors().skip(1).take(4) {
            tried.push(up.join(SCRIPT));
        }
    }
    if let Ok(cwd) = std::env::current_dir() {
        tried.push(cwd.join(SCRIPT));
    }
    tried.push(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(SCRIPT),
    );
    match tried.iter().find(|p| p.is_file()) {
        Some(p) => Ok(p.clone()),
        None => bail!(
            "cannot find {SCRIPT} (looked in {}); pass --two-host-script PATH",
            tried
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// The effective user id, from /proc (Linux; None elsewhere).
fn effective_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

/// Whether `name` is an executable on PATH (or in the sbin directories, where `ip` lives).
fn on_path(name: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_else(|| OsString::from(""));
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .any(|d| d.join(name).is_file())
}

/// Fail early, with what to do, when the script could not run here.
pub fn check_preconditions() -> Result<()> {
    if !cfg!(target_os = "linux") {
        bail!("--two-host needs Linux (network namespaces)");
    }
    if effective_uid() != Some(0) {
        bail!(
            "--two-host must run as root (it creates network namespaces and a veth pair); \
             try: sudo -E {}",
            std::env::args().collect::<Vec<_>>().join(" ")
        );
    }
    if !on_path("ip") {
        bail!(
            "--two-host needs `ip` (iproute2), which is not on PATH; e.g. apt-get install iproute2"
        );
    }
    if !on_path("taskset") {
        bail!("--two-host needs `taskset` (util-linux), which is not on PATH");
    }
    Ok(())
}

/// Directory of the running executable (where the script finds the service binaries too).
pub fn bin_dir() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot locate the sequoia executable")?;
    Ok(exe
        .parent()
        .context("the sequoia executable has no directory")?
        .to_path_buf())
}

/// Check, then run the script with `args`, passing its exit status on.
pub fn run_script(two: &TwoHostArgs, setup: &Setup, command_args: &[String]) -> Result<()> {
    two.validate()?;
    let script = find_script(two.two_host_script.as_deref())?;
    check_preconditions()?;
    let args = script_args(two, setup, command_args);
    eprintln!("== {} {}", script.display(), args.join(" "));
    let status = Command::new("bash")
        .arg(&script)
        .args(&args)
        .status()
        .with_context(|| format!("cannot run {}", script.display()))?;
    if !status.success() {
        bail!(
            "{} failed ({status}); see its messages above",
            script.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_are_counted_and_checked() {
        assert_eq!(cpu_count("0").unwrap(), 1);
        assert_eq!(cpu_count("0-1").unwrap(), 2);
        assert_eq!(cpu_count("0,2-4").unwrap(), 4);
        for bad in ["", "a", "1-", "3-1", "0;1"] {
            assert!(cpu_count(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn script_arguments_carry_the_setup() {
        let two = TwoHostArgs {
            two_host: true,
            draft_cpus: Some("0-1".into()),
            verify_cpus: Some("2".into()),
            bandwidth_mbps: 100.0,
            ..TwoHostArgs::default()
        };
        let setup = Setup {
            mode: "bench",
            rtt_ms: 10.0,
            draft: "d".into(),
            target: "t".into(),
            draft_threads: Some(2),
            verify_threads: None,
            auto_max_nodes: Some(16),
            out_dir: Some("/tmp/o".into()),
            bin: "/b".into(),
        };
        let a = script_args(&two, &setup, &["--methods".into(), "auto+pipe".into()]);
        let s = a.join(" ");
        assert_eq!(
            s,
            "--mode bench --rtt 10 --bandwidth-mbps 100 --draft d --target t --bin /b \
             --draft-cpus 0-1 --verify-cpus 2 --draft-threads 2 --auto-max-nodes 16 \
             --out /tmp/o -- --methods auto+pipe"
        );
        assert!(two.validate().is_ok());
        let bad = TwoHostArgs {
            bandwidth_mbps: -1.0,
            ..two.clone()
        };
        assert!(bad.validate().is_err());
        let bad = TwoHostArgs {
            draft_cpus: Some("x".into()),
            ..two
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn the_script_is_found_in_the_checkout() {
        let p = find_script(None).unwrap();
        assert!(p.ends_with(SCRIPT), "{}", p.display());
        assert!(find_script(Some(Path::new("/no/such/script.sh"))).is_err());
    }
}

/// The whole path for real: `sequoia bench --two-host` on tiny random-weight models, through
/// namespaces, pinning, the delay proxy with a bandwidth cap, and the report. Needs root,
/// iproute2, taskset and the service binaries (cargo build --release --workspace), so it is
/// ignored by default: `sudo cargo test --release -p sequoia-cli two_host -- --ignored`.
#[cfg(test)]
mod emulation {
    use super::*;

    #[test]
    #[ignore = "needs root, iproute2, taskset and the built service binaries"]
    fn bench_runs_across_the_two_host_emulation() {
        use sequoia_tests::TinyPair;
        check_preconditions().unwrap();
        let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release");
        for b in ["sequoia", "draft-service", "verify-service"] {
            assert!(bin.join(b).exists(), "build {b} first");
        }
        let pair = TinyPair::new();
        let dir = tempfile::tempdir().unwrap();
        let prompts = dir.path().join("q.jsonl");
        std::fs::write(
            &prompts,
            "{\"question_id\": 1, \"category\": \"a\", \"turns\": [\"hello world\"]}\n\
             {\"question_id\": 2, \"category\": \"b\", \"turns\": [\"fn main() {}\"]}\n",
        )
        .unwrap();
        let out = dir.path().join("out");
        let two = TwoHostArgs {
            two_host: true,
            draft_cpus: Some("0".into()),
            verify_cpus: Some("1".into()),
            bandwidth_mbps: 50.0,
            ..TwoHostArgs::default()
        };
        let setup = Setup {
            mode: "bench",
            rtt_ms: 4.0,
            draft: pair.draft.display().to_string(),
            target: pair.target.display().to_string(),
            draft_threads: Some(1),
            verify_threads: Some(1),
            auto_max_nodes: Some(8),
            out_dir: Some(out.clone()),
            bin: bin.clone(),
        };
        let bench: Vec<String> = [
            "--raw",
            "--prompts",
            prompts.to_str().unwrap(),
            "--max-prompts-per-category",
            "1",
            "--calibration-prompts",
            "0",
            "--max-tokens",
            "8",
            "--temperatures",
            "0",
            "--methods",
            "target,chain:2,auto,auto+pipe",
            "--no-charts",
        ]
        .map(String::from)
        .to_vec();
        run_script(&two, &setup, &bench).unwrap();
        let rep: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
        let cells = rep["cells"].as_array().unwrap();
        assert!(!cells.is_empty());
        for c in cells {
            assert_eq!(c["draft_cpus"], "0", "{c}");
            assert_eq!(c["verify_cpus"], "1", "{c}");
            assert_eq!(c["rtt_ms"], 4.0, "{c}");
            assert_eq!(c["bandwidth_mbps"], 50.0, "{c}");
        }
        assert!(cells
            .iter()
            .any(|c| c["method"] == "auto+pipe" && c["pipeline_hits"].is_u64()));

        // The demo across the same emulation, pipelined, against root-only trees on the
        // verify host.
        let demo = Setup {
            mode: "demo",
            out_dir: Some(dir.path().join("demo")),
            ..setup
        };
        let args: Vec<String> = [
            "--raw",
            "--prompt",
            "hello world",
            "--max-tokens",
            "8",
            "--pipeline",
        ]
        .map(String::from)
        .to_vec();
        run_script(&two, &demo, &args).unwrap();
    }
}

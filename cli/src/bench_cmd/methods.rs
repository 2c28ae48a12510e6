//! The methods a benchmark compares (`target`, `chain:L`, `kxd:KxD`, `kxd-best:B`,
//! `sequoia:B`, `auto`, and any of them with `+pipe`) and the tree each one drafts.

use super::*;

/// A speculation method: which tree each step drafts.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Method {
    /// Root-only trees: plain target decoding through the service pair.
    Target,
    /// A chain of `len` drafted tokens.
    Chain(usize),
    /// `k` independent chains of `d` drafted tokens.
    KxD { k: usize, d: usize },
    /// The best K×D with at most this many drafted tokens.
    KxDBest(usize),
    /// The Sequoia-optimal tree with this many drafted tokens.
    Sequoia(usize),
    /// The draft-service's own planner.
    Auto,
    /// The inner method with pipelined drafting (`GenerateRequest.pipeline = true`): the same
    /// trees, with the next one grown while the current one is verified.
    Pipelined(Box<Method>),
}

/// Suffix of the pipelined variant of a method.
pub const PIPE_SUFFIX: &str = "+pipe";

/// Forced trees are limited to this many drafted tokens (the draft-service accepts 512 nodes).
pub(super) const MAX_BUDGET: usize = 511;

impl FromStr for Method {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if let Some(inner) = s.strip_suffix(PIPE_SUFFIX) {
            return match inner.parse::<Method>()? {
                Method::Pipelined(_) => Err(format!("{s:?}: {PIPE_SUFFIX} given twice")),
                m => Ok(Method::Pipelined(Box::new(m))),
            };
        }
        let budget = |v: &str| -> Result<usize, String> {
            let n: usize = v
                .parse()
                .map_err(|_| format!("{s:?}: {v:?} is not a number"))?;
            if n == 0 || n > MAX_BUDGET {
                return Err(format!("{s:?}: budget must be 1..={MAX_BUDGET}"));
            }
            Ok(n)
        };
        let (name, arg) = s.split_once(':').unwrap_or((s, ""));
        match (name, arg) {
            ("target", "") => Ok(Method::Target),
            ("auto", "") => Ok(Method::Auto),
            ("chain", v) => Ok(Method::Chain(budget(v)?)),
            ("sequoia", v) => Ok(Method::Sequoia(budget(v)?)),
            ("kxd-best", v) => Ok(Method::KxDBest(budget(v)?)),
            ("kxd", v) => {
                let (k, d) = v
                    .split_once(['x', 'X'])
                    .ok_or_else(|| format!("{s:?}: expected kxd:KxD, e.g. kxd:2x3"))?;
                let (k, d) = (budget(k)?, budget(d)?);
                if k * d > MAX_BUDGET {
                    return Err(format!("{s:?}: K·D must be at most {MAX_BUDGET}"));
                }
                Ok(Method::KxD { k, d })
            }
            _ => Err(format!(
                "unknown method {s:?} (target, chain:L, kxd:KxD, kxd-best:B, sequoia:B, auto, \
                 each optionally with {PIPE_SUFFIX})"
            )),
        }
    }
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Method::Target => write!(f, "target"),
            Method::Chain(l) => write!(f, "chain:{l}"),
            Method::KxD { k, d } => write!(f, "kxd:{k}x{d}"),
            Method::KxDBest(b) => write!(f, "kxd-best:{b}"),
            Method::Sequoia(b) => write!(f, "sequoia:{b}"),
            Method::Auto => write!(f, "auto"),
            Method::Pipelined(m) => write!(f, "{m}{PIPE_SUFFIX}"),
        }
    }
}

impl Method {
    /// The method without `+pipe`.
    pub fn base(&self) -> &Method {
        match self {
            Method::Pipelined(m) => m,
            m => m,
        }
    }

    /// Whether requests of this method ask for pipelined drafting.
    pub fn is_pipelined(&self) -> bool {
        matches!(self, Method::Pipelined(_))
    }

    /// Whether this is the target-only baseline (root-only trees, measured on the baseline's
    /// draft-service); `target+pipe` runs the same trees but next to the other methods.
    pub fn is_baseline(&self) -> bool {
        *self == Method::Target
    }

    /// Chart series this method belongs to.
    pub fn family(&self) -> &'static str {
        match self {
            Method::Pipelined(m) => m.family(),
            Method::Target => "target",
            Method::Chain(_) => "chain",
            Method::KxD { .. } | Method::KxDBest(_) => "kxd",
            Method::Sequoia(_) => "sequoia",
            Method::Auto => "auto",
        }
    }

    /// The tree to force, planned with acceptance vector `p`; None for `auto`.
    pub fn tree(&self, p: &[f64], max_levels: usize) -> Result<Option<Tree>> {
        Ok(Some(match *self {
            Method::Pipelined(ref m) => return m.tree(p, max_levels),
            Method::Auto => return Ok(None),
            Method::Target => Tree::chain(1),
            Method::Chain(l) => Tree::chain(l + 1),
            Method::KxD { k, d } => Tree::k_by_d(k, d),
            Method::KxDBest(b) => {
                let (k, d) = best_k_by_d_shape(p, b, max_levels);
                Tree::k_by_d(k, d)
            }
            Method::Sequoia(b) => {
                let levels = max_levels.max(1);
                SequoiaDp::solve(p, b + 1, levels)?.tree(b + 1, levels)
            }
        }))
    }
}

/// K and D of the best K×D tree with K·D ≤ `budget` drafted tokens and D + 1 ≤ `max_levels`.
pub(super) fn best_k_by_d_shape(p: &[f64], budget: usize, max_levels: usize) -> (usize, usize) {
    let mut best = (1, 1, f64::NEG_INFINITY);
    for d in 1..max_levels.max(2) {
        for k in 1..=budget / d {
            let g = k_by_d_expected(p, k, d);
            if g > best.2 + 1e-12 {
                best = (k, d, g);
            }
        }
    }
    (best.0, best.1)
}

/// Parse and de-duplicate the method list.
pub fn parse_methods(specs: &[String]) -> Result<Vec<Method>> {
    let mut out: Vec<Method> = Vec::new();
    for s in specs.iter().filter(|s| !s.trim().is_empty()) {
        let m: Method = s.parse().map_err(anyhow::Error::msg)?;
        if !out.contains(&m) {
            out.push(m);
        }
    }
    if out.is_empty() {
        bail!("--methods is empty");
    }
    Ok(out)
}

/// Key of a temperature in records and reports ("0", "0.7").
pub fn temp_key(t: f32) -> String {
    format!("{t}")
}

//! The prompt set: Spec-Bench JSONL loading and the per-category selection.

use super::*;

/// A prompt from the file.
#[derive(Debug, Clone)]
pub struct Prompt {
    pub id: u64,
    pub category: String,
    pub text: String,
}

/// Every prompt of a Spec-Bench style JSONL file, in file order.
pub fn load_prompts(path: &Path) -> Result<Vec<Prompt>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))?;
        let text = v
            .get("turns")
            .and_then(|t| t.get(0))
            .and_then(|t| t.as_str())
            .with_context(|| {
                format!("{}:{}: no \"turns\" list of strings", path.display(), i + 1)
            })?;
        out.push(Prompt {
            id: v
                .get("question_id")
                .and_then(|q| q.as_u64())
                .unwrap_or(i as u64 + 1),
            category: v
                .get("category")
                .and_then(|c| c.as_str())
                .unwrap_or("all")
                .to_string(),
            text: text.to_string(),
        });
    }
    if out.is_empty() {
        bail!("{} has no prompts", path.display());
    }
    Ok(out)
}

/// The measured prompts (the first `per_category` of each category, interleaved across
/// categories so a partial run covers all of them) and up to `heldout` other prompts for
/// calibration (the last ones of the categories, spread over them; the measured ones when none
/// are left).
pub fn select_prompts(
    all: &[Prompt],
    categories: &[String],
    per_category: usize,
    heldout: usize,
) -> Result<(Vec<Prompt>, Vec<Prompt>)> {
    let mut order: Vec<String> = Vec::new();
    let mut by_cat: BTreeMap<String, Vec<&Prompt>> = BTreeMap::new();
    for p in all {
        if !categories.is_empty() && !categories.contains(&p.category) {
            continue;
        }
        if !by_cat.contains_key(&p.category) {
            order.push(p.category.clone());
        }
        by_cat.entry(p.category.clone()).or_default().push(p);
    }
    for c in categories {
        if !by_cat.contains_key(c) {
            bail!("no prompts of category {c:?} in the prompt file");
        }
    }
    // Interleave across categories: the i-th prompt of every category, for i = 0, 1, ...
    let mut measured: Vec<Prompt> = Vec::new();
    for i in 0..per_category {
        for c in &order {
            if let Some(p) = by_cat[c].get(i) {
                measured.push((*p).clone());
            }
        }
    }
    if measured.is_empty() {
        bail!("no prompts selected (is --max-prompts-per-category 0?)");
    }
    // Calibration prompts come from the end of each category, so that a later run with more
    // prompts per category (resuming into the same results) does not measure them.
    let longest = by_cat.values().map(Vec::len).max().unwrap_or(0);
    let mut cal: Vec<Prompt> = Vec::new();
    for i in 0..longest {
        for c in &order {
            let v = &by_cat[c];
            if v.len() > per_category + i {
                cal.push(v[v.len() - 1 - i].clone());
            }
        }
    }
    if cal.is_empty() {
        cal = measured.clone();
    }
    // Spread the calibration prompts over the categories (the list is interleaved by category).
    let stride = (order.len().min(cal.len()) / heldout.max(1)).max(1);
    let cal = cal.into_iter().step_by(stride).take(heldout).collect();
    Ok((measured, cal))
}

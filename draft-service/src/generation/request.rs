//! Turning a `GenerateRequest` into a checked [`Prepared`] request: every field validated
//! (INVALID_ARGUMENT naming the field), the prompt rendered through the chat template when asked
//! and tokenized, the token budget checked against the context limit.

use crate::state::DraftState;
use sequoia_core::limits;
use sequoia_core::sampling::SamplingParams;
use sequoia_core::tree::Tree;
use sequoia_engine::tokenizer::ChatMessage;
use sequoia_proto::v1::GenerateRequest;
use sequoia_server::wire;
use tonic::Status;

/// A request checked and turned into tokens and settings.
pub struct Prepared {
    pub prompt_tokens: Vec<u32>,
    /// A tree shape forced by the request (benchmarks), instead of the plan.
    pub forced_tree: Option<Tree>,
    pub params: SamplingParams,
    pub max_tokens: usize,
    pub seed: u64,
    pub stop: Vec<String>,
    /// Pipelined drafting as the request asks; None: the configured default, decided against
    /// the verify node the generation gets (`PipelineConfig::on_shared_cpus`).
    pub pipeline: Option<bool>,
}

/// Validate a request (INVALID_ARGUMENT naming the field) and tokenize its prompt.
pub fn prepare(state: &DraftState, req: &GenerateRequest) -> Result<Prepared, Status> {
    let invalid = |m: String| Status::invalid_argument(m);
    if req.prompt.is_empty() == req.messages.is_empty() {
        return Err(invalid(
            "give exactly one of `prompt` (text) or `messages` (chat)".into(),
        ));
    }
    // Sizes first: everything below (templating, tokenization) costs CPU in proportion.
    let prompt_bytes = req.prompt.len()
        + req
            .messages
            .iter()
            .map(|m| m.content.len() + m.role.len())
            .sum::<usize>();
    if prompt_bytes > limits::MAX_PROMPT_BYTES {
        return Err(invalid(format!(
            "prompt: {prompt_bytes} bytes exceed the limit of {} (prompt and messages together)",
            limits::MAX_PROMPT_BYTES
        )));
    }
    if req.messages.len() > limits::MAX_CHAT_MESSAGES {
        return Err(invalid(format!(
            "messages: {} messages exceed the limit of {}",
            req.messages.len(),
            limits::MAX_CHAT_MESSAGES
        )));
    }
    if !req.temperature.is_finite() || req.temperature < 0.0 {
        return Err(invalid(format!(
            "temperature must be finite and ≥ 0, got {}",
            req.temperature
        )));
    }
    if !req.top_p.is_finite() || !(0.0..=1.0).contains(&req.top_p) {
        return Err(invalid(format!(
            "top_p must be in [0, 1] (0 = off), got {}",
            req.top_p
        )));
    }
    if req.stop.iter().any(|s| s.is_empty()) {
        return Err(invalid("stop strings must not be empty".into()));
    }
    if req.stop.len() > limits::MAX_STOP_STRINGS {
        return Err(invalid(format!(
            "stop: {} strings exceed the limit of {}",
            req.stop.len(),
            limits::MAX_STOP_STRINGS
        )));
    }
    if let Some((i, s)) = req
        .stop
        .iter()
        .enumerate()
        .find(|(_, s)| s.len() > limits::MAX_STOP_BYTES)
    {
        return Err(invalid(format!(
            "stop[{i}]: {} bytes exceed the limit of {}",
            s.len(),
            limits::MAX_STOP_BYTES
        )));
    }
    let tok = &state.tokenizer;
    let text = if !req.messages.is_empty() || req.apply_chat_template {
        let messages: Vec<ChatMessage> = if req.messages.is_empty() {
            vec![ChatMessage {
                role: "user".into(),
                content: req.prompt.clone(),
            }]
        } else {
            for (i, m) in req.messages.iter().enumerate() {
                if !matches!(m.role.as_str(), "system" | "user" | "assistant") {
                    return Err(invalid(format!(
                        "messages[{i}].role must be system, user or assistant, got {:?}",
                        m.role
                    )));
                }
            }
            req.messages
                .iter()
                .map(|m| ChatMessage {
                    role: m.role.clone(),
                    content: m.content.clone(),
                })
                .collect()
        };
        tok.apply_chat_template(&messages, true).map_err(|e| {
            Status::failed_precondition(format!("cannot render the chat template: {e}"))
        })?
    } else {
        req.prompt.clone()
    };
    // A rendered chat template already carries its own special tokens (BOS included).
    let templated = !req.messages.is_empty() || req.apply_chat_template;
    let prompt_tokens = tok
        .encode(&text, !templated)
        .map_err(|e| invalid(format!("prompt cannot be tokenized: {e}")))?;
    if prompt_tokens.is_empty() {
        return Err(invalid("prompt tokenizes to nothing".into()));
    }
    let max_tokens = if req.max_tokens == 0 {
        state.config.default_max_tokens
    } else {
        req.max_tokens
    } as usize;
    let limit = state.context_limit();
    if prompt_tokens.len() + max_tokens > limit {
        return Err(Status::resource_exhausted(format!(
            "prompt ({} tokens) + max_tokens ({max_tokens}) exceeds the context limit of {limit} tokens",
            prompt_tokens.len()
        )));
    }
    let forced_tree = if req.tree_parents.is_empty() {
        None
    } else {
        Some(
            Tree::from_parents_limited(&req.tree_parents, limits::TREE)
                .map_err(|e| invalid(format!("tree_parents: {e}")))?,
        )
    };
    Ok(Prepared {
        prompt_tokens,
        forced_tree,
        pipeline: req.pipeline,
        params: wire::sampling_params(req.temperature, req.top_p, req.top_k),
        max_tokens,
        seed: req.seed.unwrap_or_else(rand_seed),
        stop: req.stop.clone(),
    })
}

fn rand_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    h.finish()
}

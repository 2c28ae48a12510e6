//! OpenAI request bodies → the `GenerateRequest` gRPC clients send (so both front ends go
//! through the same `generation::prepare`), and the response objects built from the shared
//! generation's chunks and summary.
//!
//! Bodies are read as JSON values and checked field by field rather than deserialized into
//! structs: every refusal can then name its field (`param`), unknown fields are ignored as
//! OpenAI's own server does, and fields this server cannot honour (`n` > 1, `logprobs`,
//! `tools`, ...) are refused instead of silently dropped.

use super::errors::ApiError;
use sequoia_proto::v1::{ChatMessage, GenerateRequest, GenerateSummary};
use serde_json::{json, Map, Value};

/// Which endpoint a request came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

impl Endpoint {
    /// The field holding the prompt, for errors about it.
    pub fn prompt_param(self) -> &'static str {
        match self {
            Endpoint::Chat => "messages",
            Endpoint::Completions => "prompt",
        }
    }
}

/// A checked request: what to generate, and how to answer.
#[derive(Debug)]
pub struct Parsed {
    pub request: GenerateRequest,
    pub model: String,
    pub stream: bool,
    pub include_usage: bool,
}

type Obj = Map<String, Value>;

/// A field's value; `null` counts as absent (clients send either).
fn field<'a>(o: &'a Obj, key: &str) -> Option<&'a Value> {
    o.get(key).filter(|v| !v.is_null())
}

fn opt_bool(o: &Obj, key: &str) -> Result<Option<bool>, ApiError> {
    field(o, key)
        .map(|v| {
            v.as_bool()
                .ok_or_else(|| ApiError::invalid(key, format!("{key} must be true or false")))
        })
        .transpose()
}

fn opt_f32(o: &Obj, key: &str, lo: f64, hi: f64) -> Result<Option<f32>, ApiError> {
    let Some(v) = field(o, key) else {
        return Ok(None);
    };
    match v.as_f64() {
        Some(x) if (lo..=hi).contains(&x) => Ok(Some(x as f32)),
        Some(x) => Err(ApiError::invalid(
            key,
            format!("{key} must be between {lo} and {hi}, got {x}"),
        )),
        None => Err(ApiError::invalid(key, format!("{key} must be a number"))),
    }
}

fn opt_u32(o: &Obj, key: &str, min: u64) -> Result<Option<u32>, ApiError> {
    let Some(v) = field(o, key) else {
        return Ok(None);
    };
    match v.as_u64() {
        Some(x) if x >= min && x <= u32::MAX as u64 => Ok(Some(x as u32)),
        _ => Err(ApiError::invalid(
            key,
            format!("{key} must be an integer ≥ {min}, got {v}"),
        )),
    }
}

/// Refuse a field unless it has its "off" value (`off` says which values count as off).
fn refuse_unless(
    o: &Obj,
    key: &str,
    off: impl Fn(&Value) -> bool,
    why: &str,
) -> Result<(), ApiError> {
    match field(o, key) {
        Some(v) if !off(v) => Err(ApiError::unsupported(key, format!("{key}: {why}"))),
        _ => Ok(()),
    }
}

fn is_false(v: &Value) -> bool {
    v == &Value::Bool(false)
}
fn is_zero(v: &Value) -> bool {
    v.as_f64() == Some(0.0)
}
fn is_one(v: &Value) -> bool {
    v.as_u64() == Some(1)
}
fn is_empty(v: &Value) -> bool {
    v.as_array().is_some_and(|a| a.is_empty())
        || v.as_object().is_some_and(|o| o.is_empty())
        || v.as_str() == Some("")
}

/// Fields both endpoints share: model, sampling, stop, budget, streaming.
fn common(o: &Obj, request: &mut GenerateRequest) -> Result<(String, bool, bool), ApiError> {
    let model = match field(o, "model") {
        Some(Value::String(m)) if !m.is_empty() => m.clone(),
        Some(_) => {
            return Err(ApiError::invalid(
                "model",
                "model must be a non-empty string",
            ))
        }
        None => {
            return Err(ApiError::invalid(
                "model",
                "model is required (GET /v1/models lists the one served here)",
            ))
        }
    };
    refuse_unless(o, "n", is_one, "only n = 1 is supported")?;
    refuse_unless(o, "logit_bias", is_empty, "not supported")?;
    refuse_unless(
        o,
        "presence_penalty",
        is_zero,
        "not supported (it would change the target's distribution)",
    )?;
    refuse_unless(
        o,
        "frequency_penalty",
        is_zero,
        "not supported (it would change the target's distribution)",
    )?;
    request.temperature = opt_f32(o, "temperature", 0.0, 2.0)?.unwrap_or(1.0);
    // OpenAI's default is top_p = 1, which the engine reads as "off" as well.
    request.top_p = opt_f32(o, "top_p", 0.0, 1.0)?.unwrap_or(1.0);
    request.top_k = opt_u32(o, "top_k", 0)?.unwrap_or(0);
    request.seed = match field(o, "seed") {
        None => None,
        // OpenAI seeds are signed 64-bit; any integer names one seed.
        Some(v) => Some(
            v.as_u64()
                .or_else(|| v.as_i64().map(|x| x as u64))
                .ok_or_else(|| ApiError::invalid("seed", "seed must be an integer"))?,
        ),
    };
    request.stop = match field(o, "stop") {
        None => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| {
                s.as_str().map(str::to_string).ok_or_else(|| {
                    ApiError::invalid("stop", "stop must be a string or an array of strings")
                })
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::invalid(
                "stop",
                "stop must be a string or an array of strings",
            ))
        }
    };
    // max_completion_tokens is the newer name; when both are given it wins.
    let max_tokens = opt_u32(o, "max_tokens", 1)?;
    let max_completion = opt_u32(o, "max_completion_tokens", 1)?;
    request.max_tokens = max_completion.or(max_tokens).unwrap_or(0);
    let stream = opt_bool(o, "stream")?.unwrap_or(false);
    let include_usage = match field(o, "stream_options") {
        None => false,
        Some(Value::Object(so)) => {
            if !stream {
                return Err(ApiError::invalid(
                    "stream_options",
                    "stream_options is only allowed with stream = true",
                ));
            }
            opt_bool(so, "include_usage")
                .map_err(|_| {
                    ApiError::invalid(
                        "stream_options.include_usage",
                        "stream_options.include_usage must be true or false",
                    )
                })?
                .unwrap_or(false)
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "stream_options",
                "stream_options must be an object",
            ))
        }
    };
    Ok((model, stream, include_usage))
}

fn object(body: &[u8]) -> Result<Obj, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(ApiError::bad_body("the request body must be a JSON object")),
        Err(e) => Err(ApiError::bad_body(format!(
            "the request body is not valid JSON: {e}"
        ))),
    }
}

/// `POST /v1/chat/completions`.
pub fn parse_chat(body: &[u8]) -> Result<Parsed, ApiError> {
    let o = object(body)?;
    let mut request = GenerateRequest::default();
    refuse_unless(
        &o,
        "logprobs",
        is_false,
        "log probabilities are not supported",
    )?;
    refuse_unless(
        &o,
        "top_logprobs",
        |v| is_zero(v),
        "log probabilities are not supported",
    )?;
    refuse_unless(&o, "tools", is_empty, "tool calls are not supported")?;
    refuse_unless(
        &o,
        "tool_choice",
        |v| v.as_str() == Some("none"),
        "tool calls are not supported",
    )?;
    refuse_unless(
        &o,
        "functions",
        is_empty,
        "function calls are not supported",
    )?;
    refuse_unless(
        &o,
        "function_call",
        |v| v.as_str() == Some("none"),
        "function calls are not supported",
    )?;
    refuse_unless(&o, "audio", |_| false, "audio output is not supported")?;
    refuse_unless(
        &o,
        "response_format",
        |v| v.get("type").and_then(Value::as_str) == Some("text"),
        "only {\"type\": \"text\"} is supported",
    )?;
    let messages = match field(&o, "messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid("messages", "messages must not be empty"))
        }
        Some(_) => return Err(ApiError::invalid("messages", "messages must be an array")),
        None => return Err(ApiError::invalid("messages", "messages is required")),
    };
    for (i, m) in messages.iter().enumerate() {
        request.messages.push(message(i, m)?);
    }
    let (model, stream, include_usage) = common(&o, &mut request)?;
    Ok(Parsed {
        request,
        model,
        stream,
        include_usage,
    })
}

fn message(i: usize, m: &Value) -> Result<ChatMessage, ApiError> {
    let at = |f: &str| format!("messages[{i}]{f}");
    let m = m
        .as_object()
        .ok_or_else(|| ApiError::invalid(at(""), format!("{} must be an object", at(""))))?;
    let role = match field(m, "role").and_then(Value::as_str) {
        Some("system" | "developer") => "system",
        Some("user") => "user",
        Some("assistant") => "assistant",
        Some(r) => {
            return Err(ApiError::invalid(
                at(".role"),
                format!(
                    "{}: role {r:?} is not supported; use system, user or assistant",
                    at(".role")
                ),
            ))
        }
        None => {
            return Err(ApiError::invalid(
                at(".role"),
                format!("{} is required", at(".role")),
            ))
        }
    };
    if field(m, "tool_calls").is_some_and(|v| !is_empty(v)) {
        return Err(ApiError::unsupported(
            &at(".tool_calls"),
            "tool calls are not supported",
        ));
    }
    let content = match field(m, "content") {
        Some(Value::String(s)) => s.clone(),
        // An assistant turn may come without content.
        None if role == "assistant" => String::new(),
        None => {
            return Err(ApiError::invalid(
                at(".content"),
                format!("{} is required", at(".content")),
            ))
        }
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                let part = format!("{}[{j}]", at(".content"));
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => texts.push(t),
                    (Some("text"), None) => {
                        return Err(ApiError::invalid(
                            format!("{part}.text"),
                            format!("{part}.text must be a string"),
                        ))
                    }
                    (other, _) => {
                        return Err(ApiError::unsupported(
                            &format!("{part}.type"),
                            format!(
                                "content part type {other:?} is not supported; only text parts are"
                            ),
                        ))
                    }
                }
            }
            // Parts are separate blocks of text; a newline keeps their words apart.
            texts.join("\n")
        }
        Some(_) => {
            return Err(ApiError::invalid(
                at(".content"),
                format!(
                    "{} must be a string or an array of text parts",
                    at(".content")
                ),
            ))
        }
    };
    Ok(ChatMessage {
        role: role.into(),
        content,
    })
}

/// `POST /v1/completions`: the prompt goes to the model raw, without a chat template.
pub fn parse_completion(body: &[u8]) -> Result<Parsed, ApiError> {
    let o = object(body)?;
    let mut request = GenerateRequest::default();
    refuse_unless(
        &o,
        "logprobs",
        is_zero,
        "log probabilities are not supported",
    )?;
    refuse_unless(&o, "echo", is_false, "echo is not supported")?;
    refuse_unless(&o, "best_of", is_one, "only best_of = 1 is supported")?;
    refuse_unless(
        &o,
        "suffix",
        is_empty,
        "suffix (insertion) is not supported",
    )?;
    request.prompt = match field(&o, "prompt") {
        Some(Value::String(p)) if !p.is_empty() => p.clone(),
        Some(Value::String(_)) => {
            return Err(ApiError::invalid("prompt", "prompt must not be empty"))
        }
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            a[0].as_str().unwrap_or_default().to_string()
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "prompt",
                "prompt must be one string (batches and token arrays are not supported)",
            ))
        }
        None => return Err(ApiError::invalid("prompt", "prompt is required")),
    };
    if request.prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "prompt must not be empty"));
    }
    let (model, stream, include_usage) = common(&o, &mut request)?;
    Ok(Parsed {
        request,
        model,
        stream,
        include_usage,
    })
}

/// OpenAI's finish reasons: the end of sequence and a stop string are both "stop"; running out
/// of budget or context is "length".
pub fn finish_reason(s: &GenerateSummary) -> &'static str {
    match s.finish_reason.as_str() {
        "length" | "context" => "length",
        _ => "stop",
    }
}

pub fn usage(s: &GenerateSummary) -> Value {
    json!({
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.generated_tokens,
        "total_tokens": s.prompt_tokens + s.generated_tokens,
    })
}

/// The speculation statistics of a response (extension field `sequoia`), in the spirit of
/// llama-server's `timings.draft_n` / `draft_n_accepted`. The verify node is named by an
/// opaque id, never by its address.
pub fn speculation(s: &GenerateSummary, node_id: &str) -> Value {
    let accepted: u64 = s.accepted_by_rank.iter().sum();
    let t = s.timings.clone().unwrap_or_default();
    json!({
        "draft_n": s.drafted_tokens,
        "draft_n_accepted": accepted,
        "acceptance_rate": if s.drafted_tokens > 0 { accepted as f64 / s.drafted_tokens as f64 } else { 0.0 },
        "steps": s.steps,
        "tokens_per_step": s.mean_tokens_per_step,
        "tokens_per_second": t.tokens_per_second,
        "tree_nodes": s.plan.as_ref().map_or(1, |p| p.nodes),
        "verify_node": node_id,
        "failovers": s.failovers,
        "seed": s.seed,
        "finish_reason": s.finish_reason,
        "timings_ms": {
            "total": t.total_ms,
            "prefill": t.prefill_ms,
            "draft": t.draft_ms,
            "verify": t.verify_ms,
            "network": t.network_ms,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(v: Value) -> Result<Parsed, ApiError> {
        parse_chat(v.to_string().as_bytes())
    }

    #[test]
    fn chat_fields_map_onto_the_grpc_request() {
        let p = chat(json!({
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null},
            ],
            "max_tokens": 7, "max_completion_tokens": 9, "temperature": 0, "top_p": 0.5,
            "top_k": 4, "seed": -1, "stop": "x", "stream": true,
            "stream_options": {"include_usage": true}, "n": 1, "logprobs": false,
            "user": "ignored", "tools": [],
        }))
        .unwrap();
        let r = &p.request;
        assert_eq!(r.messages[0].role, "system");
        assert_eq!(r.messages[1].content, "a\nb");
        assert_eq!(r.messages[2].content, "");
        assert_eq!(
            (r.max_tokens, r.top_k, r.temperature, r.top_p),
            (9, 4, 0.0, 0.5)
        );
        assert_eq!(r.seed, Some(u64::MAX));
        assert_eq!(r.stop, vec!["x".to_string()]);
        assert!(p.stream && p.include_usage);
    }

    #[test]
    fn refusals_name_their_field() {
        let base = || json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        let with = |k: &str, v: Value| {
            let mut b = base();
            b[k] = v;
            b
        };
        for (body, param) in [
            (with("n", json!(2)), "n"),
            (with("logprobs", json!(true)), "logprobs"),
            (with("tools", json!([{"type": "function"}])), "tools"),
            (
                with("response_format", json!({"type": "json_object"})),
                "response_format",
            ),
            (with("temperature", json!(2.5)), "temperature"),
            (with("max_tokens", json!(0)), "max_tokens"),
            (with("stop", json!(3)), "stop"),
            (
                with("messages", json!([{"role": "tool", "content": "x"}])),
                "messages[0].role",
            ),
            (
                with(
                    "messages",
                    json!([{"role": "user", "content": [{"type": "image_url"}]}]),
                ),
                "messages[0].content[0].type",
            ),
            (with("model", json!(null)), "model"),
            (
                with("stream_options", json!({"include_usage": true})),
                "stream_options",
            ),
        ] {
            let e = chat(body.clone()).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        assert_eq!(parse_chat(b"{not json").unwrap_err().status, 400);
        assert_eq!(parse_chat(b"[1]").unwrap_err().status, 400);
        let e = parse_completion(
            json!({"model": "m", "prompt": [1, 2]})
                .to_string()
                .as_bytes(),
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        let p = parse_completion(
            json!({"model": "m", "prompt": "raw"})
                .to_string()
                .as_bytes(),
        )
        .unwrap();
        assert_eq!(p.request.prompt, "raw");
        assert!(p.request.messages.is_empty() && !p.request.apply_chat_template);
    }
}

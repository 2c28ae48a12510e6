//! Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the HTTP
//! status a client library maps to its exception types. Messages say what to change; they never
//! carry addresses or engine error text (those go to the log, under the request id).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use sequoia_server::admission::Refused;
use sequoia_server::security::TokenRefused;
use serde_json::json;
use tonic::{Code, Status};

/// Seconds a client should wait before retrying an overloaded node.
const RETRY_AFTER_SECS: u32 = 1;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Adds `Retry-After` (429 and 503).
    pub retry: bool,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry: false,
        }
    }

    /// 400 naming the request field at fault.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        let mut e = Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            message.into(),
        );
        e.param = Some(param.into());
        e
    }

    /// 400 for a field this server does not implement (OpenAI's own code for that case).
    pub fn unsupported(param: &str, message: impl Into<String>) -> Self {
        let mut e = Self::invalid(param, message);
        e.code = Some("unsupported_parameter");
        e
    }

    pub fn bad_body(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn body_too_large(limit: usize) -> Self {
        let mut e = Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("request body exceeds the limit of {limit} bytes"),
        );
        e.code = Some("request_too_large");
        e
    }

    pub fn unauthorized(why: TokenRefused) -> Self {
        let message = match why {
            TokenRefused::Missing => {
                "missing bearer token: send the header `Authorization: Bearer <token>` \
                 (the openai client's api_key)"
            }
            TokenRefused::Malformed => "malformed Authorization header: expected `Bearer <token>`",
            TokenRefused::Invalid => "invalid bearer token: not one this service accepts",
        };
        let mut e = Self::new(StatusCode::UNAUTHORIZED, "authentication_error", message);
        e.code = Some("invalid_api_key");
        e
    }

    pub fn not_found(what: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::NOT_FOUND, "invalid_request_error", what);
        e.code = Some("not_found");
        e
    }

    pub fn model_not_found(asked: &str, served: &str) -> Self {
        let mut e = Self::not_found(format!(
            "model {asked:?} is not served here; this node serves {served:?} (GET /v1/models)"
        ));
        e.param = Some("model".into());
        e.code = Some("model_not_found");
        e
    }

    pub fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "method not allowed on this path",
        )
    }

    /// 503 with `Retry-After`: loading, draining, or no verify node available.
    pub fn unavailable(code: &'static str, message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message);
        e.code = Some(code);
        e.retry = true;
        e
    }

    pub fn loading() -> Self {
        Self::unavailable(
            "loading",
            "the model is still loading; retry in a few seconds",
        )
    }

    /// 500 without detail; `id` finds the detail in the log.
    pub fn internal(id: &str) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            format!("internal error (request {id}); the server log has the details"),
        )
    }

    /// All generation slots taken (429) or shutting down (503), both with `Retry-After`.
    pub fn refused(r: Refused) -> Self {
        match r {
            Refused::Draining => {
                Self::unavailable("draining", "this node is shutting down; retry on another")
            }
            Refused::Full { active, max } => {
                let mut e = Self::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    format!("busy: {active} of {max} generations running; retry shortly"),
                );
                e.code = Some("overloaded");
                e.retry = true;
                e
            }
        }
    }

    /// An error of the shared generation code, for the public: validation messages pass
    /// (they name the field and say what is allowed); everything else is summarized, and the
    /// original goes to the log under `id`. `prompt_param` names the field holding the prompt
    /// (`messages` or `prompt`) for the context-limit case.
    pub fn from_status(s: &Status, prompt_param: &str, id: &str) -> Self {
        match s.code() {
            Code::InvalidArgument => {
                // `prepare`'s messages start with the field they are about.
                let first = s.message().split([':', ' ']).next().unwrap_or("");
                let base = first.split(['[', '.']).next().unwrap_or("");
                const FIELDS: [&str; 7] = [
                    "temperature",
                    "top_p",
                    "top_k",
                    "stop",
                    "messages",
                    "prompt",
                    "max_tokens",
                ];
                let param = if FIELDS.contains(&base) {
                    first.to_string()
                } else {
                    prompt_param.to_string()
                };
                Self::invalid(param, s.message().to_string())
            }
            // `prepare` says RESOURCE_EXHAUSTED when prompt + max_tokens exceed the context
            // (OpenAI: 400 context_length_exceeded); later it means no verify capacity.
            Code::ResourceExhausted if s.message().contains("context limit") => {
                let mut e = Self::invalid(prompt_param, s.message().to_string());
                e.code = Some("context_length_exceeded");
                e
            }
            Code::ResourceExhausted | Code::Unavailable | Code::DeadlineExceeded => {
                tracing::warn!(request_id = id, code = ?s.code(), detail = ?s.message(), "generation refused");
                Self::unavailable(
                    "no_verify_node",
                    "no verify node can take this generation right now; retry shortly",
                )
            }
            _ => {
                tracing::warn!(request_id = id, code = ?s.code(), detail = ?s.message(), "generation failed");
                Self::internal(id)
            }
        }
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = super::json_response(self.status, &self.body());
        if self.retry {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECS));
        }
        r
    }
}

//! Streamed responses: server-sent events, one `data: {chunk}` per committed step, a final chunk
//! with `finish_reason` (and the speculation statistics), a usage chunk when asked, then
//! `data: [DONE]`.
//!
//! A task of its own writes the events into the body channel. When the client disconnects,
//! hyper drops the body, the task's next send fails and the task ends, dropping the
//! generation's chunk stream: the generation stops at its next step and its verify session
//! and slot are freed.

use super::errors::ApiError;
use super::Reply;
use crate::generation::Chunks;
use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use futures::StreamExt;
use sequoia_proto::v1::GenerateChunk;
use std::convert::Infallible;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

fn event(v: &serde_json::Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// The SSE response for a generation whose first chunk has already arrived (so errors before
/// any text were answered with their own status).
pub fn response(reply: Reply, first: GenerateChunk, mut rest: Chunks) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(16);
    tokio::spawn(async move {
        let send = |b: Bytes| {
            let tx = tx.clone();
            async move { tx.send(Ok(b)).await.is_ok() }
        };
        if let Some(opening) = reply.opening_chunk() {
            if !send(event(&opening)).await {
                return;
            }
        }
        let mut next = Some(Ok(first));
        while let Some(item) = next.take() {
            match item {
                Ok(chunk) => {
                    if !chunk.text.is_empty() || !chunk.token_ids.is_empty() {
                        let delta = reply.delta_chunk(&chunk.text, chunk.token_ids.len());
                        if !send(event(&delta)).await {
                            return;
                        }
                    }
                    if let Some(summary) = &chunk.summary {
                        if !send(event(&reply.final_chunk(summary))).await {
                            return;
                        }
                        if reply.include_usage {
                            let _ = send(event(&reply.usage_chunk(summary))).await;
                        }
                        let _ = send(Bytes::from_static(b"data: [DONE]\n\n")).await;
                        return;
                    }
                }
                Err(status) => {
                    // Headers are sent: the error goes in-band, in OpenAI's error shape.
                    let e =
                        ApiError::from_status(&status, reply.endpoint.prompt_param(), &reply.id);
                    let _ = send(event(&e.body())).await;
                    return;
                }
            }
            next = rest.next().await;
        }
    });
    let mut r = Response::new(Body::from_stream(ReceiverStream::new(rx)));
    *r.status_mut() = StatusCode::OK;
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Reverse proxies (nginx) would otherwise buffer the stream.
    h.insert("x-accel-buffering", HeaderValue::from_static("no"));
    r
}

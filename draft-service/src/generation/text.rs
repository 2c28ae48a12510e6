//! Committed tokens → text deltas for the client: incremental detokenization (never splitting a
//! UTF-8 character), stop strings detected at the token that completes them, and text held back
//! while it could still become a stop string.

use sequoia_engine::tokenizer::{IncrementalDecoder, TextTokenizer};
use tonic::Status;

/// Text bookkeeping: detokenize committed tokens one at a time, detect stop strings exactly at
/// the token that completes them, and hold back text that could still become a stop string.
pub(super) struct TextOut<'a> {
    decoder: IncrementalDecoder<'a>,
    text: String,
    sent: usize,
    stop: Vec<String>,
    hold: usize,
}

impl<'a> TextOut<'a> {
    pub(super) fn new(tokenizer: &'a TextTokenizer, stop: &[String]) -> Self {
        TextOut {
            decoder: IncrementalDecoder::new(tokenizer, true),
            text: String::new(),
            sent: 0,
            // Text that could be the start of a stop string is held back until it cannot.
            hold: stop
                .iter()
                .map(|s| s.len())
                .max()
                .unwrap_or(1)
                .saturating_sub(1),
            stop: stop.to_vec(),
        }
    }

    /// Append one token's text; returns true when a stop string is now complete (text is cut
    /// before it).
    pub(super) fn push(&mut self, token: u32) -> Result<bool, Status> {
        let delta = self
            .decoder
            .push(&[token])
            .map_err(|e| Status::internal(format!("detokenize: {e}")))?;
        let from = self
            .text
            .len()
            .saturating_sub(self.hold)
            .max(self.sent.min(self.text.len()));
        let from = floor_char(&self.text, from);
        self.text.push_str(&delta);
        for s in &self.stop {
            if let Some(pos) = self.text[from..].find(s.as_str()) {
                self.text.truncate(from + pos);
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Text safe to send now (cannot be the start of a stop string).
    pub(super) fn take_ready(&mut self, finished: bool) -> String {
        let end = if finished {
            self.text.len()
        } else {
            floor_char(&self.text, self.text.len().saturating_sub(self.hold))
        };
        if end <= self.sent {
            return String::new();
        }
        let out = self.text[self.sent..end].to_string();
        self.sent = end;
        out
    }
}

fn floor_char(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

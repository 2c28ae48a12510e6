//! Streaming detokenization: committed token ids in, newly completed text out.
//!
//! Byte-level BPE tokens are byte strings, not characters: an emoji or a CJK character is often
//! split over two or three tokens, so decoding token by token would stream broken characters
//! (U+FFFD) to the client. And decoders may depend on context (SentencePiece strips the space
//! of the first token), so decoding each token alone is wrong too.
//!
//! The approach (the one text-generation-inference uses): keep a small window of ids, decode
//! the window with and without the new ids, and emit the difference only once it does not end
//! in an incomplete character. The window then restarts at the last emitted tokens, so each
//! push costs a decode of a few tokens, not of the whole generation. With byte-level decoders
//! the concatenation of all deltas equals `decode(all ids)`: emission only ever stops after a
//! complete character, where decoding restarts identically.
//!
//! Text that really ends in invalid UTF-8 (a model emitting a stray byte) is held back until a
//! complete character follows, or until [`IncrementalDecoder::flush`].

use super::{TextTokenizer, TokenizerError};

/// Streaming detokenizer over one generation (see the module docs).
#[derive(Debug, Clone)]
pub struct IncrementalDecoder<'a> {
    tok: &'a TextTokenizer,
    skip_special: bool,
    /// `ids[..read]`: already emitted, kept as decoding context; `ids[read..]`: pending.
    ids: Vec<u32>,
    read: usize,
}

impl<'a> IncrementalDecoder<'a> {
    /// A decoder for one generation; `skip_special` drops special tokens (e.g. `<|im_end|>`)
    /// from the text.
    pub fn new(tok: &'a TextTokenizer, skip_special: bool) -> Self {
        Self {
            tok,
            skip_special,
            ids: Vec::new(),
            read: 0,
        }
    }

    /// Add committed ids; returns the text they complete (possibly empty, e.g. half an emoji).
    /// Out-of-vocabulary ids are an error and leave the decoder unchanged.
    pub fn push(&mut self, ids: &[u32]) -> Result<String, TokenizerError> {
        self.tok.check_ids(ids)?;
        self.ids.extend_from_slice(ids);
        self.emit(false)
    }

    /// Everything still pending, even an incomplete character (as U+FFFD). Call once the
    /// generation is over; the decoder can still be pushed to afterwards.
    pub fn flush(&mut self) -> Result<String, TokenizerError> {
        self.emit(true)
    }

    fn emit(&mut self, force: bool) -> Result<String, TokenizerError> {
        if self.read == self.ids.len() {
            return Ok(String::new());
        }
        let context = self.tok.decode(&self.ids[..self.read], self.skip_special)?;
        let full = self.tok.decode(&self.ids, self.skip_special)?;
        let ready = full.len() > context.len() && full.starts_with(&context);
        if !ready && !force {
            return Ok(String::new());
        }
        if !force && full.ends_with(char::REPLACEMENT_CHARACTER) {
            return Ok(String::new());
        }
        let delta = if full.starts_with(&context) {
            full[context.len()..].to_string()
        } else {
            // Only decoders that rewrite earlier text (none of the byte-level ones) get here,
            // and only on flush: emit what the pending tokens decode to on their own.
            self.tok.decode(&self.ids[self.read..], self.skip_special)?
        };
        // The just-emitted tokens become the context for the next push.
        self.ids.drain(..self.read);
        self.read = self.ids.len();
        Ok(delta)
    }
}

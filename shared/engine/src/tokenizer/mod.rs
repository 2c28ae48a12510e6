//! Text ↔ token ids for the draft and target models, chat templates, and tokenizer fingerprints.
//!
//! Why this module exists rather than using `tokenizers::Tokenizer` directly:
//!
//! - **GGUF files carry no `tokenizer.json`.** The default models are GGUF files whose vocabulary,
//!   merges and special tokens live in llama.cpp's metadata keys; [`TextTokenizer::from_gguf`]
//!   rebuilds an equivalent Hugging Face tokenizer from them (the private `gguf` module documents
//!   the per-`tokenizer.ggml.pre` split rules). A `tokenizer.json` is used instead whenever one
//!   is available ([`TextTokenizer::load_for_model`]).
//! - **Speculative decoding needs both models to agree on every id.**
//!   [`TextTokenizer::fingerprint`] hashes the vocabulary (token strings in id order) and the BPE
//!   merges, so the draft service can refuse a verify node whose target tokenizes differently.
//! - **Generation must stop on every end-of-turn token**, not only the one declared as EOS (Qwen
//!   chat models end a turn with `<|im_end|>` but may also emit `<|endoftext|>`):
//!   [`TextTokenizer::eos_ids`] is that set.
//! - **Prompts use the model's own chat template** (Jinja, rendered with minijinja the way
//!   Hugging Face's `apply_chat_template` does), see [`TextTokenizer::apply_chat_template`].
//! - **Streaming text must never split a UTF-8 character** even though byte-level BPE tokens do:
//!   [`IncrementalDecoder`] turns committed ids into text deltas whose concatenation equals the
//!   full decode.
//!
//! [`testing`] writes tiny byte-level BPE tokenizers for unit tests elsewhere in the workspace.

mod chat;
mod gguf;
mod incremental;
pub mod testing;

use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokenizers::Tokenizer;

pub use incremental::IncrementalDecoder;

use chat::ChatTemplate;

/// One message of a conversation, as chat templates expect it (`{"role": ..., "content": ...}`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` (or whatever roles the model's template knows).
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }

    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    /// A `system` message.
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    /// An `assistant` message.
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// Everything that can go wrong loading or using a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A file was read but its content is not a usable tokenizer description.
    #[error("invalid tokenizer data in {path}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// No tokenizer could be found for a model path.
    #[error("no tokenizer found for {path}: {reason}")]
    NotFound {
        /// The model path that was given.
        path: PathBuf,
        /// What was looked for.
        reason: String,
    },
    /// The tokenizer kind is valid but not supported by this implementation.
    #[error("unsupported tokenizer: {0}")]
    Unsupported(String),
    /// An error from the `tokenizers` crate while encoding or decoding.
    #[error("tokenizer error: {0}")]
    Tokenizers(String),
    /// A token id outside the vocabulary was given to decode.
    #[error("token id {id} is out of range (vocabulary size {vocab_size})")]
    InvalidTokenId {
        /// The offending id.
        id: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// [`TextTokenizer::apply_chat_template`] on a model without a chat template.
    #[error("the model has no chat template")]
    NoChatTemplate,
    /// The chat template failed to compile or to render.
    #[error("chat template error: {0}")]
    ChatTemplate(String),
}

impl TokenizerError {
    fn tokenizers(e: tokenizers::Error) -> Self {
        Self::Tokenizers(e.to_string())
    }

    fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    fn invalid(path: &Path, message: impl Into<String>) -> Self {
        Self::Invalid {
            path: path.to_path_buf(),
            message: message.into(),
        }
    }
}

/// Tokens that end a generation whenever the vocabulary has them as special (control) tokens,
/// in addition to the declared EOS. This mirrors llama.cpp's end-of-generation set: chat models
/// end a turn with one of these even when their declared EOS is another.
const END_OF_GENERATION_TOKENS: &[&str] = &[
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<|end|>",
    "<|return|>",
];

/// What a tokenizer source says besides the vocabulary: special ids and the chat template.
#[derive(Debug, Default, Clone)]
struct SpecialInfo {
    /// Declared BOS token id.
    bos_id: Option<u32>,
    /// Declared EOS token ids, in priority order (the first is "the" EOS token).
    eos_ids: Vec<u32>,
    /// Jinja chat template source.
    chat_template: Option<String>,
    /// Whether the GGUF asks for BOS to be prepended (`add_bos_token`): the GGUF builder then
    /// installs a post-processor for it. (A tokenizer.json has its own post-processor.)
    add_bos: bool,
}

/// A model's tokenizer: encode/decode, special ids, chat template and fingerprint.
///
/// Cheap to share (`Send + Sync`); wrap it in an `Arc` to use it from several tasks.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: Tokenizer,
    vocab_size: usize,
    bos_id: Option<u32>,
    eos_ids: Vec<u32>,
    add_bos: bool,
    fingerprint: String,
    chat: Option<ChatTemplate>,
    /// Why the declared chat template could not be used (compile error), if it could not.
    chat_error: Option<String>,
}

impl fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .field("fingerprint", &self.fingerprint)
            .field("has_chat_template", &self.chat.is_some())
            .finish()
    }
}

impl TextTokenizer {
    /// Load a Hugging Face `tokenizer.json`.
    ///
    /// Sibling files in the same folder are used when present: `tokenizer_config.json`
    /// (`chat_template`, `eos_token`, `bos_token`), `chat_template.jinja` /
    /// `chat_template.json`, `generation_config.json` and `config.json` (`eos_token_id`).
    pub fn from_tokenizer_json(path: &Path) -> Result<Self, TokenizerError> {
        let (inner, merges) = load_tokenizer_json(path)?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let info = hf::read_special_info(dir, &inner)?;
        Self::assemble(inner, info, &merges)
    }

    /// Build the tokenizer from a GGUF file's `tokenizer.*` metadata.
    ///
    /// Supports the byte-level BPE tokenizers (`tokenizer.ggml.model = "gpt2"`: Qwen2, Llama 3,
    /// SmolLM, GPT-2, ...); SentencePiece (`"llama"`) files give [`TokenizerError::Unsupported`]
    /// (put the model's `tokenizer.json` next to the `.gguf` instead).
    pub fn from_gguf(path: &Path) -> Result<Self, TokenizerError> {
        let metadata = gguf::read_metadata(path)?;
        let (inner, info, merges) = gguf::build(path, &metadata)?;
        Self::assemble(inner, info, &merges)
    }

    /// The tokenizer for a model path, as the engine loads models:
    ///
    /// - a `.gguf` file: `tokenizer.json` next to it if present (chat template and EOS from the
    ///   sibling `tokenizer_config.json`, else from the GGUF metadata), else the GGUF metadata;
    /// - a Hugging Face folder: its `tokenizer.json` (+ `tokenizer_config.json` etc.);
    /// - a `tokenizer.json` file itself.
    pub fn load_for_model(model_path: &Path) -> Result<Self, TokenizerError> {
        if model_path.is_dir() {
            let json = model_path.join("tokenizer.json");
            if json.is_file() {
                return Self::from_tokenizer_json(&json);
            }
            return Err(TokenizerError::NotFound {
                path: model_path.to_path_buf(),
                reason: "the folder has no tokenizer.json".into(),
            });
        }
        if !model_path.is_file() {
            return Err(TokenizerError::NotFound {
                path: model_path.to_path_buf(),
                reason: "no such file or directory".into(),
            });
        }
        let is_gguf = model_path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
        if !is_gguf {
            // Anything else that is a file is taken to be a tokenizer.json.
            return Self::from_tokenizer_json(model_path);
        }
        let dir = model_path.parent().unwrap_or(Path::new("."));
        let json = dir.join("tokenizer.json");
        if !json.is_file() {
            return Self::from_gguf(model_path);
        }
        // tokenizer.json for the vocabulary; whatever the sidecar files do not say comes from
        // the GGUF metadata (same model, so the ids agree).
        let (inner, merges) = load_tokenizer_json(&json)?;
        let mut info = hf::read_special_info(dir, &inner)?;
        if info.chat_template.is_none() || info.eos_ids.is_empty() || info.bos_id.is_none() {
            let metadata = gguf::read_metadata(model_path)?;
            let from_gguf = gguf::special_info(model_path, &metadata)?;
            if info.chat_template.is_none() {
                info.chat_template = from_gguf.chat_template;
            }
            if info.eos_ids.is_empty() {
                info.eos_ids = from_gguf.eos_ids;
            }
            if info.bos_id.is_none() {
                info.bos_id = from_gguf.bos_id;
            }
        }
        Self::assemble(inner, info, &merges)
    }

    /// Final construction shared by all sources: validates ids, completes the EOS set, compiles
    /// the chat template and computes the fingerprint.
    fn assemble(
        inner: Tokenizer,
        info: SpecialInfo,
        merges: &[(String, String)],
    ) -> Result<Self, TokenizerError> {
        let vocab_size = inner.get_vocab_size(true);
        let in_range = |id: &u32| (*id as usize) < vocab_size;

        let mut eos_ids: Vec<u32> = Vec::new();
        for id in info.eos_ids.iter().copied().filter(in_range) {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        let specials: HashSet<u32> = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter_map(|(id, tok)| tok.special.then_some(id))
            .collect();
        for token in END_OF_GENERATION_TOKENS {
            if let Some(id) = inner.token_to_id(token) {
                if specials.contains(&id) && !eos_ids.contains(&id) {
                    eos_ids.push(id);
                }
            }
        }
        let bos_id = info.bos_id.filter(in_range);

        let token_text = |id: Option<u32>| id.and_then(|id| inner.id_to_token(id));
        let (chat, chat_error) = match info.chat_template {
            Some(source) => {
                match ChatTemplate::new(
                    source,
                    token_text(bos_id),
                    token_text(eos_ids.first().copied()),
                ) {
                    Ok(t) => (Some(t), None),
                    Err(e) => {
                        tracing::warn!("the model's chat template cannot be used: {e}");
                        (None, Some(e.to_string()))
                    }
                }
            }
            None => (None, None),
        };

        // Observed rather than declared: whatever the config says, this is what encode does.
        let add_bos = match bos_id {
            Some(bos) => {
                let probe = inner
                    .encode_fast("a", true)
                    .map_err(TokenizerError::tokenizers)?;
                probe.get_ids().first() == Some(&bos)
            }
            None => false,
        };

        let fingerprint = fingerprint(&inner, merges);
        Ok(Self {
            inner,
            vocab_size,
            bos_id,
            eos_ids,
            add_bos,
            fingerprint,
            chat,
            chat_error,
        })
    }

    /// Token ids for `text`. With `add_special_tokens`, the model's post-processor runs (e.g.
    /// prepends BOS for models that want it; Qwen adds nothing). Special-token text in `text`
    /// (like `<|im_start|>`) is always recognised as the special token, as chat prompts need.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(TokenizerError::tokenizers)?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text for `ids`. Ids outside the vocabulary are an error (they may come from the
    /// network), not silently dropped. Invalid UTF-8 (possible mid-character) becomes U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        self.check_ids(ids)?;
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(TokenizerError::tokenizers)
    }

    /// Every id must be below [`vocab_size`](Self::vocab_size).
    pub fn check_ids(&self, ids: &[u32]) -> Result<(), TokenizerError> {
        match ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            Some(&id) => Err(TokenizerError::InvalidTokenId {
                id,
                vocab_size: self.vocab_size,
            }),
            None => Ok(()),
        }
    }

    /// Ids that end a generation: the declared EOS first, then the model's other end-of-turn
    /// special tokens (e.g. for Qwen chat models `<|im_end|>` and `<|endoftext|>`).
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Whether `id` ends a generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_ids.contains(&id)
    }

    /// The declared BOS token id, if any. Whether it is prepended is up to
    /// [`encode`](Self::encode) with `add_special_tokens` (see [`adds_bos`](Self::adds_bos)).
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// Whether [`encode`](Self::encode) with `add_special_tokens` prepends BOS (as the model's
    /// `add_bos_token` / post-processor asks; false for Qwen and SmolLM2).
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    /// Number of token ids, added tokens included (151,936 for Qwen2.5; the models' embedding
    /// size).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Hex sha256 over the vocabulary (token strings in id order) and the merges: equal iff the
    /// two tokenizers map text to the same ids.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// The token string for an id (byte-level spelling, e.g. `Ġworld`), if the id exists.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a token string (exact vocabulary spelling, e.g. `<|im_end|>`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }

    /// Whether the model has a usable chat template.
    pub fn has_chat_template(&self) -> bool {
        self.chat.is_some()
    }

    /// Render the model's own chat template (e.g. Qwen's ChatML template) for `messages`; with
    /// `add_generation_prompt` the text ends where the assistant's reply starts
    /// (`<|im_start|>assistant\n` for ChatML). Encode the result with
    /// `encode(&text, false)`: the template already wrote any BOS it wants.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        match (&self.chat, &self.chat_error) {
            (Some(chat), _) => chat.render(messages, add_generation_prompt),
            (None, Some(e)) => Err(TokenizerError::ChatTemplate(e.clone())),
            (None, None) => Err(TokenizerError::NoChatTemplate),
        }
    }
}

fn load_tokenizer_json(path: &Path) -> Result<(Tokenizer, Merges), TokenizerError> {
    let text = std::fs::read_to_string(path).map_err(|e| TokenizerError::io(path, e))?;
    let tokenizer = text
        .parse::<Tokenizer>()
        .map_err(|e| TokenizerError::invalid(path, e.to_string()))?;
    let merges = merges_of_tokenizer_json(&text, path)?;
    Ok((tokenizer, merges))
}

/// BPE merges in rank order, as `(left, right)` token strings.
type Merges = Vec<(String, String)>;

/// The merges of a tokenizer.json's model. Both spellings are accepted: `"a b"` strings (older
/// files) and `["a", "b"]` pairs (newer ones, which allow spaces inside tokens).
fn merges_of_tokenizer_json(text: &str, path: &Path) -> Result<Merges, TokenizerError> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Merge {
        Pair(String, String),
        Joined(String),
    }
    #[derive(Deserialize)]
    struct Model {
        #[serde(default)]
        merges: Vec<Merge>,
    }
    #[derive(Deserialize)]
    struct File {
        model: Model,
    }
    let file: File =
        serde_json::from_str(text).map_err(|e| TokenizerError::invalid(path, e.to_string()))?;
    Ok(file
        .model
        .merges
        .into_iter()
        .map(|m| match m {
            Merge::Pair(a, b) => (a, b),
            Merge::Joined(s) => match s.split_once(' ') {
                Some((a, b)) => (a.to_string(), b.to_string()),
                None => (s, String::new()),
            },
        })
        .collect())
}

/// sha256 over the vocabulary (token strings in id order) and the merges (rank order), see
/// [`TextTokenizer::fingerprint`]. Every string is length-prefixed so that no two different
/// vocabularies hash the same byte stream. Both sources (tokenizer.json and GGUF) give the
/// merges in rank order with the same spelling, so one model hashes the same from either.
fn fingerprint(tok: &Tokenizer, merges: &[(String, String)]) -> String {
    fn put(h: &mut Sha256, s: &str) {
        h.update((s.len() as u64).to_le_bytes());
        h.update(s.as_bytes());
    }
    let mut h = Sha256::new();
    put(&mut h, "sequoia-tokenizer-fingerprint-v1");
    let n = tok.get_vocab_size(true);
    h.update((n as u64).to_le_bytes());
    for id in 0..n as u32 {
        match tok.id_to_token(id) {
            Some(t) => put(&mut h, &t),
            None => h.update(u64::MAX.to_le_bytes()),
        }
    }
    h.update((merges.len() as u64).to_le_bytes());
    for (a, b) in merges {
        put(&mut h, a);
        put(&mut h, b);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Reading the Hugging Face sidecar files (`tokenizer_config.json` and friends).
mod hf {
    use super::{SpecialInfo, TokenizerError};
    use serde_json::Value;
    use std::path::Path;
    use tokenizers::Tokenizer;

    fn read_json(path: &Path) -> Result<Option<Value>, TokenizerError> {
        if !path.is_file() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(path).map_err(|e| TokenizerError::io(path, e))?;
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| TokenizerError::invalid(path, e.to_string()))
    }

    /// A special token as tokenizer_config.json writes it: a string or `{"content": ...}`.
    fn token_content(v: Option<&Value>) -> Option<&str> {
        match v? {
            Value::String(s) => Some(s),
            Value::Object(o) => o.get("content").and_then(Value::as_str),
            _ => None,
        }
    }

    /// `eos_token_id` as an int or a list of ints.
    fn ids(v: Option<&Value>) -> Vec<u32> {
        match v {
            Some(Value::Number(n)) => n.as_u64().map(|n| n as u32).into_iter().collect(),
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(|x| x.as_u64().map(|n| n as u32))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// The chat template from tokenizer_config.json: a string, or a list of named templates
    /// (the one named "default" is used).
    fn template_from_config(v: Option<&Value>) -> Option<String> {
        match v? {
            Value::String(s) => Some(s.clone()),
            Value::Array(list) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .or_else(|| list.first())
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .map(str::to_owned),
            _ => None,
        }
    }

    pub(super) fn read_special_info(
        dir: &Path,
        tok: &Tokenizer,
    ) -> Result<SpecialInfo, TokenizerError> {
        let config = read_json(&dir.join("tokenizer_config.json"))?;
        let generation = read_json(&dir.join("generation_config.json"))?;
        let model_config = read_json(&dir.join("config.json"))?;
        let mut info = SpecialInfo::default();

        if let Some(cfg) = &config {
            if let Some(eos) = token_content(cfg.get("eos_token")).and_then(|t| tok.token_to_id(t))
            {
                info.eos_ids.push(eos);
            }
            info.bos_id = token_content(cfg.get("bos_token")).and_then(|t| tok.token_to_id(t));
            info.chat_template = template_from_config(cfg.get("chat_template"));
        }
        for cfg in [&generation, &model_config].into_iter().flatten() {
            info.eos_ids.extend(ids(cfg.get("eos_token_id")));
            if info.bos_id.is_none() {
                info.bos_id = ids(cfg.get("bos_token_id")).first().copied();
            }
        }
        // Newer Hugging Face repos keep the template in its own file.
        if info.chat_template.is_none() {
            let jinja = dir.join("chat_template.jinja");
            if jinja.is_file() {
                info.chat_template = Some(
                    std::fs::read_to_string(&jinja).map_err(|e| TokenizerError::io(&jinja, e))?,
                );
            } else if let Some(v) = read_json(&dir.join("chat_template.json"))? {
                info.chat_template = template_from_config(v.get("chat_template"));
            }
        }
        Ok(info)
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;
    use candle_core::quantized::gguf_file;
    use proptest::prelude::*;

    fn tiny_dir() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        write_tiny_tokenizer(dir.path()).unwrap();
        dir
    }

    fn write_gguf(path: &Path, metadata: &[(String, gguf_file::Value)]) {
        let mut file = std::fs::File::create(path).unwrap();
        let md: Vec<(&str, &gguf_file::Value)> =
            metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        gguf_file::write(&mut file, &md, &[]).unwrap();
    }

    /// Concatenated deltas of an incremental decode, pushing `chunk` ids at a time.
    fn stream(tok: &TextTokenizer, ids: &[u32], chunk: usize, skip: bool) -> (String, Vec<String>) {
        let mut dec = IncrementalDecoder::new(tok, skip);
        let mut deltas: Vec<String> = ids
            .chunks(chunk.max(1))
            .map(|c| dec.push(c).unwrap())
            .collect();
        deltas.push(dec.flush().unwrap());
        (deltas.concat(), deltas)
    }

    #[test]
    fn tokenizer_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<TextTokenizer>();
        assert_send_sync::<IncrementalDecoder<'static>>();
    }

    #[test]
    fn tiny_tokenizer_loads_with_declared_size_and_specials() {
        let dir = tiny_dir();
        let tok = TextTokenizer::from_tokenizer_json(&dir.path().join("tokenizer.json")).unwrap();
        assert_eq!(tok.vocab_size(), TINY_VOCAB_SIZE);
        assert_eq!(tok.eos_ids(), &[TINY_EOS_ID, TINY_ENDOFTEXT_ID]);
        assert!(tok.is_eos(TINY_ENDOFTEXT_ID));
        assert_eq!(tok.bos_id(), None);
        assert!(!tok.adds_bos());
        assert_eq!(tok.token_to_id("<|im_start|>"), Some(TINY_IM_START_ID));
        assert_eq!(tok.fingerprint().len(), 64);
        // The in-memory and the written tokenizer are the same.
        assert_eq!(tok.fingerprint(), tiny_tokenizer().fingerprint());
        let again = TextTokenizer::load_for_model(dir.path()).unwrap();
        assert_eq!(again.fingerprint(), tok.fingerprint());
    }

    #[test]
    fn tiny_tokenizer_round_trips_ascii_and_uses_merges() {
        let tok = tiny_tokenizer();
        let ids = tok.encode("Hello world", false).unwrap();
        assert_eq!(
            ids.len(),
            2,
            "{ids:?}: 'Hello' and 'Ġworld' are single tokens"
        );
        for text in [
            "Hello world",
            "the cat and the hat, in the end.\n\n    x = (1 + 2)\tdone",
            "",
            "  leading and trailing  ",
            "!\"#$%&'()*+,-./0123456789:;<=>?@[\\]^_`{|}~",
        ] {
            let ids = tok.encode(text, true).unwrap();
            assert!(ids.iter().all(|&id| (id as usize) < TINY_VOCAB_SIZE));
            assert_eq!(tok.decode(&ids, false).unwrap(), text);
        }
    }

    #[test]
    fn tiny_special_tokens_are_matched_whole_and_skippable() {
        let tok = tiny_tokenizer();
        let ids = tok.encode("<|im_start|>user\nhi<|im_end|>", false).unwrap();
        assert_eq!(ids.first(), Some(&TINY_IM_START_ID));
        assert_eq!(ids.last(), Some(&TINY_EOS_ID));
        assert_eq!(tok.decode(&ids, true).unwrap(), "user\nhi");
        assert_eq!(
            tok.decode(&ids, false).unwrap(),
            "<|im_start|>user\nhi<|im_end|>"
        );
    }

    #[test]
    fn variant_differs_in_fingerprint_only() {
        let dir = tempfile::tempdir().unwrap();
        write_tiny_tokenizer_variant(dir.path()).unwrap();
        let variant = TextTokenizer::load_for_model(dir.path()).unwrap();
        let tok = tiny_tokenizer();
        assert_eq!(variant.vocab_size(), TINY_VOCAB_SIZE);
        assert_eq!(variant.eos_ids(), tok.eos_ids());
        assert_ne!(variant.fingerprint(), tok.fingerprint());
        assert_eq!(
            variant.fingerprint(),
            tiny_tokenizer_variant().fingerprint()
        );
        assert_eq!(
            variant
                .decode(&variant.encode("quick xyz", false).unwrap(), false)
                .unwrap(),
            "quick xyz"
        );
    }

    #[test]
    fn tiny_chat_template_renders_chatml() {
        let tok = tiny_tokenizer();
        assert!(tok.has_chat_template());
        let text = tok
            .apply_chat_template(
                &[ChatMessage::system("Be brief."), ChatMessage::user("Hello")],
                true,
            )
            .unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
        );
        let no_prompt = tok
            .apply_chat_template(&[ChatMessage::user("x")], false)
            .unwrap();
        assert_eq!(no_prompt, "<|im_start|>user\nx<|im_end|>\n");
    }

    #[test]
    fn gguf_metadata_builds_the_same_tokenizer_as_tokenizer_json() {
        let dir = tempfile::tempdir().unwrap();
        for variant in [false, true] {
            let path = dir.path().join(format!("tiny-{variant}.gguf"));
            write_gguf(&path, &tiny_tokenizer_gguf_metadata(variant));
            let from_gguf = TextTokenizer::load_for_model(&path).unwrap();
            let reference = if variant {
                tiny_tokenizer_variant()
            } else {
                tiny_tokenizer()
            };
            assert_eq!(from_gguf.fingerprint(), reference.fingerprint());
            assert_eq!(from_gguf.vocab_size(), TINY_VOCAB_SIZE);
            assert_eq!(from_gguf.eos_ids(), reference.eos_ids());
            assert!(from_gguf.has_chat_template());
            let text = "<|im_start|>user\nHello world, the end 123<|im_end|>";
            assert_eq!(
                from_gguf.encode(text, true).unwrap(),
                reference.encode(text, true).unwrap()
            );
        }
    }

    #[test]
    fn gguf_with_tokenizer_json_beside_it_uses_the_json() {
        let dir = tempfile::tempdir().unwrap();
        // The GGUF says "variant", the tokenizer.json beside it says "tiny": the json wins.
        write_tiny_tokenizer(dir.path()).unwrap();
        let path = dir.path().join("model.gguf");
        write_gguf(&path, &tiny_tokenizer_gguf_metadata(true));
        let tok = TextTokenizer::load_for_model(&path).unwrap();
        assert_eq!(tok.fingerprint(), tiny_tokenizer().fingerprint());
        // Without tokenizer_config.json, the chat template and EOS come from the GGUF.
        std::fs::remove_file(dir.path().join("tokenizer_config.json")).unwrap();
        let tok = TextTokenizer::load_for_model(&path).unwrap();
        assert!(tok.has_chat_template());
        assert_eq!(tok.eos_ids(), &[TINY_EOS_ID, TINY_ENDOFTEXT_ID]);
    }

    #[test]
    fn unsupported_and_missing_tokenizers_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let mut md = tiny_tokenizer_gguf_metadata(false);
        md[0].1 = gguf_file::Value::String("llama".into());
        let spm = dir.path().join("spm.gguf");
        write_gguf(&spm, &md);
        let err = TextTokenizer::from_gguf(&spm).unwrap_err();
        assert!(matches!(err, TokenizerError::Unsupported(_)), "{err}");
        assert!(err.to_string().contains("tokenizer.json"), "{err}");

        let mut md = tiny_tokenizer_gguf_metadata(false);
        md[1].1 = gguf_file::Value::String("mystery".into());
        let unknown_pre = dir.path().join("pre.gguf");
        write_gguf(&unknown_pre, &md);
        let err = TextTokenizer::from_gguf(&unknown_pre).unwrap_err();
        assert!(err.to_string().contains("mystery"), "{err}");

        let err = TextTokenizer::load_for_model(&dir.path().join("absent.gguf")).unwrap_err();
        assert!(matches!(err, TokenizerError::NotFound { .. }), "{err}");
        let err = TextTokenizer::load_for_model(dir.path()).unwrap_err();
        assert!(err.to_string().contains("tokenizer.json"), "{err}");

        let not_gguf = dir.path().join("junk.gguf");
        std::fs::write(&not_gguf, b"definitely not gguf").unwrap();
        assert!(matches!(
            TextTokenizer::from_gguf(&not_gguf).unwrap_err(),
            TokenizerError::Invalid { .. }
        ));
    }

    #[test]
    fn decode_rejects_ids_outside_the_vocabulary() {
        let tok = tiny_tokenizer();
        let err = tok.decode(&[1, TINY_VOCAB_SIZE as u32], false).unwrap_err();
        assert!(
            matches!(err, TokenizerError::InvalidTokenId { id: 320, .. }),
            "{err}"
        );
        let mut dec = IncrementalDecoder::new(&tok, false);
        assert!(dec.push(&[u32::MAX]).is_err());
        assert_eq!(dec.push(&[72]).unwrap(), "H");
    }

    #[test]
    fn no_chat_template_is_a_clear_error() {
        let dir = tiny_dir();
        std::fs::remove_file(dir.path().join("tokenizer_config.json")).unwrap();
        let tok = TextTokenizer::load_for_model(dir.path()).unwrap();
        assert!(!tok.has_chat_template());
        assert!(matches!(
            tok.apply_chat_template(&[ChatMessage::user("x")], true),
            Err(TokenizerError::NoChatTemplate)
        ));
        // Without a config, nothing declares EOS, but the end-of-turn specials still count.
        assert_eq!(tok.eos_ids(), &[TINY_EOS_ID, TINY_ENDOFTEXT_ID]);
    }

    #[test]
    fn incremental_decoder_holds_split_characters() {
        let tok = tiny_tokenizer();
        // The tiny vocabulary has no multi-byte merges: "é" is 2 tokens, "🚀" 4.
        let ids = tok.encode("é🚀!", false).unwrap();
        assert_eq!(ids.len(), 7);
        let mut dec = IncrementalDecoder::new(&tok, false);
        let deltas: Vec<String> = ids.iter().map(|&id| dec.push(&[id]).unwrap()).collect();
        assert_eq!(deltas, ["", "é", "", "", "", "🚀", "!"]);
        assert_eq!(dec.flush().unwrap(), "");
    }

    #[test]
    fn incremental_decoder_flushes_incomplete_text() {
        let tok = tiny_tokenizer();
        let ids = tok.encode("a🚀", false).unwrap();
        assert_eq!(ids.len(), 5);
        let mut dec = IncrementalDecoder::new(&tok, false);
        assert_eq!(dec.push(&ids[..1]).unwrap(), "a");
        assert_eq!(dec.push(&ids[1..3]).unwrap(), "");
        assert_eq!(dec.flush().unwrap(), "\u{FFFD}");
        assert_eq!(dec.flush().unwrap(), "");
    }

    #[test]
    fn incremental_decoder_skips_special_tokens() {
        let tok = tiny_tokenizer();
        let ids = tok
            .encode("hi<|im_end|><|endoftext|> there", false)
            .unwrap();
        for skip in [false, true] {
            let (text, _) = stream(&tok, &ids, 1, skip);
            assert_eq!(text, tok.decode(&ids, skip).unwrap());
        }
    }

    /// `text` as the tokenizer's normalizer (NFC, like Qwen's) sees it.
    fn normalized(tok: &TextTokenizer, text: &str) -> String {
        use tokenizers::Normalizer;
        let mut n = tokenizers::NormalizedString::from(text);
        if let Some(normalizer) = tok.inner().get_normalizer() {
            normalizer.normalize(&mut n).unwrap();
        }
        n.get().to_string()
    }

    proptest! {
        #[test]
        fn incremental_deltas_concatenate_to_the_text(text in "\\PC{0,40}", chunk in 1usize..5) {
            let tok = tiny_tokenizer();
            let text = normalized(&tok, &text);
            let ids = tok.encode(&text, false).unwrap();
            prop_assert_eq!(tok.decode(&ids, false).unwrap(), text.clone());
            let (streamed, deltas) = stream(&tok, &ids, chunk, false);
            prop_assert_eq!(&streamed, &text);
            // No delta ever carries half a character (unless the text has U+FFFD itself).
            if !text.contains(char::REPLACEMENT_CHARACTER) {
                for d in deltas {
                    prop_assert!(!d.contains(char::REPLACEMENT_CHARACTER), "delta {:?}", d);
                }
            }
        }

        /// Arbitrary id sequences (invalid UTF-8 included) still stream to exactly decode(all).
        #[test]
        fn incremental_deltas_match_decode_for_any_ids(
            ids in proptest::collection::vec(0u32..TINY_VOCAB_SIZE as u32, 0..40),
            chunk in 1usize..5,
            skip in any::<bool>(),
        ) {
            let tok = tiny_tokenizer();
            let (streamed, _) = stream(&tok, &ids, chunk, skip);
            prop_assert_eq!(streamed, tok.decode(&ids, skip).unwrap());
        }
    }
}

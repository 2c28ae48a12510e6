//! Tiny byte-level BPE tokenizers for tests, so that unit tests across the workspace need no
//! downloaded model.
//!
//! Layout of the tiny vocabulary ([`TINY_VOCAB_SIZE`] = 320 ids):
//! - ids 0..256: one token per byte (GPT-2 byte alphabet, id = byte value), so any text encodes;
//! - ids 256..317: 61 merges of common English pairs (`Ġt`, `he`, `Ġthe`, `Hello`, `Ġworld`, ...);
//! - 317 `<|endoftext|>`, 318 `<|im_start|>`, 319 `<|im_end|>` (special; EOS is `<|im_end|>`).
//!
//! The pre-tokenizer is Qwen2's, so tiny models exercise the same code paths as the real ones.
//! The variant has the same size and special ids but 13 different merges: a different
//! fingerprint, for the draft/target mismatch tests.

use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use tokenizers::Tokenizer;

use super::gguf::{build_byte_level, byte_alphabet, ByteLevelSpec, SplitRule};
use super::{SpecialInfo, TextTokenizer};

/// Vocabulary size of the tiny tokenizers (256 bytes + 61 merges + 3 special tokens).
pub const TINY_VOCAB_SIZE: usize = 320;
/// `<|endoftext|>` in the tiny vocabulary.
pub const TINY_ENDOFTEXT_ID: u32 = 317;
/// `<|im_start|>` in the tiny vocabulary.
pub const TINY_IM_START_ID: u32 = 318;
/// `<|im_end|>` in the tiny vocabulary: the declared EOS.
pub const TINY_EOS_ID: u32 = 319;

/// A minimal ChatML template (the format of the Qwen and SmolLM2 models).
pub const TINY_CHAT_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Merges shared by both tiny tokenizers (byte-level spelling: `Ġ` is a space, `Ċ` a newline).
const COMMON_MERGES: [&str; 48] = [
    "Ġ t", "h e", "i n", "e r", "a n", "Ġ a", "o n", "r e", "Ġt he", "e n", "a t", "o r", "Ġ s",
    "e s", "Ġ w", "i s", "i t", "Ġ o", "Ġ c", "n d", "Ġ b", "in g", "Ġ f", "Ġ p", "Ġ m", "a r",
    "l l", "o u", "Ġ h", "e d", "Ġ d", "a l", "Ġa n", "Ġan d", "Ġ i", "i c", "l e", "Ġ l", "r o",
    "Ġ n", "o m", "s t", "Ġ g", "Ġo f", "Ġ e", "Ġt o", "Ġi n", "Ġ r",
];
const MERGES_TAIL: [&str; 13] = [
    "Ċ Ċ",
    "Ġ Ġ",
    "ĠĠ ĠĠ",
    "Ġw or",
    "l d",
    "Ġwor ld",
    "H e",
    "He ll",
    "Hell o",
    "Ġd e",
    "Ġ (",
    "Ġ =",
    "Ġ 1",
];
const VARIANT_MERGES_TAIL: [&str; 13] = [
    "Ġ x", "Ġ y", "Ġ z", "q u", "Ġ q", "Ġq u", "Ġqu i", "x y", "y z", "Ġx y", "k e", "Ġ k", "Ġk e",
];

/// Token strings, token types (GGUF convention) and merges of a tiny tokenizer.
fn tiny_parts(variant: bool) -> (Vec<String>, Vec<i32>, Vec<(String, String)>) {
    let alphabet = byte_alphabet();
    let mut tokens: Vec<String> = alphabet.iter().map(|c| c.to_string()).collect();
    let tail = if variant {
        &VARIANT_MERGES_TAIL
    } else {
        &MERGES_TAIL
    };
    let mut merges = Vec::new();
    for merge in COMMON_MERGES.iter().chain(tail.iter()) {
        let (a, b) = merge.split_once(' ').expect("merges are 'a b'");
        assert!(
            tokens.iter().any(|t| t == a) && tokens.iter().any(|t| t == b),
            "tiny merge {merge:?} uses a token not yet in the vocabulary"
        );
        let joined = format!("{a}{b}");
        assert!(
            !tokens.contains(&joined),
            "tiny merge {merge:?} is a duplicate"
        );
        tokens.push(joined);
        merges.push((a.to_string(), b.to_string()));
    }
    let mut types = vec![1; tokens.len()];
    for special in SPECIAL_TOKENS {
        tokens.push(special.to_string());
        types.push(3);
    }
    assert_eq!(tokens.len(), TINY_VOCAB_SIZE);
    (tokens, types, merges)
}

fn tiny_inner(variant: bool) -> (Tokenizer, Vec<(String, String)>) {
    let (tokens, types, merges) = tiny_parts(variant);
    build_byte_level(ByteLevelSpec {
        tokens: &tokens,
        token_types: Some(&types),
        merges,
        rule: SplitRule::for_pre("qwen2").expect("qwen2 is a known pre-tokenizer"),
        add_bos: None,
    })
    .expect("the tiny tokenizer is well-formed")
}

fn tiny(variant: bool) -> TextTokenizer {
    let (inner, merges) = tiny_inner(variant);
    TextTokenizer::assemble(
        inner,
        SpecialInfo {
            bos_id: None,
            eos_ids: vec![TINY_EOS_ID],
            chat_template: Some(TINY_CHAT_TEMPLATE.to_string()),
            add_bos: false,
        },
        &merges,
    )
    .expect("the tiny tokenizer assembles")
}

/// The tiny tokenizer, in memory (what [`write_tiny_tokenizer`] writes, loaded back).
pub fn tiny_tokenizer() -> TextTokenizer {
    tiny(false)
}

/// The tiny variant tokenizer, in memory (what [`write_tiny_tokenizer_variant`] writes).
pub fn tiny_tokenizer_variant() -> TextTokenizer {
    tiny(true)
}

fn write(dir: &Path, variant: bool) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    tiny_inner(variant)
        .0
        .save(dir.join("tokenizer.json"), true)
        .map_err(std::io::Error::other)?;
    let config = serde_json::json!({
        "chat_template": TINY_CHAT_TEMPLATE,
        "eos_token": SPECIAL_TOKENS[2],
        "pad_token": SPECIAL_TOKENS[0],
        "bos_token": null,
        "add_bos_token": false,
    });
    let text = serde_json::to_string_pretty(&config).map_err(std::io::Error::other)?;
    std::fs::write(dir.join("tokenizer_config.json"), text)
}

/// Write the tiny byte-level BPE `tokenizer.json` and a `tokenizer_config.json` (ChatML chat
/// template, EOS `<|im_end|>`) into `dir` (created if needed).
pub fn write_tiny_tokenizer(dir: &Path) -> std::io::Result<()> {
    write(dir, false)
}

/// Like [`write_tiny_tokenizer`] with the same vocabulary size and special ids but different
/// merges, hence a different fingerprint.
pub fn write_tiny_tokenizer_variant(dir: &Path) -> std::io::Result<()> {
    write(dir, true)
}

/// The `tokenizer.*` GGUF metadata of the tiny tokenizer (or its variant), for tests that write
/// tiny GGUF models: `TextTokenizer::from_gguf` on such a file gives the tiny tokenizer.
pub fn tiny_tokenizer_gguf_metadata(variant: bool) -> Vec<(String, Value)> {
    let (tokens, types, merges) = tiny_parts(variant);
    let strings = |v: Vec<String>| Value::Array(v.into_iter().map(Value::String).collect());
    vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("qwen2".into())),
        ("tokenizer.ggml.tokens".into(), strings(tokens)),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(types.into_iter().map(Value::I32).collect()),
        ),
        (
            "tokenizer.ggml.merges".into(),
            strings(
                merges
                    .into_iter()
                    .map(|(a, b)| format!("{a} {b}"))
                    .collect(),
            ),
        ),
        (
            "tokenizer.ggml.eos_token_id".into(),
            Value::U32(TINY_EOS_ID),
        ),
        (
            "tokenizer.ggml.padding_token_id".into(),
            Value::U32(TINY_ENDOFTEXT_ID),
        ),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
        (
            "tokenizer.chat_template".into(),
            Value::String(TINY_CHAT_TEMPLATE.into()),
        ),
    ]
}

//! Rebuilding a Hugging Face tokenizer from a GGUF file's `tokenizer.*` metadata.
//!
//! A GGUF carries the vocabulary (`tokenizer.ggml.tokens`), the BPE merges, token types and
//! special ids, but not the pre-tokenizer: llama.cpp only records a name (`tokenizer.ggml.pre`)
//! and hard-codes the split rule for each name. The same names map here to the split rules of the
//! models' original `tokenizer.json` files, so that encoding matches the tokenizer the model was
//! trained with (which is also what the draft/target agreement check relies on):
//!
//! | `pre` | split | as in |
//! |---|---|---|
//! | `qwen2`, `deepseek-r1-qwen`, `megrez` | Qwen2 regex (single digits), NFC normalizer | Qwen2.5 tokenizer.json |
//! | `stablelm2` | Qwen2 regex | |
//! | `llama3`, `llama-v3`, `llama-bpe`, `falcon3` | Llama 3 regex (digits in 1–3), `ignore_merges` | Llama 3 tokenizer.json |
//! | `dbrx`, `smaug-bpe` | Llama 3 regex | |
//! | `smollm`, `starcoder`, `refact`, `command-r`, `codeshell`, `exaone`, `minerva-7b` | single digits, then GPT-2's regex | SmolLM2 tokenizer.json |
//! | `default`, `gpt-2`, `mpt`, `olmo`, `jais`, `phi-2`, `roberta-bpe` | GPT-2's regex | GPT-2 |
//!
//! Any other `pre` is refused rather than guessed: a slightly wrong split silently degrades a
//! model. After the split, a `ByteLevel` pre-tokenizer (no prefix space, no regex of its own)
//! maps bytes to the byte-level alphabet the vocabulary is spelled in, and the `ByteLevel`
//! decoder maps them back. Tokens typed control (3) become special added tokens, user-defined
//! (4) plain added tokens, so both are matched whole in the input text.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

use super::{Merges, SpecialInfo, TokenizerError};

/// Qwen2's split: like Llama 3's but every digit is its own piece.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Llama 3's split: numbers in groups of up to three digits.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GGUF token types (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// How text is split into pieces before BPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SplitRule {
    /// A `Split` regex (isolated matches), then byte-level mapping without a regex.
    Regex {
        pattern: &'static str,
        /// Apply Unicode NFC first (Qwen2's tokenizer.json does).
        nfc: bool,
        /// Take a whole piece that is itself in the vocabulary without merging (Llama 3).
        ignore_merges: bool,
        /// Prepend BOS when the file does not say (llama.cpp's default for Llama 3).
        default_add_bos: bool,
    },
    /// GPT-2's built-in byte-level regex, optionally after splitting digits one by one.
    Gpt2 { individual_digits: bool },
}

impl SplitRule {
    /// The rule for a `tokenizer.ggml.pre` value; `None` for names not known here.
    pub(super) fn for_pre(pre: &str) -> Option<Self> {
        let regex = |pattern, nfc, ignore_merges, default_add_bos| SplitRule::Regex {
            pattern,
            nfc,
            ignore_merges,
            default_add_bos,
        };
        Some(match pre {
            "qwen2" | "deepseek-r1-qwen" | "megrez" => regex(QWEN2_SPLIT, true, false, false),
            "stablelm2" => regex(QWEN2_SPLIT, false, false, false),
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" => {
                regex(LLAMA3_SPLIT, false, true, true)
            }
            "dbrx" | "smaug-bpe" => regex(LLAMA3_SPLIT, false, false, false),
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone"
            | "minerva-7b" => SplitRule::Gpt2 {
                individual_digits: true,
            },
            "default" | "gpt-2" | "gpt2" | "mpt" | "olmo" | "jais" | "phi-2" | "roberta-bpe" => {
                SplitRule::Gpt2 {
                    individual_digits: false,
                }
            }
            _ => return None,
        })
    }

    fn default_add_bos(self) -> bool {
        matches!(
            self,
            SplitRule::Regex {
                default_add_bos: true,
                ..
            }
        )
    }
}

/// GPT-2's byte → printable character table: the alphabet byte-level BPE vocabularies are
/// spelled in (space is `Ġ`, newline `Ċ`).
pub(super) fn byte_alphabet() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        table[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(next).expect("256..=323 are valid chars");
            next += 1;
            c
        };
    }
    table
}

/// Everything needed to build a byte-level BPE tokenizer.
pub(super) struct ByteLevelSpec<'a> {
    /// Token strings in id order, in the byte-level alphabet (special tokens as their text).
    pub tokens: &'a [String],
    /// GGUF token types per id (1 normal, 3 control, 4 user-defined, ...); `None`: all normal.
    pub token_types: Option<&'a [i32]>,
    /// Merges in rank order.
    pub merges: Merges,
    pub rule: SplitRule,
    /// Prepend this BOS token (text, id) when encoding with special tokens.
    pub add_bos: Option<(String, u32)>,
}

/// Build a byte-level BPE tokenizer (also used by [`super::testing`]); also returns the merges
/// as the model has them (spelling fixed like the vocabulary), for the fingerprint.
pub(super) fn build_byte_level(spec: ByteLevelSpec<'_>) -> Result<(Tokenizer, Merges), String> {
    let alphabet = byte_alphabet();
    let in_alphabet = |s: &str| s.chars().all(|c| alphabet.contains(&c));
    let respell = |s: &str| s.bytes().map(|b| alphabet[b as usize]).collect::<String>();
    let type_of = |id: usize| {
        spec.token_types
            .and_then(|t| t.get(id).copied())
            .unwrap_or(1)
    };

    let mut vocab = Vocab::default();
    let mut duplicates = 0usize;
    for (id, token) in spec.tokens.iter().enumerate() {
        let ty = type_of(id);
        let special = ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED;
        // A normal token outside the byte alphabet is stored as raw text; spell it the way the
        // byte-level pre-tokenizer will produce it, or it could never be matched.
        let key = if special || in_alphabet(token) {
            token.clone()
        } else {
            respell(token)
        };
        if vocab.contains_key(&key) {
            duplicates += 1;
            continue;
        }
        vocab.insert(key, id as u32);
    }
    if duplicates > 0 {
        tracing::warn!("{duplicates} duplicate token strings in the vocabulary; kept the first");
    }

    let merges: Vec<(String, String)> = spec
        .merges
        .into_iter()
        .map(|(a, b)| {
            let fix = |s: String| {
                if vocab.contains_key(&s) {
                    s
                } else {
                    respell(&s)
                }
            };
            (fix(a), fix(b))
        })
        .collect();

    let ignore_merges = matches!(
        spec.rule,
        SplitRule::Regex {
            ignore_merges: true,
            ..
        }
    );
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges.clone())
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| format!("cannot build the BPE model: {e}"))?;

    let mut tokenizer = Tokenizer::new(bpe);
    let byte_level = ByteLevel::new(false, false, false);
    let pre: PreTokenizerWrapper = match spec.rule {
        SplitRule::Regex { pattern, nfc, .. } => {
            if nfc {
                tokenizer.with_normalizer(Some(NFC));
            }
            let split = Split::new(
                SplitPattern::Regex(pattern.to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| format!("bad split regex: {e}"))?;
            Sequence::new(vec![split.into(), byte_level.into()]).into()
        }
        SplitRule::Gpt2 { individual_digits } => {
            let gpt2 = ByteLevel::new(false, false, true);
            if individual_digits {
                Sequence::new(vec![Digits::new(true).into(), gpt2.into()]).into()
            } else {
                gpt2.into()
            }
        }
    };
    tokenizer.with_pre_tokenizer(Some(pre));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));

    let mut special = Vec::new();
    let mut user_defined = Vec::new();
    for (id, token) in spec.tokens.iter().enumerate() {
        match type_of(id) {
            TOKEN_TYPE_CONTROL => special.push(AddedToken::from(token.clone(), true)),
            TOKEN_TYPE_USER_DEFINED => {
                user_defined.push(AddedToken::from(token.clone(), false).normalized(false))
            }
            _ => {}
        }
    }
    tokenizer.add_special_tokens(&special);
    tokenizer.add_tokens(&user_defined);

    if let Some((bos, bos_id)) = spec.add_bos {
        let template = TemplateProcessing::builder()
            .try_single(format!("{bos}:0 $A:0"))
            .and_then(|b| b.try_pair(format!("{bos}:0 $A:0 {bos}:1 $B:1")))
            .map_err(|e| format!("bad BOS template: {e}"))?
            .special_tokens(vec![(bos, bos_id)])
            .build()
            .map_err(|e| format!("bad BOS template: {e}"))?;
        tokenizer.with_post_processor(Some(template));
    }
    Ok((tokenizer, merges))
}

/// The metadata of a GGUF file (the header only; tensor data is not read).
pub(super) fn read_metadata(path: &Path) -> Result<HashMap<String, Value>, TokenizerError> {
    let file = std::fs::File::open(path).map_err(|e| TokenizerError::io(path, e))?;
    let mut reader = std::io::BufReader::new(file);
    let content = Content::read(&mut reader)
        .map_err(|e| TokenizerError::invalid(path, format!("not a readable GGUF file: {e}")))?;
    Ok(content.metadata)
}

/// Any GGUF integer value (ids and types are stored with varying widths across files).
fn as_int(v: &Value) -> Option<i128> {
    Some(match v {
        Value::U8(x) => (*x).into(),
        Value::I8(x) => (*x).into(),
        Value::U16(x) => (*x).into(),
        Value::I16(x) => (*x).into(),
        Value::U32(x) => (*x).into(),
        Value::I32(x) => (*x).into(),
        Value::U64(x) => (*x).into(),
        Value::I64(x) => (*x).into(),
        _ => return None,
    })
}

fn as_u32(v: &Value) -> Option<u32> {
    as_int(v).and_then(|n| u32::try_from(n).ok())
}

fn as_i32(v: &Value) -> Option<i32> {
    as_int(v).and_then(|n| i32::try_from(n).ok())
}

fn get_str<'a>(md: &'a HashMap<String, Value>, key: &str) -> Option<&'a str> {
    match md.get(key) {
        Some(Value::String(s)) => Some(s),
        _ => None,
    }
}

fn get_string_array(
    path: &Path,
    md: &HashMap<String, Value>,
    key: &str,
) -> Result<Option<Vec<String>>, TokenizerError> {
    let Some(v) = md.get(key) else {
        return Ok(None);
    };
    let Value::Array(items) = v else {
        return Err(TokenizerError::invalid(
            path,
            format!("{key} is not an array"),
        ));
    };
    items
        .iter()
        .map(|x| match x {
            Value::String(s) => Ok(s.clone()),
            _ => Err(TokenizerError::invalid(
                path,
                format!("{key} holds a non-string"),
            )),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// Special ids, BOS policy and chat template from the metadata.
pub(super) fn special_info(
    path: &Path,
    md: &HashMap<String, Value>,
) -> Result<SpecialInfo, TokenizerError> {
    let id = |key: &str| md.get(key).and_then(as_u32);
    let mut eos_ids = Vec::new();
    for key in [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ] {
        eos_ids.extend(id(key));
    }
    let rule = get_str(md, "tokenizer.ggml.pre").and_then(SplitRule::for_pre);
    let add_bos = match md.get("tokenizer.ggml.add_bos_token") {
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(TokenizerError::invalid(
                path,
                "tokenizer.ggml.add_bos_token is not a bool",
            ))
        }
        None => rule.is_some_and(SplitRule::default_add_bos),
    };
    Ok(SpecialInfo {
        bos_id: id("tokenizer.ggml.bos_token_id"),
        eos_ids,
        chat_template: get_str(md, "tokenizer.chat_template").map(str::to_owned),
        add_bos,
    })
}

/// The tokenizer, special info and merges described by a GGUF file's metadata.
pub(super) fn build(
    path: &Path,
    md: &HashMap<String, Value>,
) -> Result<(Tokenizer, SpecialInfo, Merges), TokenizerError> {
    let model = get_str(md, "tokenizer.ggml.model").ok_or_else(|| {
        TokenizerError::invalid(
            path,
            "no tokenizer.ggml.model key: the file has no tokenizer",
        )
    })?;
    match model {
        "gpt2" => {}
        "llama" => {
            return Err(TokenizerError::Unsupported(format!(
                "{}: SentencePiece ('llama') GGUF tokenizers are not supported; put the model's \
                 tokenizer.json next to the .gguf file",
                path.display()
            )))
        }
        other => {
            return Err(TokenizerError::Unsupported(format!(
                "{}: GGUF tokenizer model '{other}' (only byte-level BPE, 'gpt2', is supported)",
                path.display()
            )))
        }
    }
    let pre = get_str(md, "tokenizer.ggml.pre").unwrap_or("default");
    let rule = SplitRule::for_pre(pre).ok_or_else(|| {
        TokenizerError::Unsupported(format!(
            "{}: unknown pre-tokenizer tokenizer.ggml.pre = '{pre}'",
            path.display()
        ))
    })?;

    let tokens = get_string_array(path, md, "tokenizer.ggml.tokens")?
        .ok_or_else(|| TokenizerError::invalid(path, "no tokenizer.ggml.tokens"))?;
    let token_types: Option<Vec<i32>> = match md.get("tokenizer.ggml.token_type") {
        Some(Value::Array(items)) => Some(
            items
                .iter()
                .map(|v| {
                    as_i32(v).ok_or_else(|| {
                        TokenizerError::invalid(
                            path,
                            "tokenizer.ggml.token_type holds a non-integer",
                        )
                    })
                })
                .collect::<Result<_, _>>()?,
        ),
        Some(_) => {
            return Err(TokenizerError::invalid(
                path,
                "tokenizer.ggml.token_type is not an array",
            ))
        }
        None => None,
    };
    if token_types
        .as_ref()
        .is_some_and(|t| t.len() != tokens.len())
    {
        return Err(TokenizerError::invalid(
            path,
            "tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length",
        ));
    }
    let merges = get_string_array(path, md, "tokenizer.ggml.merges")?
        .ok_or_else(|| TokenizerError::invalid(path, "no tokenizer.ggml.merges"))?
        .into_iter()
        .map(|m| match m.split_once(' ') {
            Some((a, b)) => Ok((a.to_string(), b.to_string())),
            None => Err(TokenizerError::invalid(
                path,
                format!("malformed merge '{m}'"),
            )),
        })
        .collect::<Result<Vec<_>, _>>()?;

    let info = special_info(path, md)?;
    for (what, id) in info
        .bos_id
        .iter()
        .map(|id| ("BOS", id))
        .chain(info.eos_ids.iter().map(|id| ("EOS", id)))
    {
        if *id as usize >= tokens.len() {
            return Err(TokenizerError::invalid(
                path,
                format!(
                    "{what} id {id} is outside the vocabulary ({})",
                    tokens.len()
                ),
            ));
        }
    }
    let add_bos = match (info.add_bos, info.bos_id) {
        (true, Some(id)) => Some((tokens[id as usize].clone(), id)),
        _ => None,
    };
    let (tokenizer, merges) = build_byte_level(ByteLevelSpec {
        tokens: &tokens,
        token_types: token_types.as_deref(),
        merges,
        rule,
        add_bos,
    })
    .map_err(|e| TokenizerError::invalid(path, e))?;
    Ok((tokenizer, info, merges))
}

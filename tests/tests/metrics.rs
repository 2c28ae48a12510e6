//! The Prometheus endpoints after a real generation through both services.

use sequoia_server::metrics::{self, ALL};
use sequoia_tests::*;
use std::time::Duration;

use sequoia_tests::series_value as value;

#[test]
fn metrics_endpoints_report_a_generation() {
    let pair = TinyPair::new();
    let mut vc = verify_config(&pair.target);
    vc.metrics_listen = "127.0.0.1:0".into();
    let verify = start_verify(vc);
    let mut dc = draft_config(&pair.draft, &[verify.url()], 8, 4);
    dc.metrics_listen = "127.0.0.1:0".into();
    let draft = start_draft(dc);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let got = rt
        .block_on(within(
            60,
            generate(&draft.url(), request("hello world", 24, 0.0, 1)),
        ))
        .unwrap();
    let summary = got.summary.expect("summary");

    let v = rt.block_on(scrape(verify.metrics.expect("verify metrics on")));
    let d = rt.block_on(scrape(draft.metrics.expect("draft metrics on")));
    for (text, service) in [(&v, "verify-service"), (&d, "draft-service")] {
        for name in ALL {
            assert!(text.contains(name), "{service}: {name} missing");
        }
        let s = format!("{{service=\"{service}\"}}");
        let at = |name: &str| value(text, &format!("{name}{s}")).unwrap_or(-1.0);
        assert_eq!(at(metrics::REQUESTS), 1.0, "{service}");
        assert_eq!(at(metrics::STEPS), summary.steps as f64, "{service}");
        let count = format!("{}_count", metrics::TOKENS_PER_STEP);
        assert_eq!(at(&count), summary.steps as f64, "{service}");
        let count = format!("{}_count", metrics::VERIFY_LATENCY);
        assert_eq!(at(&count), summary.steps as f64, "{service}");
        assert_eq!(at(metrics::QUEUE_DEPTH), 0.0, "{service}");
        let rank1 = format!(
            "{}{{service=\"{service}\",rank=\"1\"}}",
            metrics::ACCEPTED_BY_RANK
        );
        assert!(value(text, &rank1).is_some(), "{service}: {rank1}");
    }
    // The draft reports what the client was sent; the verify node may have verified a few
    // tokens past a stop or the length limit.
    let tokens = |text: &str, svc: &str| {
        value(
            text,
            &format!("{}{{service=\"{svc}\"}}", metrics::GENERATED_TOKENS),
        )
        .unwrap()
    };
    assert_eq!(tokens(&d, "draft-service"), summary.generated_tokens as f64);
    assert!(tokens(&v, "verify-service") >= summary.generated_tokens as f64);
    let failovers = format!("{}{{service=\"draft-service\"}}", metrics::FAILOVERS);
    assert_eq!(value(&d, &failovers), Some(0.0));

    // Sessions end with the stream: both gauges return to 0.
    for (addr, svc) in [
        (verify.metrics, "verify-service"),
        (draft.metrics, "draft-service"),
    ] {
        let series = format!("{}{{service=\"{svc}\"}}", metrics::ACTIVE_SESSIONS);
        let idle = rt.block_on(within(10, async {
            loop {
                if value(&scrape(addr.unwrap()).await, &series) == Some(0.0) {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }));
        assert!(idle, "{svc}");
    }
}

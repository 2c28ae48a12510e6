//! TLS, mutual TLS and bearer tokens end to end: in-process services on 127.0.0.1 with
//! certificates made by the test (rcgen).

use sequoia_server::security::{client_tls, BearerToken, ClientSecurity};
use sequoia_tests::*;
use std::path::Path;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const NONE: &str = "";

fn client(ca: &Path, token: &str) -> ClientSecurity {
    ClientSecurity {
        tls: Some(client_tls(ca, Path::new(NONE), Path::new(NONE), NONE).unwrap()),
        token: BearerToken::new(token, Path::new(NONE)).unwrap(),
    }
}

/// grpc.health.v1 status of `service` at `url` ("" = the whole server), without a token.
async fn health(url: &str, security: &ClientSecurity, service: &str) -> Result<i32, tonic::Status> {
    let channel = security
        .endpoint(url)
        .unwrap()
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(format!("{e:?}")))?;
    let reply = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await?;
    Ok(reply.into_inner().status)
}

/// The public service over TLS with tokens: plaintext to the TLS port fails, a missing or bad
/// token is UNAUTHENTICATED with a message saying what to send, a good token works, an
/// untrusted server certificate is refused, and health checks need no token.
#[test]
fn tls_and_tokens_on_the_generation_service() {
    let pair = TinyPair::new();
    let pki = TestPki::new();
    let verify = start_verify(verify_config(&pair.target));
    let mut config = draft_config(&pair.draft, &[verify.url()], 4, 3);
    config.tls_cert = pki.server_cert.clone();
    config.tls_key = pki.server_key.clone();
    config.auth_tokens = vec!["good-token".into()];
    let draft = start_draft(config);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let req = || request("hello world", 8, 0.0, 1);
    let call = |url: String, security: ClientSecurity| {
        rt.block_on(within(60, generate_with(&url, &security, req())))
    };

    let plain = call(draft.url(), ClientSecurity::default()).unwrap_err();
    assert_ne!(plain.code(), Code::Unauthenticated, "{plain:?}");

    let no_token = call(draft.https_url(), client(&pki.ca, "")).unwrap_err();
    assert_eq!(no_token.code(), Code::Unauthenticated, "{no_token:?}");
    assert!(no_token.message().contains("missing bearer token"));
    assert!(no_token.message().contains("--token"));

    let bad = call(draft.https_url(), client(&pki.ca, "wrong")).unwrap_err();
    assert_eq!(bad.code(), Code::Unauthenticated, "{bad:?}");
    assert!(bad.message().contains("invalid bearer token"));

    let untrusted = call(draft.https_url(), client(Path::new(NONE), "good-token")).unwrap_err();
    assert_eq!(untrusted.code(), Code::Unavailable, "{untrusted:?}");

    let good = call(draft.https_url(), client(&pki.ca, "good-token")).unwrap();
    assert_eq!(good.tokens, plain_greedy(&pair.target, "hello world", 8));

    let status = rt
        .block_on(within(
            30,
            health(&draft.https_url(), &client(&pki.ca, ""), ""),
        ))
        .unwrap();
    assert_eq!(status, ServingStatus::Serving as i32);
}

/// Draft → verify with mutual TLS and a token: works with the CA-signed client certificate;
/// without a client certificate, with one from another CA, or with a wrong token the generation
/// fails naming the node. The plaintext probe endpoint answers health checks meanwhile.
#[test]
fn mutual_tls_between_draft_and_verify() {
    let pair = TinyPair::new();
    let pki = TestPki::new();
    let probe_addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let mut vc = verify_config(&pair.target);
    vc.tls_cert = pki.server_cert.clone();
    vc.tls_key = pki.server_key.clone();
    vc.tls_client_ca = pki.ca.clone();
    vc.auth_tokens = vec!["draft-secret".into()];
    vc.health_listen = probe_addr.clone();
    let verify = start_verify(vc);
    let rt = tokio::runtime::Runtime::new().unwrap();

    let draft_with = |cert: &Path, key: &Path, token: &str| {
        let mut dc = draft_config(&pair.draft, &[verify.https_url()], 4, 3);
        dc.verify_tls_ca = pki.ca.clone();
        dc.verify_tls_cert = cert.to_path_buf();
        dc.verify_tls_key = key.to_path_buf();
        dc.verify_token = token.into();
        start_draft(dc)
    };
    let run = |draft: &Running| {
        rt.block_on(within(
            60,
            generate(&draft.url(), request("hello world", 8, 0.0, 1)),
        ))
    };

    let ok = draft_with(&pki.client_cert, &pki.client_key, "draft-secret");
    let got = run(&ok).unwrap();
    assert_eq!(got.tokens, plain_greedy(&pair.target, "hello world", 8));

    let none = Path::new(NONE);
    for (what, cert, key) in [
        ("no client certificate", none, none),
        (
            "another CA's certificate",
            &*pki.rogue_cert,
            &*pki.rogue_key,
        ),
    ] {
        let err = run(&draft_with(cert, key, "draft-secret")).unwrap_err();
        assert_eq!(err.code(), Code::Unavailable, "{what}: {err:?}");
        // The verify node's address and the TLS detail go to the draft's log only.
        assert!(
            !err.message().contains(&verify.https_url()),
            "{what}: {err:?}"
        );
    }

    let err = run(&draft_with(&pki.client_cert, &pki.client_key, "wrong")).unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("request id"), "{err:?}");

    // Kubernetes probes: plaintext, no certificate, no token.
    let status = rt
        .block_on(within(
            30,
            health(
                &format!("http://{probe_addr}"),
                &ClientSecurity::default(),
                "sequoia.v1.Verifier",
            ),
        ))
        .unwrap();
    assert_eq!(status, ServingStatus::Serving as i32);
}

//! draft-service's OpenAI-compatible HTTP API, driven by the official `openai` Python client,
//! and the playground page in headless Chromium (Selenium), against a real service pair on the
//! small default model (SmolLM2-135M as draft and target: fast on a shared CI machine; the
//! exactness checks do not depend on the pair).
//!
//! The Python side lives in `tests/http/` and runs with pytest from a virtualenv that `.ci/run`
//! creates (`$SEQUOIA_HTTP_VENV`, default `~/.cache/sequoia/venv-http`); Chromium and its driver
//! come from Debian. A missing piece fails the test with the command that installs it.

use sequoia_engine::tokenizer::{ChatMessage as Msg, TextTokenizer};
use sequoia_engine::{LoadOptions, Model};
use sequoia_models::{ensure_model, SMOLLM2_135M};
use sequoia_proto::v1::{ChatMessage, GenerateRequest};
use sequoia_server::security::{BearerToken, ClientSecurity};
use sequoia_tests::*;
use std::path::{Path, PathBuf};
use std::process::Command;

const TOKEN: &str = "http-test-token";
const MAX_TOKENS: u32 = 24;
const CHAT_PROMPT: &str = "Name three trees that grow in Europe.";
const RAW_PROMPT: &str = "The tallest trees on Earth are";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

const SETUP: &str = "run .ci/run once, or: python3 -m venv ~/.cache/sequoia/venv-http && \
     ~/.cache/sequoia/venv-http/bin/pip install openai selenium pytest \
     (Debian: apt-get install -y python3-venv chromium chromium-driver)";

/// The virtualenv's python, checked to import everything the scripts use.
fn venv_python() -> PathBuf {
    let venv = std::env::var_os("SEQUOIA_HTTP_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME is set"))
                .join(".cache/sequoia/venv-http")
        });
    let python = venv.join("bin/python");
    let ok = Command::new(&python)
        .args(["-c", "import openai, selenium, pytest"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "{} cannot import openai, selenium, pytest: {SETUP}",
        python.display()
    );
    python
}

/// Chromium and chromedriver, given to Selenium explicitly (it would otherwise try to download
/// them, and CI machines have no internet).
fn chromium() -> (PathBuf, PathBuf) {
    let path = |var: &str, default: &str| {
        std::env::var_os(var)
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(default))
    };
    let browser = path("SEQUOIA_CHROMIUM", "/usr/bin/chromium");
    let driver = path("SEQUOIA_CHROMEDRIVER", "/usr/bin/chromedriver");
    for p in [&browser, &driver] {
        assert!(
            p.exists(),
            "{} is missing: apt-get update && apt-get install -y chromium chromium-driver \
             (or set SEQUOIA_CHROMIUM / SEQUOIA_CHROMEDRIVER)",
            p.display()
        );
    }
    (browser, driver)
}

/// Run pytest on `files` (under tests/http/) with `env`; fail with its output.
fn pytest(python: &Path, files: &[&str], env: &[(&str, String)]) {
    let out = Command::new(python)
        .current_dir(repo())
        .args(["-m", "pytest", "-v", "-p", "no:cacheprovider", "-s"])
        .args(files.iter().map(|f| format!("tests/http/{f}")))
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .output()
        .expect("pytest starts");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{text}");
    assert!(out.status.success(), "pytest failed:\n{text}");
}

/// One pair, every check: the openai client (chat and completions, streamed and not, stop
/// strings, budgets, seeds, every error case, cancellation on disconnect, metrics), with the
/// greedy texts compared against gRPC `Generate` and the target alone; then the playground.
#[test]
fn openai_client_and_playground_against_a_real_pair() {
    let python = venv_python();
    let (browser, driver) = chromium();
    let model = ensure_model(SMOLLM2_135M).expect("fetching the default small model");

    let mut vcfg = verify_config(&model);
    vcfg.metrics_listen = "127.0.0.1:0".into();
    let verify = start_verify(vcfg);
    let mut cfg = draft_config(&model, &[verify.url()], 4, 3);
    cfg.step_timeout_secs = 600.0; // a shared 2-core CI machine can be slow
    cfg.auth_tokens = vec![TOKEN.into()];
    // One slot: the 429 and the disconnect checks rely on it.
    cfg.max_sessions = 1;
    cfg.metrics_listen = "127.0.0.1:0".into();
    let pair = start_draft(cfg);
    let http = pair.http.expect("the HTTP API listens");

    // The references: gRPC Generate at T = 0, checked here against the target alone.
    let security = ClientSecurity {
        tls: None,
        token: BearerToken::new(TOKEN, Path::new("")).unwrap(),
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let chat = GenerateRequest {
        messages: vec![ChatMessage {
            role: "user".into(),
            content: CHAT_PROMPT.into(),
        }],
        ..request("", MAX_TOKENS, 0.0, 0)
    };
    let grpc_chat = rt
        .block_on(within(600, generate_with(&pair.url(), &security, chat)))
        .expect("gRPC chat generation");
    let grpc_raw = rt
        .block_on(within(
            600,
            generate_with(
                &pair.url(),
                &security,
                request(RAW_PROMPT, MAX_TOKENS, 0.0, 0),
            ),
        ))
        .expect("gRPC raw generation");

    let target = Model::load(&model, &LoadOptions::default()).unwrap();
    let tok = TextTokenizer::load_for_model(&model).unwrap();
    let templated = tok
        .apply_chat_template(&[Msg::user(CHAT_PROMPT)], true)
        .unwrap();
    let (alone_chat, _) = plain_greedy_ids(
        &target,
        tok.eos_ids(),
        &tok.encode(&templated, false).unwrap(),
        MAX_TOKENS as usize,
    );
    let (alone_raw, _) = plain_greedy_ids(
        &target,
        tok.eos_ids(),
        &tok.encode(RAW_PROMPT, true).unwrap(),
        MAX_TOKENS as usize,
    );
    assert_eq!(
        grpc_chat.tokens, alone_chat,
        "gRPC chat vs the target alone"
    );
    assert_eq!(grpc_raw.tokens, alone_raw, "gRPC raw vs the target alone");
    let alone_chat_text = tok.decode(&alone_chat, true).unwrap();
    let alone_raw_text = tok.decode(&alone_raw, true).unwrap();
    assert_eq!(grpc_chat.text, alone_chat_text);
    assert_eq!(grpc_raw.text, alone_raw_text);
    eprintln!(
        "reference chat text: {:?}\nreference raw text: {:?}",
        grpc_chat.text, grpc_raw.text
    );

    let expected = serde_json::json!({
        "target_model": target.info().name,
        "max_tokens": MAX_TOKENS,
        "chat_prompt": CHAT_PROMPT,
        "chat_text": grpc_chat.text,
        "raw_prompt": RAW_PROMPT,
        "raw_text": grpc_raw.text,
        "max_context": 1024,
    });
    let dir = tempfile::tempdir().unwrap();
    let expected_file = dir.path().join("expected.json");
    std::fs::write(&expected_file, expected.to_string()).unwrap();
    let artifacts = repo().join("target/test-artifacts");
    std::fs::create_dir_all(&artifacts).unwrap();
    let env = vec![
        ("SEQUOIA_HTTP_URL", format!("http://{http}")),
        ("SEQUOIA_HTTP_TOKEN", TOKEN.to_string()),
        ("SEQUOIA_EXPECTED", expected_file.display().to_string()),
        (
            "SEQUOIA_DRAFT_METRICS",
            format!("http://{}/metrics", pair.metrics.unwrap()),
        ),
        (
            "SEQUOIA_VERIFY_METRICS",
            format!("http://{}/metrics", verify.metrics.unwrap()),
        ),
        ("SEQUOIA_VERIFY_ADDR", verify.addr.to_string()),
        ("SEQUOIA_CHROMIUM", browser.display().to_string()),
        ("SEQUOIA_CHROMEDRIVER", driver.display().to_string()),
        ("SEQUOIA_ARTIFACTS", artifacts.display().to_string()),
    ];
    pytest(&python, &["test_openai.py", "test_playground.py"], &env);
    let shot = artifacts.join("playground.png");
    assert!(
        std::fs::metadata(&shot).is_ok_and(|m| m.len() > 0),
        "no screenshot at {}",
        shot.display()
    );
    eprintln!("playground screenshot: {}", shot.display());
}

/// The HTTP port speaks TLS with the gRPC port's certificate and token settings; and with no
/// verify node reachable, `/health` and generations answer 503 with a reason code and
/// `Retry-After`, never an address. Tiny random models: these checks need no real text.
#[test]
fn tls_and_unreachable_verify_nodes() {
    let python = venv_python();
    let models = TinyPair::new();
    let pki = TestPki::new();
    let verify = start_verify(verify_config(&models.target));
    let mut cfg = draft_config(&models.draft, &[verify.url()], 4, 3);
    cfg.tls_cert = pki.server_cert.clone();
    cfg.tls_key = pki.server_key.clone();
    cfg.auth_tokens = vec![TOKEN.into()];
    let tls_pair = start_draft(cfg);

    // A port nothing listens on (bound, then released).
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut cfg = draft_config(&models.draft, &[format!("http://{dead}")], 4, 3);
    cfg.connect_timeout_secs = 1.0;
    let orphan = start_draft(cfg);

    let env = vec![
        (
            "SEQUOIA_TLS_URL",
            format!("https://127.0.0.1:{}", tls_pair.http.unwrap().port()),
        ),
        ("SEQUOIA_TLS_CA", pki.ca.display().to_string()),
        ("SEQUOIA_HTTP_TOKEN", TOKEN.to_string()),
        (
            "SEQUOIA_ORPHAN_URL",
            format!("http://{}", orphan.http.unwrap()),
        ),
        ("SEQUOIA_DEAD_ADDR", dead.to_string()),
    ];
    pytest(&python, &["test_tls_unavailable.py"], &env);
}

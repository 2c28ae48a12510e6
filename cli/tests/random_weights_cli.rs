//! `sequoia engine-bench --random-weights` and `sequoia tree profile --random-weights`: cost
//! measurements without any model file (the tiny shape keeps this fast; the real shapes only
//! differ in size).

use std::process::Command;

fn sequoia(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_sequoia"))
        .args(args)
        .env("SEQUOIA_MODELS", "/nonexistent/no-downloads-here")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "sequoia {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn engine_bench_runs_on_random_weights() {
    let out = sequoia(&[
        "engine-bench",
        "--random-weights",
        "tiny",
        "--sizes",
        "1,4,9",
        "--repeats",
        "1",
        "--decode-tokens",
        "2",
        "--context",
        "8",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["random_weights"], "tiny");
    assert_eq!(v["weights"], "Q4KM");
    assert_eq!(v["device"], "cpu");
    assert_eq!(v["batch_invariant"], true);
    let t = v["t"].as_array().unwrap();
    let ns: Vec<u64> = t.iter().map(|r| r["n"].as_u64().unwrap()).collect();
    assert_eq!(ns, [1, 4, 9]);
    assert!(t.iter().all(|r| r["ms_median"].as_f64().unwrap() > 0.0));
}

#[test]
fn engine_bench_rejects_unknown_shapes() {
    let out = Command::new(env!("CARGO_BIN_EXE_sequoia"))
        .args(["engine-bench", "--random-weights", "qwen9-huge"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("qwen2.5-7b"),
        "lists the known shapes"
    );
}

#[test]
fn tree_profile_runs_on_random_weights() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("profile.json");
    sequoia(&[
        "tree",
        "profile",
        "--random-weights",
        "--random-format",
        "q8_0",
        "--target",
        "tiny",
        "--draft",
        "tiny",
        "--max-nodes",
        "8",
        "--repeats",
        "1",
        "--context",
        "8",
        "--out",
        path.to_str().unwrap(),
    ]);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(
        v["verify"]["ms"].as_array().unwrap().len(),
        6,
        "sizes 1,2,3,4,6,8"
    );
    assert!(!v["draft"]["ms"].as_array().unwrap().is_empty());
    assert!(v["note"].as_str().unwrap().contains("random tiny (q8_0)"));
}

//! The services under test: spawned here like `sequoia demo` (optionally with a delay proxy
//! between them) or reached at given addresses, as in the two-host emulation.

use super::*;

/// Services started by the bench (stopped when dropped).
pub(super) struct Spawned {
    pub(super) _services: Vec<Service>,
    pub(super) proxy_stop: Option<tokio::sync::oneshot::Sender<()>>,
    pub(super) draft_url: String,
    pub(super) baseline_url: String,
}

impl Drop for Spawned {
    fn drop(&mut self) {
        if let Some(tx) = self.proxy_stop.take() {
            let _ = tx.send(());
        }
    }
}

pub(super) fn spawn_services(args: &BenchArgs, rt: &tokio::runtime::Runtime) -> Result<Spawned> {
    let draft = crate::engine_cmds::resolve_model(&args.draft)?;
    let target = crate::engine_cmds::resolve_model(&args.target)?;
    let logs = args.out_dir.join("logs");
    std::fs::create_dir_all(&logs)?;
    let threads = |t: Option<usize>| -> Vec<String> {
        t.map(|t| vec!["--threads".into(), t.to_string()])
            .unwrap_or_default()
    };
    let vport = free_port()?;
    let verify_url = format!("http://127.0.0.1:{vport}");
    eprintln!(
        "== starting verify-service ({}) on {verify_url}; logs in {}",
        target.display(),
        logs.display()
    );
    let mut verify_args = vec![
        "--model".into(),
        target.display().to_string(),
        "--listen".into(),
        format!("127.0.0.1:{vport}"),
    ];
    verify_args.extend(threads(args.verify_threads));
    let mut verify = Service::spawn("verify-service", &verify_args, &[], &logs)?;
    rt.block_on(wait_ready(
        &mut verify,
        &verify_url,
        Duration::from_secs(300),
    ))?;
    let mut services = vec![verify];

    // The delay proxy runs on the bench's runtime, between the draft-service and verify.
    let (mut proxy_stop, mut spec_verify_url) = (None, verify_url.clone());
    let mbps = args.two.bandwidth_mbps;
    if args.rtt_ms > 0.0 || mbps > 0.0 {
        let rtt = Duration::from_secs_f64(args.rtt_ms / 1e3);
        let proxy = rt.block_on(sequoia_server::delay_proxy::DelayProxy::bind(
            "127.0.0.1:0",
            &format!("127.0.0.1:{vport}"),
            rtt,
            mbps,
        ))?;
        spec_verify_url = format!("http://{}", proxy.local_addr()?);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        rt.spawn(proxy.run(async move {
            let _ = rx.await;
        }));
        proxy_stop = Some(tx);
        eprintln!(
            "== delay proxy {spec_verify_url} -> {verify_url} adds {} ms round trip{}",
            args.rtt_ms,
            if mbps > 0.0 {
                format!(", {mbps} Mbit/s each way")
            } else {
                String::new()
            }
        );
    }
    let mut start_draft = |name: &'static str, verify: &str, auto: bool| -> Result<String> {
        let port = free_port()?;
        let url = format!("http://127.0.0.1:{port}");
        let mut a = vec![
            "--model".into(),
            draft.display().to_string(),
            "--verify".into(),
            verify.to_string(),
            "--listen".into(),
            format!("127.0.0.1:{port}"),
        ];
        a.extend(threads(args.draft_threads));
        // Benchmarks speak gRPC only; several draft-services must not contend for the HTTP port.
        a.extend(["--http-listen".to_string(), String::new()]);
        let mut env = vec![(
            "SEQUOIA_TREE__MODE",
            if auto { "auto" } else { "fixed" }.into(),
        )];
        if let Some(n) = args.auto_max_nodes {
            env.push(("SEQUOIA_TREE__NODES", n.to_string()));
        }
        eprintln!("== starting {name} on {url} (verify: {verify})");
        // Each draft-service logs into its own folder (the log is named after the binary).
        let dir = logs.join(name);
        std::fs::create_dir_all(&dir)?;
        let mut svc = Service::spawn("draft-service", &a, &env, &dir)?;
        rt.block_on(wait_ready(&mut svc, &url, Duration::from_secs(300)))?;
        services.push(svc);
        Ok(url)
    };
    let draft_url = start_draft("draft-service", &spec_verify_url, true)?;
    let baseline_url = if proxy_stop.is_some() {
        start_draft("baseline-draft-service", &verify_url, false)?
    } else {
        draft_url.clone()
    };
    Ok(Spawned {
        _services: services,
        proxy_stop,
        draft_url,
        baseline_url,
    })
}

pub(super) async fn connect(url: &str) -> Result<GenerationClient<Channel>> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())?
        .connect()
        .await
        .with_context(|| format!("cannot connect to draft-service at {url}"))?;
    Ok(GenerationClient::new(channel))
}

//! Process plumbing of the two service binaries: an async runtime, logging, the listening
//! socket, and serving until SIGTERM (Kubernetes, `kill`) or Ctrl-C.

use anyhow::Context;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

/// Resolves when the process is asked to stop.
pub type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Exit status when a second stop signal cuts the drain short (128 + SIGTERM).
pub const FORCED_EXIT_CODE: i32 = 143;

/// Start a runtime, set up logging, bind `listen`, then run `serve(listener, shutdown)` to the
/// end; `shutdown` resolves on the first SIGTERM or Ctrl-C. A second signal while the service
/// drains exits the process at once: once tokio handles a signal the default action (die) is
/// gone for good, so without this an operator's second `kill` would be silently swallowed.
pub fn run_server<F, Fut>(listen: &str, log_json: bool, serve: F) -> anyhow::Result<()>
where
    F: FnOnce(tokio::net::TcpListener, Shutdown) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    crate::telemetry::init_logging(log_json);
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("cannot listen on {listen}"))?;
        let first = async {
            shutdown_signal().await;
            tokio::spawn(async {
                shutdown_signal().await;
                tracing::warn!("second stop signal while draining: exiting now");
                std::process::exit(FORCED_EXIT_CODE);
            });
        };
        serve(listener, Box::pin(first)).await
    })
}

/// Resolves on the next SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => tokio::select! { _ = ctrl_c => {}, _ = term.recv() => {} },
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM; stopping on Ctrl-C only");
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// Transport settings of a gRPC listener, chosen so that no peer holds a connection, a stream
/// or the shutdown by staying silent.
#[derive(Debug, Clone, Copy)]
pub struct GrpcLimits {
    /// HTTP/2 PING interval on idle connections (and TCP keepalive); a peer that does not
    /// answer a PING within `keepalive_timeout` is disconnected, which ends its streams and
    /// frees whatever they held. Zero = off.
    pub keepalive: Duration,
    pub keepalive_timeout: Duration,
    /// Most concurrent streams (calls) one connection may open; zero = the HTTP/2 default.
    pub max_concurrent_streams: u32,
    /// After `shutdown` resolves, how long open calls may still run before the server stops
    /// and closes every connection.
    pub drain_deadline: Duration,
}

impl Default for GrpcLimits {
    fn default() -> Self {
        Self {
            keepalive: Duration::from_secs(30),
            keepalive_timeout: Duration::from_secs(20),
            max_concurrent_streams: 64,
            drain_deadline: Duration::from_secs(30),
        }
    }
}

/// Seconds from a config as a `Duration`: negative, NaN or infinite values become zero or a
/// year, so no setting can make the process panic.
pub fn secs(s: f64) -> Duration {
    if s.is_nan() || s <= 0.0 {
        Duration::ZERO
    } else {
        Duration::try_from_secs_f64(s).unwrap_or(Duration::from_secs(365 * 24 * 3600))
    }
}

/// Serve `routes` (the service, health, reflection) on `listener` with optional TLS until
/// `shutdown` resolves, then let open calls finish for at most `limits.drain_deadline`: the
/// gRPC host both services share.
pub async fn serve_grpc(
    listener: tokio::net::TcpListener,
    tls: Option<tonic::transport::ServerTlsConfig>,
    routes: tonic::service::Routes,
    shutdown: impl Future<Output = ()>,
    limits: GrpcLimits,
) -> anyhow::Result<()> {
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        server = server.tls_config(tls)?;
    }
    let keepalive = (!limits.keepalive.is_zero()).then_some(limits.keepalive);
    let streams = (limits.max_concurrent_streams > 0).then_some(limits.max_concurrent_streams);
    let (stopping_tx, stopping_rx) = tokio::sync::oneshot::channel::<()>();
    let serving = server
        .tcp_nodelay(true)
        .tcp_keepalive(keepalive)
        .http2_keepalive_interval(keepalive)
        // A PING must be answered before the next one is due: with a short interval a dead or
        // half-open peer is found in about two intervals instead of after the fixed timeout.
        .http2_keepalive_timeout(Some(match keepalive {
            Some(every) => limits.keepalive_timeout.min(every),
            None => limits.keepalive_timeout,
        }))
        .max_concurrent_streams(streams)
        .add_routes(routes)
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            async move {
                shutdown.await;
                let _ = stopping_tx.send(());
            },
        );
    let deadline = async move {
        if stopping_rx.await.is_err() {
            std::future::pending::<()>().await;
        }
        tokio::time::sleep(limits.drain_deadline).await;
    };
    tokio::select! {
        r = serving => r?,
        _ = deadline => tracing::warn!(
            deadline = ?limits.drain_deadline,
            "drain deadline passed with calls still open; closing every connection"
        ),
    }
    Ok(())
}

//! Process plumbing of the two service binaries: an async runtime, logging, the listening
//! socket, and serving until SIGTERM (Kubernetes, `kill`) or Ctrl-C.

use anyhow::Context;
use std::future::Future;
use std::pin::Pin;

/// Resolves when the process is asked to stop.
pub type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Start a runtime, set up logging, bind `listen`, then run `serve(listener, shutdown)` to the
/// end; `shutdown` resolves on the first SIGTERM or Ctrl-C.
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
        serve(listener, Box::pin(shutdown_signal())).await
    })
}

/// Resolves on the first SIGTERM or Ctrl-C.
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

/// Serve `routes` (the service, health, reflection) on `listener` with optional TLS until
/// `shutdown` resolves, then let open calls finish: the gRPC host both services share.
pub async fn serve_grpc(
    listener: tokio::net::TcpListener,
    tls: Option<tonic::transport::ServerTlsConfig>,
    routes: tonic::service::Routes,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = tls {
        server = server.tls_config(tls)?;
    }
    server
        .tcp_nodelay(true)
        .add_routes(routes)
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown,
        )
        .await?;
    Ok(())
}

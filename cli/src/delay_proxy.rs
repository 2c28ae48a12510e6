//! `sequoia net-delay`: serve [`sequoia_server::delay_proxy::DelayProxy`] until SIGINT or
//! SIGTERM, to emulate the round-trip time (and, optionally, the link rate) between a draft host
//! and a verify host where `tc netem` is unavailable.

use anyhow::Result;
use sequoia_server::delay_proxy::DelayProxy;
use sequoia_server::process::shutdown_signal;
use std::time::Duration;

#[derive(clap::Args, Debug, Clone)]
pub struct NetDelayArgs {
    /// Address to accept connections on, e.g. 127.0.0.1:50099.
    #[arg(long)]
    pub listen: String,
    /// Address every connection is forwarded to, e.g. 10.77.0.1:50052.
    #[arg(long)]
    pub upstream: String,
    /// Round-trip time to add, in milliseconds (half of it in each direction).
    #[arg(long, default_value_t = 0.0)]
    pub delay_ms: f64,
    /// Link rate in megabits per second, per direction (0 = unlimited): each chunk is held back
    /// by its serialization time, bytes·8/rate µs, on top of the delay.
    #[arg(long, default_value_t = 0.0)]
    pub bandwidth_mbps: f64,
}

/// The `sequoia net-delay` command: serve until SIGINT or SIGTERM.
pub fn net_delay(args: &NetDelayArgs) -> Result<()> {
    if !(args.delay_ms.is_finite() && args.delay_ms >= 0.0) {
        anyhow::bail!("--delay-ms must be a non-negative number");
    }
    if !(args.bandwidth_mbps.is_finite() && args.bandwidth_mbps >= 0.0) {
        anyhow::bail!("--bandwidth-mbps must be a non-negative number (0 = unlimited)");
    }
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let rtt = Duration::from_secs_f64(args.delay_ms / 1e3);
        let proxy =
            DelayProxy::bind(&args.listen, &args.upstream, rtt, args.bandwidth_mbps).await?;
        let rate = if args.bandwidth_mbps > 0.0 {
            format!("{} Mbit/s each way", args.bandwidth_mbps)
        } else {
            "unlimited bandwidth".to_string()
        };
        eprintln!(
            "net-delay: {} -> {} with {} ms added round-trip time ({} ms each way), {rate}",
            proxy.local_addr()?,
            args.upstream,
            args.delay_ms,
            args.delay_ms / 2.0
        );
        proxy.run(shutdown_signal()).await?;
        eprintln!("net-delay: stopped");
        Ok(())
    })
}

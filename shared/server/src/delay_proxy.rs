//! A TCP proxy that adds a fixed delay to every byte, to emulate the round-trip time between a
//! draft host and a verify host where `tc netem` is unavailable: `sequoia net-delay`, the
//! benchmarks' two-host setup and the tests that need a slow verify node run it.
//!
//! Every accepted connection is paired with a fresh connection to the upstream address, and
//! bytes are forwarded both ways. Each chunk read from one side is stamped with its arrival time
//! and written to the other side no earlier than `arrival + rtt/2`, so the round trip of a
//! request and its reply grows by `rtt`. Chunks are written in the order they were read (byte
//! order is preserved), and at most [`QUEUE_CHUNKS`] chunks are in flight per direction: when
//! the receiving side is slow, the proxy stops reading and TCP flow control pushes back on the
//! sender (backpressure). A half-close (EOF) is forwarded after the data before it; an error on
//! either side tears the whole connection down. `TCP_NODELAY` is set on both sockets so small
//! messages (gRPC frames) are not held back by Nagle's algorithm.
//!
//! With a bandwidth cap, each direction also behaves like a link of that
//! rate: a chunk occupies the link for its serialization time (bytes·8/rate) after the chunk
//! before it has left, so a large message arrives later than a small one and back-to-back chunks
//! queue behind each other, as on a real link. The one-way delay comes on top. See
//! [`Pacer::release`].

use anyhow::{Context, Result};
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// Largest chunk read at once.
const CHUNK_BYTES: usize = 64 * 1024;
/// Chunks queued per direction before the proxy stops reading (backpressure).
pub const QUEUE_CHUNKS: usize = 64;
/// How long to wait for the upstream connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The link model of one direction: when each chunk leaves it.
///
/// A chunk read at `arrival` starts onto the link when both it has arrived and the previous
/// chunk has finished serializing (`busy_until`), occupies it for `bytes·8/rate`, and is
/// delivered `one_way` after it has fully left. Release times therefore never decrease, which
/// keeps the byte order; with no rate the chunk is released at `arrival + one_way`.
#[derive(Debug, Clone, Copy)]
pub struct Pacer {
    one_way: Duration,
    /// Bits per microsecond (= megabits per second); 0 = unlimited.
    mbps: f64,
    /// When the link finishes sending the last chunk given to it.
    busy_until: Option<Instant>,
}

impl Pacer {
    pub fn new(one_way: Duration, mbps: f64) -> Self {
        Self {
            one_way,
            mbps: if mbps.is_finite() && mbps > 0.0 {
                mbps
            } else {
                0.0
            },
            busy_until: None,
        }
    }

    /// Serialization time of `bytes` at the link rate (zero when unlimited).
    pub fn serialization(&self, bytes: usize) -> Duration {
        if self.mbps == 0.0 {
            return Duration::ZERO;
        }
        // bits / (bits per µs) = µs; rounded to whole nanoseconds.
        Duration::from_nanos((bytes as f64 * 8e3 / self.mbps).round() as u64)
    }

    /// When a chunk of `bytes` read at `arrival` is to be written to the other side.
    pub fn release(&mut self, arrival: Instant, bytes: usize) -> Instant {
        let start = match self.busy_until {
            Some(busy) if busy > arrival => busy,
            _ => arrival,
        };
        let sent = start + self.serialization(bytes);
        self.busy_until = Some(sent);
        sent + self.one_way
    }

    /// Whether chunks are released at once (no delay, no rate limit).
    pub fn is_instant(&self) -> bool {
        self.one_way.is_zero() && self.mbps == 0.0
    }
}

/// A bound delay proxy; [`run`](Self::run) serves it.
pub struct DelayProxy {
    listener: TcpListener,
    upstream: String,
    one_way: Duration,
    mbps: f64,
}

impl DelayProxy {
    /// Bind `listen`; connections will go to `upstream` with `rtt` added to their round trip
    /// and, unless `mbps` is 0, a link rate of `mbps` megabits per second in each direction.
    pub async fn bind(listen: &str, upstream: &str, rtt: Duration, mbps: f64) -> Result<Self> {
        let listener = TcpListener::bind(listen)
            .await
            .with_context(|| format!("cannot listen on {listen}"))?;
        Ok(Self {
            listener,
            upstream: upstream.to_string(),
            one_way: rtt / 2,
            mbps,
        })
    }

    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.listener.local_addr()?)
    }

    /// Accept and forward connections until `shutdown` completes; then stop accepting and close
    /// every open connection.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<()> {
        let mut conns = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                accepted = self.listener.accept() => {
                    let (client, peer) = match accepted {
                        Ok(x) => x,
                        Err(e) => {
                            // Out of file descriptors and the like: wait a little, keep serving.
                            tracing::warn!(error = %e, "accept failed");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    };
                    let upstream = self.upstream.clone();
                    let pacer = Pacer::new(self.one_way, self.mbps);
                    conns.spawn(async move {
                        if let Err(e) = forward(client, &upstream, pacer).await {
                            tracing::debug!(%peer, error = %e, "connection ended with an error");
                        }
                    });
                }
                // Reap finished connections so the set does not grow without bound.
                Some(_) = conns.join_next(), if !conns.is_empty() => {}
            }
        }
        conns.shutdown().await;
        Ok(())
    }
}

/// Connect to `upstream` and pump both directions until both are done or one fails.
async fn forward(client: TcpStream, upstream: &str, pacer: Pacer) -> Result<()> {
    let server = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(upstream))
        .await
        .with_context(|| format!("connecting to {upstream} timed out"))?
        .with_context(|| format!("cannot connect to {upstream}"))?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    // Each direction is a link of its own (full duplex).
    let up = pump(cr, sw, pacer);
    let down = pump(sr, cw, pacer);
    tokio::pin!(up, down);
    // A clean EOF on one side still lets the other direction finish; an error ends both.
    tokio::select! {
        r = &mut up => { r?; down.await }
        r = &mut down => { r?; up.await }
    }
}

/// Copy `reader` to `writer`, releasing each chunk when `pacer` says (its delay and
/// serialization time from the moment it was read), then forward the EOF as a write shutdown.
async fn pump<R, W>(mut reader: R, mut writer: W, mut pacer: Pacer) -> Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let (tx, mut rx) = mpsc::channel::<(Instant, Vec<u8>)>(QUEUE_CHUNKS);
    let instant = pacer.is_instant();
    let read_side = async move {
        let mut buf = vec![0u8; CHUNK_BYTES];
        loop {
            let n = reader.read(&mut buf).await?;
            if n == 0 {
                return Ok::<_, std::io::Error>(()); // EOF: dropping tx ends the write side
            }
            let due = pacer.release(Instant::now(), n);
            if tx.send((due, buf[..n].to_vec())).await.is_err() {
                return Ok(()); // the write side failed and said why
            }
        }
    };
    let write_side = async move {
        while let Some((due, data)) = rx.recv().await {
            if !instant {
                tokio::time::sleep_until(due).await;
            }
            writer.write_all(&data).await?;
        }
        writer.shutdown().await
    };
    tokio::pin!(read_side, write_side);
    // Either side failing ends the direction at once (the connection is broken); the write side
    // only finishes cleanly after the read side has seen EOF and everything was written.
    tokio::select! {
        w = &mut write_side => { w?; read_side.await?; }
        r = &mut read_side => { r?; write_side.await?; }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant as StdInstant;
    use tokio::sync::oneshot;

    /// An echo server on an ephemeral port; echoes until the client half-closes, then closes.
    async fn echo_server() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = listener.accept().await else {
                    return;
                };
                s.set_nodelay(true).unwrap();
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                    let _ = w.shutdown().await;
                });
            }
        });
        addr
    }

    /// A proxy in front of `upstream`; dropping the sender shuts it down.
    async fn proxy(upstream: SocketAddr, rtt_ms: u64) -> (SocketAddr, oneshot::Sender<()>) {
        let p = DelayProxy::bind(
            "127.0.0.1:0",
            &upstream.to_string(),
            Duration::from_millis(rtt_ms),
            0.0,
        )
        .await
        .unwrap();
        let addr = p.local_addr().unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        tokio::spawn(p.run(async move {
            let _ = rx.await;
        }));
        (addr, tx)
    }

    fn random_bytes(n: usize, mut seed: u64) -> Vec<u8> {
        (0..n)
            .map(|_| {
                // xorshift64*
                seed ^= seed >> 12;
                seed ^= seed << 25;
                seed ^= seed >> 27;
                (seed.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
            })
            .collect()
    }

    /// Smallest of several one-byte round trips through `addr`.
    async fn min_rtt(addr: SocketAddr, tries: usize) -> Duration {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.set_nodelay(true).unwrap();
        let mut best = Duration::MAX;
        let mut b = [0u8; 1];
        for i in 0..tries {
            let t = StdInstant::now();
            s.write_all(&[i as u8]).await.unwrap();
            s.read_exact(&mut b).await.unwrap();
            assert_eq!(b[0], i as u8);
            best = best.min(t.elapsed());
        }
        best
    }

    /// Send `payload` through `addr` to the echo server while reading the echo back.
    async fn echo_through(addr: SocketAddr, payload: Vec<u8>) -> Vec<u8> {
        let s = TcpStream::connect(addr).await.unwrap();
        let (mut r, mut w) = s.into_split();
        let writer = tokio::spawn(async move {
            w.write_all(&payload).await.unwrap();
            w.shutdown().await.unwrap();
        });
        let mut back = Vec::new();
        r.read_to_end(&mut back).await.unwrap();
        writer.await.unwrap();
        back
    }

    #[test]
    fn pacer_adds_serialization_time_and_queues_chunks() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        // 8 Mbit/s = 1 byte per µs: 1000 bytes take 1 ms on the link.
        let mut p = Pacer::new(ms(5), 8.0);
        assert_eq!(p.serialization(1000), ms(1));
        assert_eq!(p.release(t0, 1000), t0 + ms(1) + ms(5));
        // A chunk arriving while the link is busy waits for it: sent at 1 + 2 ms.
        assert_eq!(p.release(t0 + ms(0), 2000), t0 + ms(3) + ms(5));
        // One arriving after the link went idle starts at once.
        assert_eq!(
            p.release(t0 + ms(10), 500),
            t0 + ms(10) + ms(5) / 10 + ms(5)
        );
    }

    #[test]
    fn pacer_without_a_rate_only_delays_and_keeps_order() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut p = Pacer::new(ms(5), 0.0);
        assert!(!p.is_instant());
        assert_eq!(p.serialization(1 << 20), Duration::ZERO);
        assert_eq!(p.release(t0, 1 << 20), t0 + ms(5));
        assert_eq!(p.release(t0 + ms(1), 10), t0 + ms(6));
        assert!(Pacer::new(Duration::ZERO, 0.0).is_instant());
        assert!(!Pacer::new(Duration::ZERO, 100.0).is_instant());
        // Nonsense rates mean unlimited.
        assert!(Pacer::new(Duration::ZERO, -3.0).is_instant());
        // Release times never decrease, whatever the arrival pattern: order is preserved.
        let mut p = Pacer::new(ms(2), 1.0);
        let mut last = t0;
        for (i, bytes) in [100usize, 1, 5000, 0, 64 * 1024].into_iter().enumerate() {
            let r = p.release(t0 + ms(i as u64), bytes);
            assert!(r >= last);
            last = r;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn adds_the_round_trip_time() {
        let echo = echo_server().await;
        let (addr, _stop) = proxy(echo, 40).await;
        let rtt = min_rtt(addr, 5).await;
        // Only a lower bound: a loaded machine may always be slower.
        assert!(
            rtt >= Duration::from_millis(32),
            "round trip through a 40 ms proxy took only {rtt:?}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn zero_delay_passes_through() {
        let echo = echo_server().await;
        let (addr, _stop) = proxy(echo, 0).await;
        let payload = random_bytes(100_000, 7);
        assert_eq!(echo_through(addr, payload.clone()).await, payload);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn large_payload_arrives_intact_both_ways() {
        let echo = echo_server().await;
        let (addr, _stop) = proxy(echo, 4).await;
        // Larger than the proxy's queues and the socket buffers together, so backpressure is
        // exercised on both directions.
        let payload = random_bytes(24 << 20, 42);
        let back = echo_through(addr, payload.clone()).await;
        assert_eq!(back.len(), payload.len());
        assert!(back == payload, "echoed bytes differ");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn half_close_is_forwarded() {
        // Server: read everything until EOF, then answer with the byte count.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let up = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut all = Vec::new();
            s.read_to_end(&mut all).await.unwrap();
            s.write_all(format!("{}", all.len()).as_bytes())
                .await
                .unwrap();
            s.shutdown().await.unwrap();
        });
        let (addr, _stop) = proxy(up, 6).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(&random_bytes(300_000, 3)).await.unwrap();
        s.shutdown().await.unwrap();
        let mut reply = String::new();
        s.read_to_string(&mut reply).await.unwrap();
        assert_eq!(reply, "300000");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_concurrent_connections() {
        let echo = echo_server().await;
        let (addr, _stop) = proxy(echo, 10).await;
        let mut tasks = JoinSet::new();
        for i in 0..200u64 {
            tasks.spawn(async move {
                let payload = random_bytes(32 * 1024 + i as usize, i + 1);
                let back = echo_through(addr, payload.clone()).await;
                assert!(back == payload, "connection {i}: echoed bytes differ");
            });
        }
        let mut done = 0;
        while let Some(r) = tasks.join_next().await {
            r.unwrap();
            done += 1;
        }
        assert_eq!(done, 200);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn shutdown_stops_accepting_and_closes_connections() {
        let echo = echo_server().await;
        let p = DelayProxy::bind("127.0.0.1:0", &echo.to_string(), Duration::ZERO, 0.0)
            .await
            .unwrap();
        let addr = p.local_addr().unwrap();
        let (tx, rx) = oneshot::channel::<()>();
        let server = tokio::spawn(p.run(async move {
            let _ = rx.await;
        }));
        let mut open = TcpStream::connect(addr).await.unwrap();
        open.write_all(b"x").await.unwrap();
        let mut b = [0u8; 1];
        open.read_exact(&mut b).await.unwrap();
        tx.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("run returns after shutdown")
            .unwrap()
            .unwrap();
        // The open connection is closed (EOF or reset), and new ones are refused.
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(10), open.read_to_end(&mut rest))
            .await
            .expect("connection closed after shutdown");
        assert!(closed.is_err() || rest.is_empty());
        assert!(TcpStream::connect(addr).await.is_err());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unreachable_upstream_closes_the_client() {
        // A port with nothing listening on it.
        let dead = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let (addr, _stop) = proxy(dead, 0).await;
        let mut s = TcpStream::connect(addr).await.unwrap();
        let mut rest = Vec::new();
        let r = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest))
            .await
            .expect("client connection is closed");
        assert!(r.is_err() || rest.is_empty());
    }
}

//! Verify nodes as the draft sees them: where they are (fixed URLs, or DNS names such as a
//! Kubernetes headless Service, re-resolved periodically), whether they answer, how loaded they
//! are, and the choice of a node for each new session.

use sequoia_core::limits::MAX_MESSAGE_BYTES;
use sequoia_core::planner::cost::NodeCosts;
use sequoia_proto::v1::verifier_client::VerifierClient;
use sequoia_proto::v1::{InfoRequest, InfoResponse};
use sequoia_server::security::{BearerToken, ClientSecurity};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;
use tokio::sync::Mutex;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::Status;
use tracing::{info, warn};

/// A Verifier client that sends this node's bearer token (if any) with every call.
pub type VerifyClient = VerifierClient<InterceptedService<Channel, BearerToken>>;

/// One verify node.
pub struct VerifyNode {
    pub addr: String,
    channel: Channel,
    token: BearerToken,
    info: Mutex<Option<InfoResponse>>,
    /// Sessions this draft node has open (or is opening) there.
    active: AtomicUsize,
    /// Sessions the node last reported for itself (from all draft nodes).
    reported: AtomicUsize,
    /// The last health check or session attempt reached the node.
    healthy: AtomicBool,
    /// The node said it is shutting down (no new sessions).
    draining: AtomicBool,
    /// Measured costs for the auto planner (profiled on first use).
    pub costs: Mutex<Option<NodeCosts>>,
}

impl VerifyNode {
    /// A lazily connected channel to `addr` (`https://` = TLS with `security.tls`).
    pub fn new(
        addr: &str,
        connect_timeout: Duration,
        security: &ClientSecurity,
    ) -> Result<Self, String> {
        let url = if addr.contains("://") {
            addr.to_string()
        } else {
            format!("http://{addr}")
        };
        let endpoint = security
            .endpoint(&url)
            .map_err(|e| format!("verify node {addr:?}: {e}"))?
            .connect_timeout(connect_timeout)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(20))
            .keep_alive_timeout(Duration::from_secs(10));
        Ok(Self {
            addr: url,
            channel: endpoint.connect_lazy(),
            token: security.token.clone(),
            info: Mutex::new(None),
            active: AtomicUsize::new(0),
            reported: AtomicUsize::new(0),
            healthy: AtomicBool::new(true),
            draining: AtomicBool::new(false),
            costs: Mutex::new(None),
        })
    }

    pub fn client(&self) -> VerifyClient {
        VerifierClient::with_interceptor(self.channel.clone(), self.token.clone())
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }

    /// The node's `Info`: the last one fetched, or fetched now.
    pub async fn info(&self, timeout: Duration) -> Result<InfoResponse, Status> {
        if let Some(i) = self.info.lock().await.as_ref() {
            return Ok(i.clone());
        }
        self.check(timeout).await
    }

    /// Ask the node for its `Info` now; records whether it answered, its load and whether it
    /// drains.
    pub async fn check(&self, timeout: Duration) -> Result<InfoResponse, Status> {
        let answer = tokio::time::timeout(timeout, self.client().info(InfoRequest {})).await;
        let info = match answer {
            Ok(Ok(r)) => r.into_inner(),
            Ok(Err(s)) => {
                self.mark_unreachable();
                return Err(unavailable(&self.addr, &s));
            }
            Err(_) => {
                self.mark_unreachable();
                return Err(Status::unavailable(format!(
                    "verify node {} did not answer Info within {timeout:?}",
                    self.addr
                )));
            }
        };
        if !self.healthy.swap(true, Ordering::SeqCst) {
            info!(node = %self.addr, "verify node is reachable again");
        }
        self.draining.store(info.draining, Ordering::SeqCst);
        self.set_reported(info.active_sessions as usize);
        *self.info.lock().await = Some(info.clone());
        Ok(info)
    }

    /// Whether the node runs on this machine with CPUs this process may use too (from its last
    /// `Info`; false when unknown).
    pub async fn shares_cpus(&self) -> bool {
        self.info.lock().await.as_ref().is_some_and(|i| {
            sequoia_server::host::shares_cpus_with_this_process(&i.machine_id, &i.cpus)
        })
    }

    /// Take the node out of the choice until a health check reaches it again.
    pub fn mark_unreachable(&self) {
        if self.healthy.swap(false, Ordering::SeqCst) {
            warn!(node = %self.addr, "verify node is unreachable; new sessions go elsewhere");
        }
    }

    /// The node refused a session because it shuts down.
    pub fn mark_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Sessions the node reported for itself (`Info`, `SessionOpened`).
    pub fn set_reported(&self, sessions: usize) {
        self.reported.store(sessions, Ordering::SeqCst);
    }

    /// Sessions this draft node has there now.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::SeqCst)
    }

    /// Whether new sessions should go here.
    pub fn usable(&self) -> bool {
        self.healthy.load(Ordering::SeqCst) && !self.draining.load(Ordering::SeqCst)
    }

    /// Sessions on the node as far as this draft node knows: its own report, or what this draft
    /// node opened since, whichever is larger.
    fn load(&self) -> usize {
        self.active().max(self.reported.load(Ordering::SeqCst))
    }
}

/// A session slot taken on a node (counted in its load); released on drop.
pub struct Reservation(Arc<VerifyNode>);

impl Reservation {
    pub fn node(&self) -> &Arc<VerifyNode> {
        &self.0
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Map a failed call to a verify node to the status the client should see: the node's own
/// refusals keep their code; everything else means the node is not reachable.
pub fn unavailable(addr: &str, s: &Status) -> Status {
    use tonic::Code::*;
    match s.code() {
        InvalidArgument | ResourceExhausted | FailedPrecondition | Internal => {
            Status::new(s.code(), format!("verify node {addr}: {}", s.message()))
        }
        // The node is up but refuses this draft node: a deployment mistake, so say which settings.
        Unauthenticated | PermissionDenied => Status::unavailable(format!(
            "verify node {addr} refused this draft node ({:?}: {}); check verify_token / \
             verify_token_file against the node's auth_tokens",
            s.code(),
            s.message()
        )),
        _ => Status::unavailable(format!(
            "verify node {addr} is unavailable ({:?}: {}); check that verify-service runs there",
            s.code(),
            s.message()
        )),
    }
}

/// Where verify nodes come from: one `verify` entry.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    /// A fixed URL (`http://host:port`, `https://host:port` or `host:port`).
    Url(String),
    /// `dns:///name:port`: every address `name` resolves to is a verify node (a headless
    /// Service lists every ready pod); re-resolved every discovery interval.
    Dns { host: String, port: u16 },
}

impl Source {
    pub fn parse(entry: &str) -> Result<Self, String> {
        let Some(rest) = entry.strip_prefix("dns://") else {
            return Ok(Source::Url(entry.to_string()));
        };
        // gRPC spells it dns:///name:port (empty authority); accept dns://name:port too.
        let target = rest.trim_start_matches('/');
        let bad = |why: &str| {
            format!("verify entry {entry:?}: {why}; expected dns:///NAME:PORT, e.g. dns:///verify-service:50052")
        };
        let (host, port) = target.rsplit_once(':').ok_or_else(|| bad("no port"))?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(bad("no host name"));
        }
        let port = port.parse().map_err(|_| bad("the port is not a number"))?;
        Ok(Source::Dns {
            host: host.to_string(),
            port,
        })
    }
}

/// The verify nodes this draft node may use.
pub struct NodePool {
    sources: Vec<Source>,
    /// Per source, its nodes (one for a URL, one per resolved address for a DNS name).
    nodes: RwLock<Vec<Vec<Arc<VerifyNode>>>>,
    next: AtomicUsize,
    /// Makes choose-and-count atomic, so concurrent new sessions spread.
    choosing: std::sync::Mutex<()>,
    connect_timeout: Duration,
    security: ClientSecurity,
    /// Certificates of DNS-discovered nodes are checked against the DNS name unless a
    /// `verify_tls_domain` is configured.
    tls_domain_configured: bool,
}

impl NodePool {
    pub fn new(
        entries: &[String],
        connect_timeout: Duration,
        security: &ClientSecurity,
        tls_domain_configured: bool,
    ) -> Result<Self, String> {
        if entries.is_empty() {
            return Err(
                "no verify nodes configured: pass --verify URL[,URL...] or dns:///NAME:PORT".into(),
            );
        }
        let sources = entries
            .iter()
            .map(|e| Source::parse(e))
            .collect::<Result<Vec<_>, _>>()?;
        let nodes = sources
            .iter()
            .map(|s| match s {
                Source::Url(u) => {
                    VerifyNode::new(u, connect_timeout, security).map(|n| vec![Arc::new(n)])
                }
                Source::Dns { .. } => Ok(Vec::new()),
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            sources,
            nodes: RwLock::new(nodes),
            next: AtomicUsize::new(0),
            choosing: std::sync::Mutex::new(()),
            connect_timeout,
            security: security.clone(),
            tls_domain_configured,
        })
    }

    /// Every known node.
    pub fn nodes(&self) -> Vec<Arc<VerifyNode>> {
        self.nodes
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .flatten()
            .cloned()
            .collect()
    }

    fn has_dns(&self) -> bool {
        self.sources.iter().any(|s| matches!(s, Source::Dns { .. }))
    }

    /// Re-resolve DNS sources (keeping the nodes of a name that fails to resolve), then ask
    /// every node for its `Info` (health, load, draining).
    pub async fn refresh(&self) {
        for (i, source) in self.sources.iter().enumerate() {
            let Source::Dns { host, port } = source else {
                continue;
            };
            let resolved = tokio::time::timeout(
                self.connect_timeout,
                tokio::net::lookup_host((host.as_str(), *port)),
            )
            .await;
            let mut addrs: Vec<std::net::SocketAddr> = match resolved {
                Ok(Ok(a)) => a.collect(),
                Ok(Err(e)) => {
                    warn!(name = %host, error = %e, "cannot resolve verify nodes; keeping the last known");
                    continue;
                }
                Err(_) => {
                    warn!(name = %host, "resolving verify nodes timed out; keeping the last known");
                    continue;
                }
            };
            addrs.sort();
            addrs.dedup();
            let scheme = if self.security.tls.is_some() {
                "https"
            } else {
                "http"
            };
            let old = self.nodes.read().unwrap_or_else(|e| e.into_inner())[i].clone();
            let mut fresh = Vec::with_capacity(addrs.len());
            for a in addrs {
                let url = format!("{scheme}://{a}");
                if let Some(n) = old.iter().find(|n| n.addr == url) {
                    fresh.push(n.clone());
                    continue;
                }
                let security = match (&self.security.tls, self.tls_domain_configured) {
                    (Some(tls), false) => ClientSecurity {
                        tls: Some(tls.clone().domain_name(host.clone())),
                        token: self.security.token.clone(),
                    },
                    _ => self.security.clone(),
                };
                match VerifyNode::new(&url, self.connect_timeout, &security) {
                    Ok(n) => {
                        info!(name = %host, node = %url, "discovered verify node");
                        fresh.push(Arc::new(n));
                    }
                    Err(e) => warn!(name = %host, error = %e, "skipping a discovered address"),
                }
            }
            for gone in old
                .iter()
                .filter(|o| !fresh.iter().any(|n| n.addr == o.addr))
            {
                info!(name = %host, node = %gone.addr, "verify node left DNS; its open sessions continue");
            }
            self.nodes.write().unwrap_or_else(|e| e.into_inner())[i] = fresh;
        }
        let nodes = self.nodes();
        futures::future::join_all(nodes.iter().map(|n| n.check(self.connect_timeout))).await;
    }

    /// Refresh every `interval` in the background for as long as the pool lives.
    pub fn spawn_refresh(self: &Arc<Self>, interval: Duration) {
        if interval.is_zero() {
            return;
        }
        let pool: Weak<Self> = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let Some(p) = pool.upgrade() else { return };
                p.refresh().await;
                drop(p);
                tokio::time::sleep(interval).await;
            }
        });
    }

    /// Take a slot on the best node not in `exclude`: reachable and not draining first, then
    /// the fewest sessions, ties rotated so load spreads. Unreachable nodes are still offered
    /// last (health information may be stale). None when no node is left.
    pub async fn reserve(&self, exclude: &[String]) -> Option<Reservation> {
        if self.nodes().is_empty() && self.has_dns() {
            self.refresh().await; // first use, or every address vanished: look again now
        }
        let nodes = self.nodes();
        let n = nodes.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let _choosing = self.choosing.lock().unwrap_or_else(|e| e.into_inner());
        let best = (0..n)
            .map(|i| &nodes[(start + i) % n])
            .filter(|node| !exclude.contains(&node.addr))
            .min_by_key(|node| (!node.usable(), node.load()))?;
        best.active.fetch_add(1, Ordering::SeqCst);
        Some(Reservation(best.clone()))
    }

    /// The configured entries, for messages.
    pub fn describe(&self) -> String {
        self.sources
            .iter()
            .map(|s| match s {
                Source::Url(u) => u.clone(),
                Source::Dns { host, port } => format!("dns:///{host}:{port}"),
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_verify_entries() {
        assert_eq!(
            Source::parse("http://a:1").unwrap(),
            Source::Url("http://a:1".into())
        );
        let dns = Source::Dns {
            host: "verify-service".into(),
            port: 50052,
        };
        assert_eq!(Source::parse("dns:///verify-service:50052").unwrap(), dns);
        assert_eq!(Source::parse("dns://verify-service:50052").unwrap(), dns);
        for bad in ["dns:///verify-service", "dns:///:50052", "dns:///x:port"] {
            let e = Source::parse(bad).unwrap_err();
            assert!(e.contains("dns:///NAME:PORT"), "{e}");
        }
    }

    fn pool(n: usize) -> NodePool {
        let urls: Vec<String> = (0..n)
            .map(|i| format!("http://127.0.0.1:{}", 1 + i))
            .collect();
        NodePool::new(
            &urls,
            Duration::from_secs(1),
            &ClientSecurity::default(),
            false,
        )
        .unwrap()
    }

    #[tokio::test]
    async fn new_sessions_go_to_the_least_loaded_usable_node() {
        let p = pool(3);
        // Concurrent reservations spread one per node before any node gets a second.
        let held: Vec<_> = futures::future::join_all((0..3).map(|_| p.reserve(&[]))).await;
        let mut addrs: Vec<_> = held
            .iter()
            .map(|r| r.as_ref().unwrap().node().addr.clone())
            .collect();
        addrs.sort();
        addrs.dedup();
        assert_eq!(addrs.len(), 3);
        // A node reporting more sessions (from other draft nodes) is avoided.
        let nodes = p.nodes();
        drop(held);
        nodes[0].set_reported(5);
        nodes[1].set_reported(1);
        let r = p.reserve(&[]).await.unwrap();
        assert_eq!(r.node().addr, nodes[2].addr);
        // Unreachable and draining nodes come last; excluded ones never.
        nodes[2].mark_unreachable();
        nodes[1].mark_draining();
        let r2 = p.reserve(&[]).await.unwrap();
        assert_eq!(r2.node().addr, nodes[0].addr);
        let r3 = p.reserve(&[nodes[0].addr.clone()]).await.unwrap();
        assert_ne!(r3.node().addr, nodes[0].addr);
        drop(r3);
        let all: Vec<String> = nodes.iter().map(|n| n.addr.clone()).collect();
        assert!(p.reserve(&all).await.is_none());
        // Reservations count while held and are released on drop.
        assert_eq!(nodes[2].active(), 1);
        drop(r);
        assert_eq!(nodes[2].active(), 0);
    }

    #[tokio::test]
    async fn dns_names_resolve_to_one_node_per_address() {
        let p = NodePool::new(
            &["dns:///localhost:50999".to_string()],
            Duration::from_millis(300),
            &ClientSecurity::default(),
            false,
        )
        .unwrap();
        assert!(p.nodes().is_empty());
        let r = p.reserve(&[]).await.expect("localhost resolves");
        assert!(r.node().addr.starts_with("http://") && r.node().addr.ends_with(":50999"));
        // Nothing listens there: the health check marked it unreachable.
        assert!(!r.node().usable());
        assert!(p.nodes().len() >= 1);
    }
}

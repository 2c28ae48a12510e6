//! Verify nodes as the draft sees them: gRPC channels, their `Info`, tokenizer compatibility,
//! and the choice of a node for each new session.

use sequoia_proto::v1::verifier_client::VerifierClient;
use sequoia_proto::v1::{InfoRequest, InfoResponse};
use sequoia_shared::security::{BearerToken, ClientSecurity};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::Status;

pub const MAX_MESSAGE_BYTES: usize = 32 << 20;

/// A Verifier client that sends this node's bearer token (if any) with every call.
pub type VerifyClient = VerifierClient<InterceptedService<Channel, BearerToken>>;

/// One configured verify node.
pub struct VerifyNode {
    pub addr: String,
    channel: Channel,
    token: BearerToken,
    info: Mutex<Option<InfoResponse>>,
    /// Sessions this draft node has open there.
    pub active: AtomicUsize,
    /// Measured costs for the auto planner (profiled on first use).
    pub costs: Mutex<Option<crate::plan::NodeCosts>>,
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
            costs: Mutex::new(None),
        })
    }

    pub fn client(&self) -> VerifyClient {
        VerifierClient::with_interceptor(self.channel.clone(), self.token.clone())
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }

    /// The node's `Info`, fetched once and cached.
    pub async fn info(&self) -> Result<InfoResponse, Status> {
        let mut cached = self.info.lock().await;
        if let Some(i) = cached.as_ref() {
            return Ok(i.clone());
        }
        let info = self
            .client()
            .info(InfoRequest {})
            .await
            .map_err(|s| unavailable(&self.addr, &s))?
            .into_inner();
        *cached = Some(info.clone());
        Ok(info)
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

/// The configured verify nodes.
pub struct NodePool {
    nodes: Vec<Arc<VerifyNode>>,
    next: AtomicUsize,
}

impl NodePool {
    pub fn new(
        addrs: &[String],
        connect_timeout: Duration,
        security: &ClientSecurity,
    ) -> Result<Self, String> {
        if addrs.is_empty() {
            return Err("no verify nodes configured: pass --verify URL[,URL...]".into());
        }
        let nodes = addrs
            .iter()
            .map(|a| VerifyNode::new(a, connect_timeout, security).map(Arc::new))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            nodes,
            next: AtomicUsize::new(0),
        })
    }

    /// Nodes ordered by preference for a new session: fewest sessions opened from here first,
    /// ties rotated so load spreads.
    pub fn candidates(&self) -> Vec<Arc<VerifyNode>> {
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let n = self.nodes.len();
        let mut order: Vec<Arc<VerifyNode>> = (0..n)
            .map(|i| self.nodes[(start + i) % n].clone())
            .collect();
        order.sort_by_key(|node| node.active.load(Ordering::Relaxed));
        order
    }

    pub fn nodes(&self) -> &[Arc<VerifyNode>] {
        &self.nodes
    }
}

//! Transport security for both services and the CLI: TLS (rustls through tonic), optional mutual
//! TLS between draft and verify nodes, and bearer-token authentication.
//!
//! Why one module: draft-service is a server to clients and a client of verify nodes,
//! verify-service a server, the `sequoia` CLI a client. Sharing the loading code keeps the file
//! formats (PEM certificates and keys, token files with one token per line) and the error
//! messages the same everywhere.
//!
//! Conventions: an empty path means "not set"; TLS is used exactly when a URL says `https://`;
//! authentication is on when at least one token is configured. Tokens are compared by SHA-256
//! digest, so a comparison's timing says nothing about the accepted tokens. The token check is
//! an interceptor on the sequoia services only, so grpc.health.v1 stays open; and since
//! Kubernetes' gRPC probes cannot speak TLS, [`spawn_probe_endpoint`] serves health alone on a
//! plaintext port.

use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};
use tonic::{Request, Status};

/// The metadata key carrying `Bearer <token>`.
pub const AUTHORIZATION: &str = "authorization";

#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    #[error("cannot read {what} {}: {source}", path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Invalid(String),
}

/// `Some(path)` unless the path is empty (the "not set" value in configs).
pub fn given(path: &Path) -> Option<&Path> {
    (!path.as_os_str().is_empty()).then_some(path)
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, SecurityError> {
    std::fs::read(path).map_err(|source| SecurityError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

fn identity(cert: &Path, key: &Path) -> Result<Identity, SecurityError> {
    Ok(Identity::from_pem(
        read("certificate", cert)?,
        read("private key", key)?,
    ))
}

/// A service's listener settings loaded and checked together: TLS ([`server_tls`]), the
/// accepted bearer tokens, and the tokens-without-TLS rule ([`tokens_need_tls`]).
pub fn server_security(
    cert: &Path,
    key: &Path,
    client_ca: &Path,
    tokens: &[String],
    tokens_file: &Path,
    refuse_tokens_without_tls: bool,
) -> Result<(Option<ServerTlsConfig>, TokenCheck), SecurityError> {
    let tls = server_tls(cert, key, client_ca)?;
    let check = TokenCheck::load(tokens, tokens_file)?;
    tokens_need_tls(
        check.is_enabled(),
        tls.is_some(),
        refuse_tokens_without_tls,
        "auth_tokens",
    )?;
    Ok((tls, check))
}

/// Server TLS from PEM files, or `None` (plaintext) when no certificate is given. With
/// `client_ca`, clients must present a certificate signed by it (mutual TLS).
pub fn server_tls(
    cert: &Path,
    key: &Path,
    client_ca: &Path,
) -> Result<Option<ServerTlsConfig>, SecurityError> {
    match (given(cert), given(key)) {
        (None, None) if given(client_ca).is_some() => Err(SecurityError::Invalid(
            "tls_client_ca needs tls_cert and tls_key: mutual TLS runs over TLS".into(),
        )),
        (None, None) => Ok(None),
        (Some(cert), Some(key)) => {
            let mut tls = ServerTlsConfig::new().identity(identity(cert, key)?);
            if let Some(ca) = given(client_ca) {
                tls = tls.client_ca_root(Certificate::from_pem(read("client CA", ca)?));
            }
            Ok(Some(tls))
        }
        _ => Err(SecurityError::Invalid(
            "give both tls_cert and tls_key (PEM files), or neither".into(),
        )),
    }
}

/// The same settings as [`server_tls`] as a rustls config, for listeners that are not gRPC
/// (draft-service's HTTP API), so both ports accept the same certificates and client CA.
/// `None` = plaintext.
pub fn rustls_server_config(
    cert: &Path,
    key: &Path,
    client_ca: &Path,
) -> Result<Option<Arc<tokio_rustls::rustls::ServerConfig>>, SecurityError> {
    use tokio_rustls::rustls::{self, pki_types::pem::PemObject, pki_types::*};
    // Same half-configuration rules as the gRPC port.
    if server_tls(cert, key, client_ca)?.is_none() {
        return Ok(None);
    }
    let (Some(cert), Some(key)) = (given(cert), given(key)) else {
        return Ok(None);
    };
    let bad = |what: &str, path: &Path, e: &dyn std::fmt::Display| {
        SecurityError::Invalid(format!("{what} {}: {e}", path.display()))
    };
    let chain = CertificateDer::pem_slice_iter(&read("certificate", cert)?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad("certificate", cert, &e))?;
    let key_der = PrivateKeyDer::from_pem_slice(&read("private key", key)?)
        .map_err(|e| bad("private key", key, &e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| SecurityError::Invalid(format!("TLS versions: {e}")))?;
    let builder = match given(client_ca) {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in CertificateDer::pem_slice_iter(&read("client CA", ca)?) {
                let c = c.map_err(|e| bad("client CA", ca, &e))?;
                roots.add(c).map_err(|e| bad("client CA", ca, &e))?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            )
            .build()
            .map_err(|e| bad("client CA", ca, &e))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(chain, key_der)
        .map_err(|e| bad("certificate and key", cert, &e))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Some(Arc::new(config)))
}

/// Client TLS: trust `ca` (PEM) besides the system roots; present `cert` + `key` when given
/// (mutual TLS); verify the server as `domain` when non-empty instead of the URL's host (useful
/// when connecting to pod IPs with a certificate issued for a Service name).
pub fn client_tls(
    ca: &Path,
    cert: &Path,
    key: &Path,
    domain: &str,
) -> Result<ClientTlsConfig, SecurityError> {
    let mut tls = ClientTlsConfig::new().with_enabled_roots();
    if let Some(ca) = given(ca) {
        tls = tls.ca_certificate(Certificate::from_pem(read("CA certificate", ca)?));
    }
    match (given(cert), given(key)) {
        (Some(cert), Some(key)) => tls = tls.identity(identity(cert, key)?),
        (None, None) => {}
        _ => {
            return Err(SecurityError::Invalid(
                "a client certificate needs both the certificate and its key (PEM files)".into(),
            ))
        }
    }
    if !domain.is_empty() {
        tls = tls.domain_name(domain);
    }
    Ok(tls)
}

/// How a client reaches a service: TLS settings for `https://` URLs and the token to send.
#[derive(Clone, Default)]
pub struct ClientSecurity {
    /// Used for `https://` URLs; `None` means the system roots only.
    pub tls: Option<ClientTlsConfig>,
    pub token: BearerToken,
}

impl ClientSecurity {
    /// An endpoint for `url` (`host:port` means `http://host:port`), with TLS when it is
    /// `https://`. TLS settings with a plaintext URL are refused rather than ignored.
    pub fn endpoint(&self, url: &str) -> Result<Endpoint, SecurityError> {
        let url = if url.contains("://") {
            url.to_string()
        } else {
            format!("http://{url}")
        };
        let endpoint = Endpoint::from_shared(url.clone())
            .map_err(|e| SecurityError::Invalid(format!("bad address {url:?}: {e}")))?;
        if url.starts_with("https://") {
            let tls = match &self.tls {
                Some(tls) => tls.clone(),
                None => ClientTlsConfig::new().with_enabled_roots(),
            };
            endpoint
                .tls_config(tls)
                .map_err(|e| SecurityError::Invalid(format!("TLS settings for {url}: {e}")))
        } else if self.tls.is_some() {
            Err(SecurityError::Invalid(format!(
                "TLS is configured but {url} is plaintext: use an https:// URL"
            )))
        } else {
            Ok(endpoint)
        }
    }
}

/// Read a token file: the first line that is neither blank nor a `#` comment.
pub fn read_token_file(path: &Path) -> Result<String, SecurityError> {
    let text = String::from_utf8(read("token file", path)?)
        .map_err(|_| SecurityError::Invalid(format!("{} is not UTF-8", path.display())))?;
    let token = token_lines(&text).next().map(str::to_string);
    token.ok_or_else(|| {
        SecurityError::Invalid(format!("token file {} has no token", path.display()))
    })
}

fn token_lines(text: &str) -> impl Iterator<Item = &str> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
}

/// Client side: adds `authorization: Bearer <token>` to every call (nothing when unset).
#[derive(Clone, Default)]
pub struct BearerToken(Option<MetadataValue<Ascii>>);

impl BearerToken {
    /// From a token (empty = none) or, when that is empty, a token file (empty path = none).
    pub fn new(token: &str, file: &Path) -> Result<Self, SecurityError> {
        let token = match (token.trim(), given(file)) {
            ("", None) => return Ok(Self(None)),
            ("", Some(file)) => read_token_file(file)?,
            (t, _) => t.to_string(),
        };
        let value = format!("Bearer {token}")
            .parse()
            .map_err(|_| SecurityError::Invalid("a token must be printable ASCII".into()))?;
        Ok(Self(Some(value)))
    }

    pub fn is_set(&self) -> bool {
        self.0.is_some()
    }
}

impl Interceptor for BearerToken {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.0 {
            request.metadata_mut().insert(AUTHORIZATION, v.clone());
        }
        Ok(request)
    }
}

/// Server side: accepts calls bearing one of the configured tokens; every call when none is
/// configured. Apply it to the sequoia services only, so health checks stay open for probes.
#[derive(Clone, Default)]
pub struct TokenCheck(Arc<Vec<[u8; 32]>>);

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl TokenCheck {
    /// Tokens from a list plus a file with one token per line (`#` comments and blank lines
    /// skipped; empty path = no file).
    pub fn load(tokens: &[String], file: &Path) -> Result<Self, SecurityError> {
        let mut all: Vec<String> = tokens
            .iter()
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty())
            .collect();
        if let Some(file) = given(file) {
            let text = String::from_utf8(read("token file", file)?)
                .map_err(|_| SecurityError::Invalid(format!("{} is not UTF-8", file.display())))?;
            let before = all.len();
            all.extend(token_lines(&text).map(str::to_string));
            if all.len() == before {
                return Err(SecurityError::Invalid(format!(
                    "token file {} has no token (auth would be off)",
                    file.display()
                )));
            }
        }
        Ok(Self(Arc::new(all.iter().map(|t| digest(t)).collect())))
    }

    pub fn is_enabled(&self) -> bool {
        !self.0.is_empty()
    }

    /// Whether an `authorization` value (header or metadata; `None` when absent) carries an
    /// accepted token. Always accepted when auth is off. Shared by the gRPC interceptor and
    /// the HTTP API, so both ports accept exactly the same tokens.
    pub fn accepts(&self, authorization: Option<&[u8]>) -> Result<(), TokenRefused> {
        if !self.is_enabled() {
            return Ok(());
        }
        let value = authorization.ok_or(TokenRefused::Missing)?;
        let token = std::str::from_utf8(value)
            .ok()
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .ok_or(TokenRefused::Malformed)?;
        if self.0.contains(&digest(token.trim())) {
            Ok(())
        } else {
            Err(TokenRefused::Invalid)
        }
    }

    /// UNAUTHENTICATED with a message that says what to send, unless the call carries a valid
    /// token (or auth is off).
    pub fn check(&self, metadata: &tonic::metadata::MetadataMap) -> Result<(), Status> {
        let value = metadata.get(AUTHORIZATION).map(|v| v.as_bytes());
        self.accepts(value).map_err(|r| {
            Status::unauthenticated(match r {
                TokenRefused::Missing => {
                    "missing bearer token: send the metadata `authorization: Bearer <token>` \
                     (sequoia generate --token or SEQUOIA_TOKEN)"
                }
                TokenRefused::Malformed => {
                    "malformed authorization metadata: expected `Bearer <token>`"
                }
                TokenRefused::Invalid => {
                    "invalid bearer token: not one this service accepts (auth_tokens / auth_tokens_file)"
                }
            })
        })
    }
}

/// Why [`TokenCheck::accepts`] refused a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenRefused {
    Missing,
    /// Not `Bearer <token>`.
    Malformed,
    /// Not one of the accepted tokens.
    Invalid,
}

impl Interceptor for TokenCheck {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        self.check(request.metadata())?;
        Ok(request)
    }
}

/// Bearer tokens over plaintext gRPC can be read by anyone on the path. When `tokens` are in
/// use and `tls` is off, log a loud warning, or refuse (`refuse`, the config key
/// `refuse_tokens_without_tls`). `what` says which tokens, for the message.
pub fn tokens_need_tls(
    tokens: bool,
    tls: bool,
    refuse: bool,
    what: &str,
) -> Result<(), SecurityError> {
    if !tokens || tls {
        return Ok(());
    }
    let m = format!(
        "{what} are configured without TLS: every token crosses the network in clear text; \
         configure TLS, or keep this to a trusted network"
    );
    if refuse {
        return Err(SecurityError::Invalid(format!(
            "{m} (refuse_tokens_without_tls is set, so the service does not start)"
        )));
    }
    tracing::warn!("INSECURE: {m} (set refuse_tokens_without_tls = true to refuse)");
    Ok(())
}

/// Kubernetes' gRPC probes speak plaintext and present no client certificate or token, so a
/// TLS or mutual-TLS service port cannot answer them. This serves `routes` (meant: the
/// grpc.health.v1 service alone) in plaintext on `listen` (empty = off) in a background task
/// that stops when the returned guard is dropped.
pub async fn spawn_probe_endpoint(
    routes: tonic::service::Routes,
    listen: &str,
) -> std::io::Result<Option<ProbeEndpoint>> {
    if listen.trim().is_empty() {
        return Ok(None);
    }
    let listener = tokio::net::TcpListener::bind(listen.trim())
        .await
        .map_err(|e| std::io::Error::new(e.kind(), format!("health_listen {listen}: {e}")))?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        let served = tonic::transport::Server::builder()
            .add_routes(routes)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await;
        if let Err(e) = served {
            tracing::warn!(error = %e, "health endpoint stopped");
        }
    });
    Ok(Some(ProbeEndpoint { addr, task }))
}

/// A running plaintext health endpoint; stops on drop.
pub struct ProbeEndpoint {
    pub addr: std::net::SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ProbeEndpoint {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    fn call_with(auth: Option<&str>) -> Request<()> {
        let mut r = Request::new(());
        if let Some(a) = auth {
            r.metadata_mut().insert(AUTHORIZATION, a.parse().unwrap());
        }
        r
    }

    #[test]
    fn tokens_from_list_and_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("tokens");
        std::fs::write(&file, "# operators\nfile-token\n\n  second  \n").unwrap();
        let mut check = TokenCheck::load(&["list-token".into()], &file).unwrap();
        for good in ["list-token", "file-token", "second"] {
            assert!(check
                .call(call_with(Some(&format!("Bearer {good}"))))
                .is_ok());
        }
        for (bad, says) in [
            (None, "missing bearer token"),
            (Some("Bearer nope"), "invalid bearer token"),
            (Some("Basic abc"), "malformed"),
        ] {
            let e = check.call(call_with(bad)).unwrap_err();
            assert_eq!(e.code(), Code::Unauthenticated);
            assert!(e.message().contains(says), "{}", e.message());
        }
        // No tokens: auth off.
        let mut open = TokenCheck::load(&[], Path::new("")).unwrap();
        assert!(open.call(call_with(None)).is_ok());
        // A file without tokens is a mistake, not "auth off".
        std::fs::write(&file, "# nothing\n").unwrap();
        assert!(TokenCheck::load(&[], &file).is_err());
    }

    #[test]
    fn bearer_token_from_value_or_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "from-file\n").unwrap();
        let mut t = BearerToken::new("", &file).unwrap();
        let r = t.call(Request::new(())).unwrap();
        assert_eq!(r.metadata().get(AUTHORIZATION).unwrap(), "Bearer from-file");
        let mut t = BearerToken::new("direct", &file).unwrap();
        let r = t.call(Request::new(())).unwrap();
        assert_eq!(r.metadata().get(AUTHORIZATION).unwrap(), "Bearer direct");
        assert!(!BearerToken::new("", Path::new("")).unwrap().is_set());
        assert!(BearerToken::new("has space", Path::new("")).is_ok());
        assert!(BearerToken::new("bad\ntoken", Path::new("")).is_err());
    }

    #[test]
    fn tokens_without_tls_warn_or_refuse() {
        assert!(tokens_need_tls(true, false, false, "auth_tokens").is_ok());
        let e = tokens_need_tls(true, false, true, "auth_tokens").unwrap_err();
        assert!(e.to_string().contains("clear text"), "{e}");
        assert!(tokens_need_tls(true, true, true, "auth_tokens").is_ok());
        assert!(tokens_need_tls(false, false, true, "auth_tokens").is_ok());
    }

    #[test]
    fn half_configured_tls_is_an_error() {
        let none = Path::new("");
        assert!(server_tls(none, none, none).unwrap().is_none());
        assert!(server_tls(Path::new("/c.pem"), none, none).is_err());
        assert!(server_tls(none, none, Path::new("/ca.pem")).is_err());
        assert!(rustls_server_config(none, none, none).unwrap().is_none());
        assert!(rustls_server_config(Path::new("/c.pem"), none, none).is_err());
        assert!(rustls_server_config(none, none, Path::new("/ca.pem")).is_err());
        assert!(client_tls(none, Path::new("/c.pem"), none, "").is_err());
        let plain = ClientSecurity::default();
        assert!(plain.endpoint("127.0.0.1:1").is_ok());
        let tls = ClientSecurity {
            tls: Some(client_tls(none, none, none, "").unwrap()),
            ..Default::default()
        };
        assert!(tls.endpoint("http://127.0.0.1:1").is_err());
        assert!(tls.endpoint("https://127.0.0.1:1").is_ok());
    }
}

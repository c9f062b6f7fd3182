//! The egress proxy: where secrets are injected, on the host, outside every
//! sandbox.
//!
//! The host's nftables redirect the HTTPS flows (TCP 443, IPv4) of each
//! sandbox that names secrets, those its network policy allows, to this
//! proxy on the gateway address (policy/network.nft, `inject_prerouting`).
//! For each connection the proxy reads the TLS ClientHello (bounded), and:
//!
//! - when its SNI is a host one of the sandbox's secrets lists, it ends the
//!   TLS itself with a certificate for that name, signed by the daemon's CA
//!   (which hutch bound into the sandbox's CA bundle), opens its own TLS
//!   connection to the original destination and verifies it against that
//!   name with the host's roots (and the operator's extra roots), and
//!   relays HTTP/1.1 requests through hyper, replacing each placeholder of
//!   a secret that lists the host in the request's headers (never in
//!   bodies, URLs or responses) and setting a secret's configured header;
//! - otherwise (another name, no SNI, not TLS) it relays the bytes to the
//!   original destination untouched: never a certificate of its own.
//!
//! The value reaches only a server that proved, with a certificate the
//! host trusts, that it is one of the secret's hosts.

use hutch_control::secrets::{host_matches, original_dst, replace_placeholders, Injection};
use hutch_control::Control;
use hyper_util::rt::{TokioIo, TokioTimer};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, SocketAddrV4};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};

/// Most bytes of a ClientHello read before giving up on finding its SNI.
pub const MAX_HELLO: usize = 16 * 1024;
/// Most bytes of a request's or response's head (hyper's read buffer).
pub const MAX_HEAD: usize = 64 * 1024;
/// Leaf certificates kept (per SNI name); the cache starts over past it.
pub const MAX_LEAVES: usize = 1024;
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);
/// The CA's subject; the same every time it is loaded.
const CA_NAME: &str = "hutch egress proxy CA";

fn io_err(what: &str, e: impl std::fmt::Display) -> io::Error {
    io::Error::other(format!("{what}: {e}"))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The daemon's CA: its key (0600) and certificate in `<state>/egress/`,
/// made at first start and kept.
pub struct Ca {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
    /// The certificate as stored (what sandboxes trust).
    pem: String,
}

fn ca_params() -> rcgen::CertificateParams {
    let mut p = rcgen::CertificateParams::default();
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.distinguished_name.push(rcgen::DnType::CommonName, CA_NAME);
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    p.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign];
    p.not_before = rcgen::date_time_ymd(2024, 1, 1);
    p.not_after = rcgen::date_time_ymd(2049, 12, 31);
    p
}

fn write_new(path: &Path, text: &str, mode: u32) -> io::Result<()> {
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(path)?;
    std::io::Write::write_all(&mut f, text.as_bytes())?;
    f.sync_all()
}

impl Ca {
    /// Loads the CA in `dir`, or makes it.
    pub fn load_or_create(dir: &Path) -> io::Result<Ca> {
        std::fs::create_dir_all(dir)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
        let (key_path, cert_path) = (dir.join("ca.key"), dir.join("ca.crt"));
        let key = match std::fs::read_to_string(&key_path) {
            Ok(pem) => rcgen::KeyPair::from_pem(&pem).map_err(|e| io_err("egress CA key", e))?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let key = rcgen::KeyPair::generate().map_err(|e| io_err("egress CA key", e))?;
                let _ = std::fs::remove_file(&cert_path);
                write_new(&key_path, &key.serialize_pem(), 0o600)?;
                key
            }
            Err(e) => return Err(e),
        };
        // The issuer is rebuilt from the same subject and key: what signs
        // leaves is the same CA whatever certificate is on disk.
        let cert = ca_params().self_signed(&key).map_err(|e| io_err("egress CA", e))?;
        let pem = match std::fs::read_to_string(&cert_path) {
            Ok(pem) => pem,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                write_new(&cert_path, &cert.pem(), 0o644)?;
                cert.pem()
            }
            Err(e) => return Err(e),
        };
        Ok(Ca { cert, key, pem })
    }

    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// A certificate and key for `host`, signed by the CA.
    fn leaf(&self, host: &str) -> io::Result<(CertificateDer<'static>, PrivateKeyDer<'static>)> {
        let key = rcgen::KeyPair::generate().map_err(|e| io_err("leaf key", e))?;
        let mut p = rcgen::CertificateParams::new(vec![host.to_owned()]).map_err(|e| io_err("leaf", e))?;
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.distinguished_name.push(rcgen::DnType::CommonName, host);
        p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
        p.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
        p.use_authority_key_identifier_extension = true;
        p.not_before = rcgen::date_time_ymd(2024, 1, 1);
        p.not_after = rcgen::date_time_ymd(2049, 12, 31);
        let cert = p.signed_by(&key, &self.cert, &self.key).map_err(|e| io_err("leaf", e))?;
        Ok((cert.der().clone(), PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()))))
    }
}

/// Writes `<dir>/ca-bundle.crt`: the host's CA bundle (if any) and the
/// daemon's CA, what sandboxes that name secrets get as theirs.
pub fn write_bundle(dir: &Path, ca: &Ca) -> io::Result<PathBuf> {
    let host = ["/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt"]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok())
        .unwrap_or_default();
    let mut text = host;
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    text.push_str(ca.pem());
    let path = dir.join("ca-bundle.crt");
    let tmp = dir.join("ca-bundle.crt.tmp");
    let _ = std::fs::remove_file(&tmp);
    write_new(&tmp, &text, 0o644)?;
    std::fs::rename(&tmp, &path)?;
    Ok(path)
}

/// Roots the proxy trusts upstream: Mozilla's, and the operator's extra
/// PEM files.
pub fn upstream_roots(extra: &[PathBuf]) -> io::Result<rustls::RootCertStore> {
    let mut roots = rustls::RootCertStore { roots: webpki_roots::TLS_SERVER_ROOTS.to_vec() };
    for file in extra {
        let pem = std::fs::read(file).map_err(|e| io_err(&file.display().to_string(), e))?;
        let mut n = 0;
        for cert in CertificateDer::pem_slice_iter(&pem) {
            let cert = cert.map_err(|e| io_err(&file.display().to_string(), e))?;
            roots.add(cert).map_err(|e| io_err(&file.display().to_string(), e))?;
            n += 1;
        }
        if n == 0 {
            return Err(io_err(&file.display().to_string(), "holds no certificate"));
        }
    }
    Ok(roots)
}

/// The proxy.
pub struct Egress {
    ca: Ca,
    upstream: Arc<rustls::ClientConfig>,
    leaves: Mutex<HashMap<String, Arc<rustls::ServerConfig>>>,
}

impl Egress {
    pub fn new(ca: Ca, roots: rustls::RootCertStore) -> io::Result<Egress> {
        let mut upstream = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| io_err("upstream TLS", e))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        upstream.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Egress { ca, upstream: Arc::new(upstream), leaves: Mutex::new(HashMap::new()) })
    }

    /// The TLS server side for `host`, made once and cached.
    fn server_config(&self, host: &str) -> io::Result<Arc<rustls::ServerConfig>> {
        if let Some(c) = self.leaves.lock().map_err(|_| io_err("leaves", "poisoned"))?.get(host) {
            return Ok(c.clone());
        }
        let (cert, key) = self.ca.leaf(host)?;
        let mut c = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| io_err("TLS", e))?
            .with_no_client_auth()
            .with_single_cert(vec![cert], key)
            .map_err(|e| io_err("TLS", e))?;
        c.alpn_protocols = vec![b"http/1.1".to_vec()];
        let c = Arc::new(c);
        let mut leaves = self.leaves.lock().map_err(|_| io_err("leaves", "poisoned"))?;
        if leaves.len() >= MAX_LEAVES {
            leaves.clear();
        }
        leaves.insert(host.to_owned(), c.clone());
        Ok(c)
    }

    /// Serves connections until the listener fails.
    pub async fn serve(self: Arc<Self>, control: Arc<Control>, listener: TcpListener) {
        loop {
            let (sock, peer) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!("egress proxy: accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let (this, control) = (self.clone(), control.clone());
            tokio::spawn(async move {
                if let Err(e) = this.handle(&control, sock, peer).await {
                    tracing::debug!("egress proxy: {peer}: {e}");
                }
            });
        }
    }

    async fn handle(&self, control: &Control, mut client: TcpStream, peer: SocketAddr) -> io::Result<()> {
        let orig = original_dst(&client)?;
        if SocketAddr::V4(orig) == client.local_addr()? {
            return Err(io_err("refused", "dialled the proxy itself"));
        }
        let (hello, sni) = tokio::time::timeout(HELLO_TIMEOUT, read_hello(&mut client))
            .await
            .map_err(|_| io_err("ClientHello", "timed out"))??;
        let injections = match &sni {
            Some(_) => control.egress_secrets(peer.ip()).await.map(|(_, i)| i).unwrap_or_default(),
            None => Vec::new(),
        };
        let host = sni.filter(|h| injections.iter().any(|i| host_matches(&i.hosts, h)));
        match host {
            None => passthrough(client, hello, orig).await,
            Some(host) => {
                let mine: Vec<Injection> = injections.into_iter().filter(|i| host_matches(&i.hosts, &host)).collect();
                self.intercept(client, hello, orig, host, mine).await
            }
        }
    }

    async fn intercept(
        &self,
        client: TcpStream,
        hello: Vec<u8>,
        orig: SocketAddrV4,
        host: String,
        injections: Vec<Injection>,
    ) -> io::Result<()> {
        let name = ServerName::try_from(host.clone()).map_err(|e| io_err("SNI", e))?;
        // Upstream first: a host that does not prove its name gets nothing,
        // and the sandbox's handshake fails with it.
        let tcp = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(orig))
            .await
            .map_err(|_| io_err("connect", "timed out"))??;
        let upstream = tokio_rustls::TlsConnector::from(self.upstream.clone()).connect(name, tcp).await?;
        let acceptor = tokio_rustls::TlsAcceptor::from(self.server_config(&host)?);
        let downstream = acceptor.accept(Prefixed { prefix: hello, at: 0, inner: client }).await?;
        let (sender, conn) = hyper::client::conn::http1::Builder::new()
            .max_buf_size(MAX_HEAD)
            .handshake::<_, hyper::body::Incoming>(TokioIo::new(upstream))
            .await
            .map_err(|e| io_err("upstream HTTP", e))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let sender = Arc::new(tokio::sync::Mutex::new(sender));
        let injections = Arc::new(injections);
        let service = hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
            let (sender, injections) = (sender.clone(), injections.clone());
            async move {
                inject(req.headers_mut(), &injections);
                let sent = sender.lock().await.send_request(req).await;
                Ok::<_, std::convert::Infallible>(match sent {
                    Ok(resp) => resp.map(axum::body::Body::new),
                    Err(e) => {
                        tracing::debug!("egress proxy: upstream: {e}");
                        let mut r =
                            hyper::Response::new(axum::body::Body::from("hutch egress proxy: upstream failed\n"));
                        *r.status_mut() = hyper::StatusCode::BAD_GATEWAY;
                        r
                    }
                })
            }
        });
        hyper::server::conn::http1::Builder::new()
            .max_buf_size(MAX_HEAD)
            .timer(TokioTimer::new())
            .header_read_timeout(HEAD_TIMEOUT)
            .serve_connection(TokioIo::new(downstream), service)
            .await
            .map_err(|e| io_err("HTTP", e))
    }
}

/// Sets each secret's configured header and replaces the placeholders of
/// `injections` (the secrets that list this host) in every header value.
pub fn inject(headers: &mut hyper::HeaderMap, injections: &[Injection]) {
    let pairs: Vec<(&[u8], &[u8])> =
        injections.iter().map(|i| (i.placeholder.as_bytes(), i.value.as_bytes())).collect();
    for (_, v) in headers.iter_mut() {
        let bytes = v.as_bytes();
        if !bytes
            .windows(hutch_control::secrets::PLACEHOLDER_PREFIX.len())
            .any(|w| w == hutch_control::secrets::PLACEHOLDER_PREFIX.as_bytes())
        {
            continue;
        }
        let new = replace_placeholders(bytes, &pairs);
        if let Ok(value) = hyper::header::HeaderValue::from_bytes(&new) {
            *v = value;
        }
    }
    for i in injections {
        if let Some((name, value)) = &i.header {
            if let (Ok(n), Ok(v)) =
                (hyper::header::HeaderName::from_bytes(name.as_bytes()), hyper::header::HeaderValue::from_str(value))
            {
                headers.insert(n, v);
            }
        }
    }
}

/// Reads the client's first bytes until its ClientHello is whole (or
/// MAX_HELLO, or it is not TLS): what was read, and the SNI name if any.
async fn read_hello(client: &mut TcpStream) -> io::Result<(Vec<u8>, Option<String>)> {
    let mut acceptor = rustls::server::Acceptor::default();
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    while buf.len() < MAX_HELLO {
        let n = client.read(&mut chunk).await?;
        if n == 0 {
            return Err(io_err("ClientHello", "the client closed"));
        }
        buf.extend_from_slice(&chunk[..n]);
        let mut rd = &chunk[..n];
        while !rd.is_empty() {
            if acceptor.read_tls(&mut rd).is_err() {
                return Ok((buf, None));
            }
        }
        match acceptor.accept() {
            Ok(Some(accepted)) => {
                let sni = accepted.client_hello().server_name().map(str::to_owned);
                return Ok((buf, sni));
            }
            Ok(None) => continue,
            Err(_) => return Ok((buf, None)),
        }
    }
    Ok((buf, None))
}

/// Relays a connection the proxy does not look into.
async fn passthrough(mut client: TcpStream, hello: Vec<u8>, orig: SocketAddrV4) -> io::Result<()> {
    let mut up = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(orig))
        .await
        .map_err(|_| io_err("connect", "timed out"))??;
    up.write_all(&hello).await?;
    tokio::io::copy_bidirectional(&mut client, &mut up).await?;
    Ok(())
}

/// A stream that yields `prefix` before what `inner` reads.
struct Prefixed {
    prefix: Vec<u8>,
    at: usize,
    inner: TcpStream,
}

impl AsyncRead for Prefixed {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        if self.at < self.prefix.len() {
            let n = (self.prefix.len() - self.at).min(buf.remaining());
            let at = self.at;
            buf.put_slice(&self.prefix[at..at + n]);
            self.at += n;
            return std::task::Poll::Ready(Ok(()));
        }
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Prefixed {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn injection(placeholder: &str, value: &str, header: Option<(&str, &str)>) -> Injection {
        Injection {
            name: "T".into(),
            placeholder: placeholder.into(),
            value: value.into(),
            hosts: vec!["api.example.com".into()],
            header: header.map(|(h, v)| (h.to_owned(), v.to_owned())),
        }
    }

    #[test]
    fn placeholders_in_headers_become_values_and_configured_headers_are_set() {
        let mut h = hyper::HeaderMap::new();
        h.insert("x-key", "hutch-secret-aaaa".parse().expect("value"));
        h.insert("x-other", "hutch-secret-bbbb".parse().expect("value"));
        h.insert("authorization", "Basic old".parse().expect("value"));
        inject(&mut h, &[injection("hutch-secret-aaaa", "VALUE", Some(("Authorization", "Bearer VALUE")))]);
        assert_eq!(h["x-key"], "VALUE");
        assert_eq!(h["x-other"], "hutch-secret-bbbb");
        assert_eq!(h["authorization"], "Bearer VALUE");
    }

    #[test]
    fn the_ca_is_made_once_its_key_0600_and_signs_leaves() {
        let dir = std::env::temp_dir().join(format!("hutch-egress-ca-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ca = Ca::load_or_create(&dir).expect("make");
        let mode = std::fs::metadata(dir.join("ca.key")).expect("stat").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let again = Ca::load_or_create(&dir).expect("load");
        assert_eq!(again.pem(), ca.pem());
        let bundle = write_bundle(&dir, &again).expect("bundle");
        assert!(std::fs::read_to_string(bundle).expect("read").ends_with(ca.pem()));
        // A leaf of the reloaded CA verifies against the stored certificate.
        let (leaf, _) = again.leaf("api.example.com").expect("leaf");
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(ca.pem().as_bytes()) {
            roots.add(c.expect("pem")).expect("add");
        }
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
            .build()
            .expect("v");
        let name = ServerName::try_from("api.example.com").expect("name");
        let now = rustls::pki_types::UnixTime::now();
        use rustls::client::danger::ServerCertVerifier;
        verifier.verify_server_cert(&leaf, &[], &name, &[], now).expect("verifies");
        let other = ServerName::try_from("other.example.com").expect("name");
        assert!(verifier.verify_server_cert(&leaf, &[], &other, &[], now).is_err());
        std::fs::remove_dir_all(&dir).expect("clean");
    }
}

//! Pulls from an OCI registry over the Distribution v2 HTTP API: manifest
//! lists and indexes (linux/amd64 is picked), Docker schema 2 and OCI
//! manifests, anonymous access and Bearer tokens got through the
//! `WWW-Authenticate` challenge. HTTPS always, except for loopback
//! registries or with `insecure`. Every manifest, configuration and layer
//! is checked against its digest; manifests and configurations are bounded
//! by [`super::archive::MAX_JSON`], layers by [`Limits`]. Layers stream from
//! the network straight into [`super::extract`].
//!
//! This is an HTTP *client*; hutch-server stays the only crate that serves
//! HTTP.

use super::archive::{check_bytes, diff_ids, is_index, parse_manifest, pick_platform, MAX_JSON};
use super::extract::import_layer;
use super::{local_name, Image, ImageConfig, ImageError, ImageStore, Limits};
use std::io::Read;
use std::time::Duration;

const ACCEPT: &str = "application/vnd.oci.image.index.v1+json, \
application/vnd.docker.distribution.manifest.list.v2+json, \
application/vnd.oci.image.manifest.v1+json, \
application/vnd.docker.distribution.manifest.v2+json";

fn reg(msg: impl Into<String>) -> ImageError {
    ImageError::Registry(msg.into())
}

/// A parsed image reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    /// host[:port] as given (docker.io for the default registry).
    pub registry: String,
    pub repository: String,
    /// A tag or a `sha256:` digest.
    pub reference: String,
}

/// Longest image reference, as given and in full (`registry/repository`,
/// then `:tag` or `@digest`).
const MAX_REFERENCE: usize = 512;

impl Reference {
    /// Parses `[registry/]repository[:tag][@digest]`, as docker does.
    pub fn parse(s: &str) -> Result<Reference, ImageError> {
        let bad = || reg(format!("{s:?} is not an image reference"));
        if s.is_empty() || s.len() > MAX_REFERENCE || s.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(bad());
        }
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => (r, Some(d.to_owned())),
            None => (s, None),
        };
        let (registry, path) = match rest.split_once('/') {
            Some((first, p)) if first.contains('.') || first.contains(':') || first == "localhost" => {
                (first.to_owned(), p.to_owned())
            }
            _ => ("docker.io".to_owned(), rest.to_owned()),
        };
        let (repository, tag) = match path.rsplit_once(':') {
            Some((r, t)) if !t.contains('/') => (r.to_owned(), Some(t.to_owned())),
            _ => (path, None),
        };
        let (host, port) = registry.split_once(':').unwrap_or((&registry, "0"));
        let host_ok = !host.is_empty()
            && host.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-'))
            && !port.is_empty()
            && port.len() <= 5
            && port.bytes().all(|b| b.is_ascii_digit());
        if !host_ok {
            return Err(bad());
        }
        let repository = if registry == "docker.io" && !repository.contains('/') {
            format!("library/{repository}")
        } else {
            repository
        };
        let repo_ok = !repository.is_empty()
            && repository.split('/').all(|c| {
                !c.is_empty()
                    && c.bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-'))
            });
        let reference = digest.or(tag).unwrap_or_else(|| "latest".into());
        let ref_ok = reference.len() <= 128
            && reference.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b':'));
        // In full it may be longer than as given (`docker.io/library/`,
        // `:latest`): held to the same bound, it reads back the same.
        let full = registry.len() + 1 + repository.len() + 1 + reference.len();
        if !repo_ok || !ref_ok || full > MAX_REFERENCE {
            return Err(bad());
        }
        Ok(Reference { registry, repository, reference })
    }

    fn host(&self) -> &str {
        if self.registry == "docker.io" {
            "registry-1.docker.io"
        } else {
            &self.registry
        }
    }

    /// Whether the registry is on this machine (plain HTTP is allowed).
    pub fn is_loopback(&self) -> bool {
        let host = self.registry.rsplit_once(':').map_or(self.registry.as_str(), |(h, port)| {
            if port.bytes().all(|b| b.is_ascii_digit()) {
                h
            } else {
                self.registry.as_str()
            }
        });
        let host = host.trim_start_matches('[').trim_end_matches(']');
        host == "localhost" || host.parse::<std::net::IpAddr>().map(|ip| ip.is_loopback()).unwrap_or(false)
    }
}

/// What a pull may do.
#[derive(Debug, Clone, Default)]
pub struct PullOptions {
    /// Allow plain HTTP to a registry that is not on loopback.
    pub insecure: bool,
    pub name: Option<String>,
    pub limits: Limits,
}

pub(super) struct Client {
    pub(super) agent: ureq::Agent,
    pub(super) base: String,
    pub(super) repo: String,
    pub(super) token: Option<String>,
}

/// The agent of every registry call: bounded waits, a few redirects.
pub(super) fn agent() -> ureq::Agent {
    ureq::AgentBuilder::new()
        .timeout_connect(Duration::from_secs(15))
        .timeout_read(Duration::from_secs(60))
        .timeout_write(Duration::from_secs(60))
        .redirects(5)
        .build()
}

impl Client {
    fn get(&mut self, path: &str, accept: Option<&str>) -> Result<ureq::Response, ImageError> {
        let url = format!("{}/v2/{}/{}", self.base, self.repo, path);
        self.call("GET", &url, &[("Accept", accept.unwrap_or(""))], None)
    }

    /// One request to `url` (this registry's), with the token got through
    /// a 401's challenge if one comes; `body` is sent as it is (none: an
    /// empty request). An answer other than 2xx is an error naming it.
    pub(super) fn call(
        &mut self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: Option<&[u8]>,
    ) -> Result<ureq::Response, ImageError> {
        let mut retried = false;
        loop {
            let mut req = self.agent.request(method, url);
            for (k, v) in headers.iter().filter(|(_, v)| !v.is_empty()) {
                req = req.set(k, v);
            }
            if let Some(t) = &self.token {
                req = req.set("Authorization", &format!("Bearer {t}"));
            }
            let sent = match body {
                Some(b) => req.send_bytes(b),
                None => req.call(),
            };
            match sent {
                Ok(r) => return Ok(r),
                Err(ureq::Error::Status(401, r)) if !retried => {
                    let challenge = r.header("www-authenticate").unwrap_or("").to_owned();
                    self.token = Some(self.fetch_token(&challenge)?);
                    retried = true;
                }
                Err(ureq::Error::Status(code, r)) => return Err(status_error(method, url, code, r)),
                Err(ureq::Error::Transport(t)) => return Err(reg(t.to_string())),
            }
        }
    }

    /// A Bearer token for the challenge `Bearer realm="..",service="..",scope=".."`.
    fn fetch_token(&self, challenge: &str) -> Result<String, ImageError> {
        let Some(params) = challenge.strip_prefix("Bearer ").or_else(|| challenge.strip_prefix("bearer ")) else {
            return Err(reg(format!(
                "authentication required ({challenge:?}); only anonymous Bearer tokens are supported"
            )));
        };
        let mut realm = None;
        let mut query = Vec::new();
        for (k, v) in parse_params(params) {
            match k.as_str() {
                "realm" => realm = Some(v),
                "service" | "scope" => query.push((k, v)),
                _ => {}
            }
        }
        let realm = realm.ok_or_else(|| reg("token challenge without realm"))?;
        if !(realm.starts_with("https://") || (realm.starts_with("http://") && self.base.starts_with("http://"))) {
            return Err(reg(format!("token realm {realm:?} is not https")));
        }
        let mut req = self.agent.get(&realm);
        for (k, v) in &query {
            req = req.query(k, v);
        }
        let resp = req.call().map_err(|e| reg(format!("token from {realm}: {e}")))?;
        let body = read_bounded(resp, MAX_JSON, "token")?;
        let v: serde_json::Value = serde_json::from_slice(&body).map_err(|e| reg(format!("token: {e}")))?;
        v["token"]
            .as_str()
            .or_else(|| v["access_token"].as_str())
            .filter(|t| !t.is_empty() && t.len() < 16 * 1024)
            .map(str::to_owned)
            .ok_or_else(|| reg("token answer without a token"))
    }

    /// A manifest (or index) by tag or digest, checked against the digest.
    fn manifest(&mut self, reference: &str) -> Result<serde_json::Value, ImageError> {
        let resp = self.get(&format!("manifests/{reference}"), Some(ACCEPT))?;
        let header_digest = resp.header("docker-content-digest").map(str::to_owned);
        let body = read_bounded(resp, MAX_JSON, "manifest")?;
        if reference.starts_with("sha256:") {
            check_bytes("manifest", &body, Some(reference))?;
        } else if let Some(d) = header_digest.filter(|d| d.starts_with("sha256:")) {
            check_bytes("manifest", &body, Some(&d))?;
        }
        serde_json::from_slice(&body).map_err(|e| reg(format!("manifest: not JSON: {e}")))
    }
}

/// An answer other than 2xx, with the start of its body.
pub(super) fn status_error(method: &str, url: &str, code: u16, r: ureq::Response) -> ImageError {
    let body = read_bounded(r, 4096, "answer").map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default();
    let url = url.split('?').next().unwrap_or(url);
    reg(format!("{method} {url}: HTTP {code}: {}", body.chars().take(300).collect::<String>()))
}

pub(super) fn read_bounded(resp: ureq::Response, max: u64, what: &str) -> Result<Vec<u8>, ImageError> {
    let mut body = Vec::new();
    resp.into_reader().take(max + 1).read_to_end(&mut body).map_err(|e| reg(format!("{what}: {e}")))?;
    if body.len() as u64 > max {
        return Err(reg(format!("{what}: larger than {max} bytes")));
    }
    Ok(body)
}

/// `k="v",k2="v2"` pairs of a challenge (the registry's word, untrusted).
#[doc(hidden)] // public for the fuzz targets (fuzz/)
pub fn parse_params(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = s.trim();
    while let Some((k, after)) = rest.split_once('=') {
        let k = k.trim().trim_start_matches(',').trim().to_ascii_lowercase();
        let (v, next) = if let Some(q) = after.strip_prefix('"') {
            match q.split_once('"') {
                Some((v, n)) => (v.to_owned(), n),
                None => (q.to_owned(), ""),
            }
        } else {
            match after.split_once(',') {
                Some((v, n)) => (v.trim().to_owned(), n),
                None => (after.trim().to_owned(), ""),
            }
        };
        out.push((k, v));
        rest = next.trim_start_matches(',').trim();
    }
    out
}

/// A pull under way: the manifest and configuration read and checked,
/// the layers fetched one by one as the caller asks.
pub struct Pulling {
    c: Client,
    reference: String,
    config: serde_json::Value,
    refs: Vec<super::archive::LayerRef>,
    /// The layers' diff_ids (`sha256:...`), bottom first.
    ids: Vec<String>,
}

impl Pulling {
    /// Reads `reference`'s manifest (an index: the linux/amd64 one) and
    /// configuration, each checked against its digest.
    pub fn open(reference: &str, opts: &PullOptions) -> Result<Pulling, ImageError> {
        let r = Reference::parse(reference)?;
        let scheme = if r.is_loopback() || opts.insecure { "http" } else { "https" };
        let mut c = Client {
            agent: agent(),
            base: format!("{scheme}://{}", r.host()),
            repo: r.repository.clone(),
            token: None,
        };
        let mut doc = c.manifest(&r.reference)?;
        for _ in 0..4 {
            if !is_index(&doc) {
                break;
            }
            let d = pick_platform(reference, &doc)?;
            doc = c.manifest(&d)?;
        }
        let (config_digest, refs) = parse_manifest(reference, &doc)?;
        let body = read_bounded(c.get(&format!("blobs/{config_digest}"), None)?, MAX_JSON, "config")?;
        check_bytes("config", &body, Some(&config_digest))?;
        let config: serde_json::Value = serde_json::from_slice(&body).map_err(|e| reg(format!("config: {e}")))?;
        let ids = diff_ids(reference, &config, refs.len())?;
        Ok(Pulling { c, reference: reference.to_owned(), config, refs, ids })
    }

    /// The image configuration (checked against its digest).
    pub fn config(&self) -> &serde_json::Value {
        &self.config
    }

    /// How many layers the image has.
    pub fn layers(&self) -> usize {
        self.refs.len()
    }

    fn blob(&mut self, i: usize, limits: &Limits) -> Result<impl Read, ImageError> {
        let l = &self.refs[i];
        if l.size.is_some_and(|s| s > limits.max_bytes) {
            return Err(ImageError::LayerRefused(format!("{}: larger than the layer limit", l.digest)));
        }
        let digest = l.digest.clone();
        let resp = self.c.get(&format!("blobs/{digest}"), None)?;
        Ok(resp.into_reader().take(limits.max_bytes.saturating_add(limits.max_bytes / 64 + (1 << 20))))
    }

    /// Layer `i` (bottom first) in the store (fetched unless the store has
    /// it): its diff_id (hex).
    pub fn import(&mut self, store: &ImageStore, i: usize, limits: &Limits) -> Result<String, ImageError> {
        let hex = super::extract::digest_hex(&self.ids[i])?.to_owned();
        if store.has_layer(&hex) {
            return Ok(hex);
        }
        let body = self.blob(i, limits)?;
        import_layer(store, body, Some(&self.refs[i].digest.clone()), Some(&self.ids[i].clone()), limits)
    }

    /// Layer `i` extracted into `dir` (an existing, empty directory), its
    /// digests checked; on an error `dir` holds part of it (the caller
    /// removes it).
    pub fn extract(&mut self, i: usize, dir: &std::path::Path, limits: &Limits) -> Result<String, ImageError> {
        let body = self.blob(i, limits)?;
        let (digest, id) = (self.refs[i].digest.clone(), self.ids[i].clone());
        super::extract::extract_checked(body, Some(&digest), Some(&id), dir, limits)
    }
}

/// Pulls `reference` into the store and records it (default name: the
/// reference's [`local_name`]).
pub fn pull(store: &ImageStore, reference: &str, opts: &PullOptions) -> Result<Image, ImageError> {
    let _lock = store.lock(libc::LOCK_SH)?;
    let mut p = Pulling::open(reference, opts)?;
    let mut layers = Vec::new();
    for i in 0..p.layers() {
        layers.push(p.import(store, i, &opts.limits)?);
    }
    let name = opts.name.clone().unwrap_or_else(|| local_name(reference));
    store.finish_image(&name, layers, ImageConfig::from_oci(&p.config), format!("pull:{}", p.reference))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_parse_like_docker() {
        let r = Reference::parse("127.0.0.1:5000/x/y:tag").expect("parse");
        assert_eq!(
            (r.registry.as_str(), r.repository.as_str(), r.reference.as_str()),
            ("127.0.0.1:5000", "x/y", "tag")
        );
        assert!(r.is_loopback());
        let r = Reference::parse("debian").expect("parse");
        assert_eq!(
            (r.host(), r.repository.as_str(), r.reference.as_str()),
            ("registry-1.docker.io", "library/debian", "latest")
        );
        assert!(!r.is_loopback());
        let r = Reference::parse("localhost/a@sha256:abc").expect("parse");
        assert_eq!(r.reference, "sha256:abc");
        assert!(r.is_loopback());
        assert!(!Reference::parse("ghcr.io/o/r:1").expect("parse").is_loopback());
        assert!(!Reference::parse("127.0.0.1.evil.com/x").expect("parse").is_loopback());
        for bad in ["", "a b", "x/Y", "x//y", "x:../y"] {
            assert!(Reference::parse(bad).is_err(), "{bad}");
        }
        // Within the bound as given but not in full (`:latest` added): a
        // reference that could not be read back is refused (found by the
        // image_names fuzz target).
        let long = format!("r.io/{}", "a".repeat(MAX_REFERENCE - 5));
        assert_eq!(long.len(), MAX_REFERENCE);
        assert!(Reference::parse(&long).is_err());
        let fits = format!("r.io/{}", "a".repeat(MAX_REFERENCE - 5 - ":latest".len()));
        let r = Reference::parse(&fits).expect("fits in full");
        let again = format!("{}/{}:{}", r.registry, r.repository, r.reference);
        assert_eq!(again.len(), MAX_REFERENCE);
        assert_eq!(Reference::parse(&again).expect("again"), r);
    }

    #[test]
    fn challenges_parse() {
        let p = parse_params(
            r#"realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/debian:pull""#,
        );
        assert_eq!(p[0], ("realm".into(), "https://auth.docker.io/token".into()));
        assert_eq!(p[2], ("scope".into(), "repository:library/debian:pull".into()));
    }
}

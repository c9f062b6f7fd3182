//! Pushes an exported image ([`super::export::Plan`]: layers in OCI form,
//! its configuration and manifest) to an OCI registry over the
//! Distribution v2 HTTP API, for the fleet's moves between nodes: each
//! blob the repository does not have yet (a `HEAD` says) is uploaded in
//! one `PUT` after a `POST` opened the upload, then the manifest is put
//! under its own digest. The reference returned names the manifest by
//! digest, so a pull of it gets these bytes or fails their check.
//!
//! The same rules as the pull side ([`super::registry`]): HTTPS, except
//! for a registry on loopback or with `insecure`; anonymous access, or a
//! Bearer token got through the `WWW-Authenticate` challenge; bounded
//! waits and answers. Layers stream from the layer's tree (written as
//! they were measured, else [`super::export::ExportError::Changed`]);
//! nothing is buffered on disk.

use super::export::{write_layer, Blob, Plan, MEDIA_MANIFEST};
use super::registry::{agent, read_bounded, status_error, Client, Reference};
use super::ImageError;
use std::io::Write;

fn reg(msg: impl Into<String>) -> ImageError {
    ImageError::Registry(msg.into())
}

/// Where a fleet's nodes push: a registry and a repository prefix, from
/// `http[s]://host[:port][/prefix]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// `host[:port]`.
    pub registry: String,
    /// Repository path under which every pushed repository goes (may be empty).
    pub prefix: String,
    /// Plain HTTP to a registry not on loopback was allowed.
    pub insecure: bool,
}

impl Target {
    /// Parses `http[s]://host[:port][/prefix]`. Plain HTTP only to
    /// loopback, or with `insecure`; HTTPS is what a registry on another
    /// host is reached with (as pulls decide).
    pub fn parse(url: &str, insecure: bool) -> Result<Target, ImageError> {
        let bad = |why: &str| reg(format!("registry URL {url:?}: {why}"));
        let (scheme, rest) = url.split_once("://").ok_or_else(|| bad("give http[s]://host[:port][/prefix]"))?;
        let rest = rest.trim_end_matches('/');
        let (registry, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if registry.contains('@') {
            return Err(bad("credentials in the URL are not supported (anonymous or token access only)"));
        }
        if !(registry.contains('.') || registry.contains(':') || registry == "localhost") {
            return Err(bad("name the registry as host.domain, host:port or localhost"));
        }
        // The rules of a reference: check one made under it.
        let probe = format!(
            "{registry}/{}x@sha256:{}",
            if prefix.is_empty() { String::new() } else { format!("{prefix}/") },
            "0".repeat(64)
        );
        let r = Reference::parse(&probe).map_err(|_| bad("not a registry host and repository path"))?;
        let target = Target { registry: registry.to_owned(), prefix: prefix.to_owned(), insecure };
        match scheme {
            "http" if !(r.is_loopback() || insecure) => {
                Err(bad("plain HTTP is allowed to a registry on loopback only, unless insecure registries are allowed"))
            }
            "http" => Ok(target),
            "https" if r.is_loopback() => Err(bad("a registry on loopback is reached over plain HTTP (http://)")),
            "https" if insecure => Err(bad("an insecure registry is reached over plain HTTP (http://)")),
            "https" => Ok(target),
            _ => Err(bad("the scheme is http or https")),
        }
    }

    fn is_loopback(&self) -> bool {
        Reference { registry: self.registry.clone(), repository: "x".into(), reference: "latest".into() }.is_loopback()
    }

    /// The repository `name` (a-z0-9 . _ -) under the prefix.
    pub fn repository(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_owned()
        } else {
            format!("{}/{name}", self.prefix)
        }
    }

    /// Whether `reference` names a manifest by digest in this registry
    /// under the prefix: what a node pulls, and nothing else.
    pub fn holds(&self, reference: &str) -> bool {
        let Ok(r) = Reference::parse(reference) else { return false };
        let under = self.prefix.is_empty() || r.repository.starts_with(&format!("{}/", self.prefix));
        r.registry == self.registry && under && r.reference.starts_with("sha256:") && reference.contains('@')
    }

    fn client(&self, repo: &str) -> Client {
        let scheme = if self.is_loopback() || self.insecure { "http" } else { "https" };
        Client { agent: agent(), base: format!("{scheme}://{}", self.registry), repo: repo.to_owned(), token: None }
    }
}

/// Most blobs [`Mounts`] remembers.
const MOUNTS_KEPT: usize = 16384;

/// Where blobs were pushed (registry and digest → repository), so that a
/// push to another repository mounts them from there (one request)
/// rather than uploading them again: blobs are per repository in the
/// Distribution API.
#[derive(Debug, Default)]
pub struct Mounts(std::sync::Mutex<std::collections::HashMap<(String, String), String>>);

impl Mounts {
    fn get(&self, registry: &str, digest: &str) -> Option<String> {
        self.0.lock().ok()?.get(&(registry.to_owned(), digest.to_owned())).cloned()
    }

    fn put(&self, registry: &str, digest: &str, repo: &str) {
        if let Ok(mut m) = self.0.lock() {
            if m.len() >= MOUNTS_KEPT {
                m.clear();
            }
            m.insert((registry.to_owned(), digest.to_owned()), repo.to_owned());
        }
    }
}

/// Whether repository `name` may be pushed to: one path component.
fn valid_repo_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-'))
        && !name.starts_with(['.', '_', '-'])
}

/// The URL an upload continues at: the registry's `Location` (absolute,
/// or a path on the registry), with `digest` added to its query. Another
/// host is refused (the token is the registry's).
#[doc(hidden)] // public for the fuzz targets (fuzz/)
pub fn upload_url(base: &str, location: &str, digest: &str) -> Result<String, ImageError> {
    if location.len() > 4096 || location.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(reg("the registry's upload location is malformed"));
    }
    let url = if location.starts_with('/') {
        format!("{base}{location}")
    } else if location.starts_with(&format!("{base}/")) {
        location.to_owned()
    } else {
        return Err(reg(format!(
            "the registry sends uploads elsewhere ({}); only uploads to the registry itself are supported",
            location.chars().take(120).collect::<String>()
        )));
    };
    let sep = if url.contains('?') { '&' } else { '?' };
    Ok(format!("{url}{sep}digest=sha256:{digest}"))
}

/// How a blob got into the repository.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Put {
    /// It was there.
    Had,
    /// Mounted from another repository of the registry.
    Mounted,
    Uploaded,
}

/// Puts one blob into the repository unless it has it: mounted from a
/// repository it was pushed to before (`from`), else uploaded: `write`
/// writes its bytes (`blob.size` of them).
fn put_blob(
    c: &mut Client,
    blob: &Blob,
    from: Option<&str>,
    write: &(dyn Fn(&mut dyn Write) -> Result<(), ImageError> + Sync),
) -> Result<Put, ImageError> {
    let blob_url = format!("{}/v2/{}/blobs/sha256:{}", c.base, c.repo, blob.digest);
    match c.call("HEAD", &blob_url, &[], None) {
        Ok(_) => return Ok(Put::Had),
        Err(ImageError::Registry(m)) if m.contains("HTTP 404") => {}
        Err(e) => return Err(e),
    }
    let mut start = format!("{}/v2/{}/blobs/uploads/", c.base, c.repo);
    if let Some(from) = from.filter(|f| *f != c.repo) {
        start.push_str(&format!("?mount=sha256:{}&from={from}", blob.digest));
    }
    let opened = c.call("POST", &start, &[("Content-Length", "0")], Some(&[]))?;
    // 201: mounted; 202: an upload opened instead.
    if opened.status() == 201 {
        return Ok(Put::Mounted);
    }
    let location = opened.header("location").ok_or_else(|| reg("the registry opened an upload without a location"))?;
    let url = upload_url(&c.base, location, &blob.digest)?;
    // The body streams from a thread of its own through a pipe.
    let (reader, mut writer) = std::io::pipe().map_err(|e| reg(format!("pipe: {e}")))?;
    std::thread::scope(|scope| {
        let writing = scope.spawn(move || {
            let w = write(&mut writer);
            drop(writer);
            w
        });
        let mut req = c.agent.put(&url).set("Content-Type", "application/octet-stream");
        req = req.set("Content-Length", &blob.size.to_string());
        if let Some(t) = &c.token {
            req = req.set("Authorization", &format!("Bearer {t}"));
        }
        let sent = req.send(reader);
        let written = writing.join().map_err(|_| reg("the layer's writer panicked"))?;
        // The writer's failure says more than the registry's.
        written?;
        match sent {
            Ok(_) => Ok(Put::Uploaded),
            Err(ureq::Error::Status(code, r)) => Err(status_error("PUT", &url, code, r)),
            Err(ureq::Error::Transport(t)) => Err(reg(t.to_string())),
        }
    })
}

/// What a push did, blob by blob.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pushed {
    /// `host/prefix/name@sha256:...`.
    pub reference: String,
    /// Blobs the repository had, mounted from another, and uploaded.
    pub had: usize,
    pub mounted: usize,
    pub uploaded: usize,
}

/// Pushes `plan` to repository `name` under `target`'s prefix (blobs
/// pushed before through `mounts` are mounted, not uploaded again).
pub fn push(target: &Target, name: &str, plan: &Plan, mounts: &Mounts) -> Result<Pushed, ImageError> {
    if !valid_repo_name(name) {
        return Err(reg(format!("{name:?} is not a repository name")));
    }
    let repo = target.repository(name);
    let mut c = target.client(&repo);
    let mut seen = std::collections::HashSet::new();
    let mut done = Pushed::default();
    let count = |put: Put, digest: &str, done: &mut Pushed| {
        mounts.put(&target.registry, digest, &repo);
        match put {
            Put::Had => done.had += 1,
            Put::Mounted => done.mounted += 1,
            Put::Uploaded => done.uploaded += 1,
        }
    };
    for (dir, blob) in plan.layers() {
        if !seen.insert(blob.digest.clone()) {
            continue;
        }
        let write = |out: &mut dyn Write| {
            let mut out = out;
            write_layer(dir, blob, &mut out).map_err(|e| reg(format!("layer {}: {e}", dir.display())))
        };
        let from = mounts.get(&target.registry, &blob.digest);
        let put = put_blob(&mut c, blob, from.as_deref(), &write)?;
        count(put, &blob.digest, &mut done);
    }
    let (config, bytes) = plan.config();
    if seen.insert(config.digest.clone()) {
        let write = |out: &mut dyn Write| out.write_all(bytes).map_err(|e| reg(format!("config: {e}")));
        let put = put_blob(&mut c, config, None, &write)?;
        count(put, &config.digest, &mut done);
    }
    let (manifest, bytes) = plan.manifest();
    let url = format!("{}/v2/{}/manifests/sha256:{}", c.base, repo, manifest.digest);
    let answer = c.call("PUT", &url, &[("Content-Type", MEDIA_MANIFEST)], Some(bytes))?;
    // The registry's digest of what it keeps, when it says one.
    if let Some(d) = answer.header("docker-content-digest") {
        if d != format!("sha256:{}", manifest.digest) {
            return Err(reg(format!("the registry keeps the manifest as {d}, not sha256:{}", manifest.digest)));
        }
    }
    let _ = read_bounded(answer, 4096, "answer");
    done.reference = format!("{}/{repo}@sha256:{}", target.registry, manifest.digest);
    Ok(done)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn targets_parse_and_plain_http_is_for_loopback_or_insecure() {
        let t = Target::parse("http://127.0.0.1:5000/hutch-fleet", false).expect("parse");
        assert_eq!((t.registry.as_str(), t.prefix.as_str()), ("127.0.0.1:5000", "hutch-fleet"));
        assert_eq!(t.repository("sb-1"), "hutch-fleet/sb-1");
        let t = Target::parse("https://registry.example.com/", false).expect("parse");
        assert_eq!((t.registry.as_str(), t.prefix.as_str()), ("registry.example.com", ""));
        assert!(Target::parse("http://registry.example.com/x", false).is_err());
        assert!(Target::parse("http://registry.example.com/x", true).is_ok());
        assert!(Target::parse("https://localhost:5000", false).is_err());
        for bad in ["", "127.0.0.1:5000", "ftp://r.example.com", "http://u:p@127.0.0.1:5000", "http://127.0.0.1:5000/X"]
        {
            assert!(Target::parse(bad, false).is_err(), "{bad}");
        }
    }

    #[test]
    fn only_references_by_digest_under_the_prefix_are_held() {
        let t = Target::parse("http://127.0.0.1:5000/fleet", false).expect("parse");
        let d = "a".repeat(64);
        assert!(t.holds(&format!("127.0.0.1:5000/fleet/sb-1@sha256:{d}")));
        assert!(!t.holds(&format!("127.0.0.1:5000/other/sb-1@sha256:{d}")));
        assert!(!t.holds(&format!("127.0.0.1:5001/fleet/sb-1@sha256:{d}")));
        assert!(!t.holds("127.0.0.1:5000/fleet/sb-1:latest"));
    }

    #[test]
    fn upload_locations_stay_on_the_registry() {
        let base = "http://127.0.0.1:5000";
        assert_eq!(
            upload_url(base, "/v2/x/blobs/uploads/u?_state=s", "ab").expect("url"),
            "http://127.0.0.1:5000/v2/x/blobs/uploads/u?_state=s&digest=sha256:ab"
        );
        assert_eq!(
            upload_url(base, "http://127.0.0.1:5000/v2/x/blobs/uploads/u", "ab").expect("url"),
            "http://127.0.0.1:5000/v2/x/blobs/uploads/u?digest=sha256:ab"
        );
        assert!(upload_url(base, "http://evil.example.com/u", "ab").is_err());
        assert!(upload_url(base, "http://127.0.0.1:50000/u", "ab").is_err());
        assert!(upload_url(base, "/u\nx", "ab").is_err());
    }

    /// Debian's docker-registry on a free loopback port, its storage in a
    /// temporary directory; stopped and removed when dropped.
    pub(crate) struct Registry {
        child: std::process::Child,
        dir: std::path::PathBuf,
        pub(crate) port: u16,
    }

    impl Registry {
        pub(crate) fn start() -> Registry {
            let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
            let dir = std::env::temp_dir().join(format!("hutch-push-registry-{}", crate::sys::random_hex(4)));
            std::fs::create_dir_all(&dir).expect("mkdir");
            let cfg = dir.join("config.yml");
            std::fs::write(
                &cfg,
                format!(
                    "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\n\
                     http:\n  addr: 127.0.0.1:{port}\n",
                    dir.join("data").display()
                ),
            )
            .expect("config");
            let child = std::process::Command::new("docker-registry")
                .arg("serve")
                .arg(&cfg)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("docker-registry (apt-get install docker-registry)");
            let mut reg = Registry { child, dir, port };
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
            loop {
                if agent().get(&format!("http://127.0.0.1:{port}/v2/")).call().is_ok() {
                    return reg;
                }
                assert!(reg.child.try_wait().expect("wait").is_none(), "docker-registry exited");
                assert!(std::time::Instant::now() < deadline, "docker-registry did not answer");
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        }
    }

    impl Drop for Registry {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    #[test]
    fn a_pushed_export_pulls_back_by_digest_and_pushes_again_mount_or_nothing() {
        use super::super::export::{Export, ExportLayer};
        use super::super::registry::{PullOptions, Pulling};
        let reg = Registry::start();
        let root = std::env::temp_dir().join(format!("hutch-push-{}", crate::sys::random_hex(4)));
        let (lower, upper, back) = (root.join("lower"), root.join("upper"), root.join("back"));
        for d in [&lower, &upper, &back] {
            std::fs::create_dir_all(d).expect("mkdir");
        }
        std::fs::write(lower.join("base"), "lower\n").expect("write");
        std::fs::create_dir_all(upper.join("workspace")).expect("mkdir");
        // Bigger than a pipe's buffer, so the upload streams.
        std::fs::write(upper.join("workspace/big"), vec![7u8; 3 << 20]).expect("write");
        std::fs::write(upper.join("workspace/note"), "moved\n").expect("write");
        let export = Export {
            layers: vec![
                ExportLayer { dir: lower.clone(), created_by: "lower".into() },
                ExportLayer { dir: upper.clone(), created_by: "upper".into() },
            ],
            env: vec!["A=1".into()],
            created: "2026-01-01T00:00:00Z".into(),
            tag: "x:latest".into(),
            ..Export::default()
        };
        let plan = export.plan().expect("plan");
        let target = Target::parse(&format!("http://127.0.0.1:{}/fleet", reg.port), false).expect("target");
        let mounts = Mounts::default();
        let first = push(&target, "sb-0123456789abcdef", &plan, &mounts).expect("push");
        let reference = first.reference.clone();
        assert!(target.holds(&reference), "{reference}");
        assert!(reference.ends_with(&format!("@sha256:{}", plan.manifest().0.digest)), "{reference}");
        assert_eq!((first.had, first.mounted, first.uploaded), (0, 0, 3), "{first:?}");
        // Again: every blob is there already (the HEADs say so).
        let again = push(&target, "sb-0123456789abcdef", &plan, &mounts).expect("again");
        assert_eq!((again.reference.as_str(), again.had, again.uploaded), (reference.as_str(), 3, 0), "{again:?}");
        // To another repository: mounted from the first, nothing uploaded.
        let other = push(&target, "sb-fedcba9876543210", &plan, &mounts).expect("other");
        assert_eq!((other.mounted, other.uploaded), (2, 1), "{other:?}");
        let mut p = Pulling::open(&reference, &PullOptions::default()).expect("open");
        assert_eq!(p.layers(), 2);
        assert_eq!(p.config()["config"]["Env"][0], "A=1");
        p.extract(1, &back, &super::super::Limits::default()).expect("extract");
        assert_eq!(std::fs::read(back.join("workspace/note")).expect("read"), b"moved\n");
        assert_eq!(std::fs::read(back.join("workspace/big")).expect("read").len(), 3 << 20);
        // A reference the registry does not have is an error, not an empty image.
        let missing = reference.replace(&plan.manifest().0.digest, &"0".repeat(64));
        assert!(Pulling::open(&missing, &PullOptions::default()).is_err());
        let _ = std::fs::remove_dir_all(&root);
    }
}

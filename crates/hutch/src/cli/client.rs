//! A blocking client of hutch's HTTP API: one method per route, typed
//! requests and answers from hutch-api, and one error type that keeps the
//! API's `{error, code}` apart from network failures.

use hutch_api::{
    ArchiveResult, CreateSandbox, ExecRequest, ExecResult, Extend, FilePart, FilePartResult, Listing, ProcessList,
    Sandbox, SandboxList, SignalRequest, Started, StdinRequest,
};
use serde::de::DeserializeOwned;
use std::fmt;
use std::io::{BufRead, BufReader, Read};
use std::time::Duration;

/// Why a request failed.
#[derive(Debug)]
pub enum ApiError {
    /// The daemon answered with an error body. `code` is kept as a string:
    /// clients must accept codes they do not know.
    Api { status: u16, error: String, code: String },
    /// An error status without hutch's error body (a proxy, a bad route).
    Http { status: u16, url: String, text: String },
    /// The request did not get an answer.
    Transport { url: String, detail: String },
    /// The answer was not what the API promises.
    Decode { url: String, detail: String },
}

impl ApiError {
    /// The API's error code, when the daemon sent one.
    #[allow(dead_code, reason = "API surface for the end-to-end tests and later subcommands")]
    pub fn code(&self) -> Option<&str> {
        match self {
            ApiError::Api { code, .. } => Some(code),
            ApiError::Http { .. } | ApiError::Transport { .. } | ApiError::Decode { .. } => None,
        }
    }

    /// The HTTP status, when there was an answer.
    #[allow(dead_code, reason = "API surface for the end-to-end tests and later subcommands")]
    pub fn status(&self) -> Option<u16> {
        match self {
            ApiError::Api { status, .. } | ApiError::Http { status, .. } => Some(*status),
            ApiError::Transport { .. } | ApiError::Decode { .. } => None,
        }
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ApiError::Api { error, code, .. } => write!(f, "{error} ({code})"),
            ApiError::Http { status, url, text } => {
                let text: String = text.trim().chars().take(200).collect();
                if text.is_empty() {
                    write!(f, "HTTP {status} from {url}")
                } else {
                    write!(f, "HTTP {status} from {url}: {text}")
                }
            }
            ApiError::Transport { url, detail } => write!(f, "cannot reach the hutch daemon at {url}: {detail}"),
            ApiError::Decode { url, detail } => write!(f, "unexpected answer from {url}: {detail}"),
        }
    }
}

impl std::error::Error for ApiError {}

pub type Result<T> = std::result::Result<T, ApiError>;

/// Query of `GET .../files/list`.
#[derive(Debug, Clone, Default)]
pub struct ListQuery {
    pub path: Option<String>,
    pub recursive: bool,
    pub include_sha256: bool,
    pub limit: Option<u32>,
    pub cursor: Option<String>,
}

/// A response body read as it arrives: raw bytes, or NDJSON lines.
pub struct Body {
    reader: Box<dyn Read + Send + Sync + 'static>,
}

impl Body {
    /// The raw bytes.
    pub fn into_reader(self) -> Box<dyn Read + Send + Sync + 'static> {
        self.reader
    }

    /// The body line by line, for NDJSON streams.
    pub fn lines(self) -> std::io::Lines<BufReader<Box<dyn Read + Send + Sync + 'static>>> {
        BufReader::new(self.reader).lines()
    }
}

/// A client of one daemon, with one key.
#[derive(Clone)]
pub struct Client {
    agent: ureq::Agent,
    base: String,
    key: String,
}

impl Client {
    pub fn new(base_url: &str, api_key: &str) -> Client {
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(Duration::from_secs(5))
            .user_agent(concat!("hutch-cli/", env!("CARGO_PKG_VERSION")))
            .build();
        Client { agent, base: base_url.trim_end_matches('/').to_owned(), key: api_key.to_owned() }
    }

    /// The key requests carry.
    pub fn api_key(&self) -> &str {
        &self.key
    }

    /// The base URL requests go to.
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// `GET /healthz`: Ok when the daemon answers 2xx (no key needed).
    #[allow(dead_code, reason = "API surface for the end-to-end tests and later subcommands")]
    pub fn healthz(&self) -> Result<()> {
        let url = format!("{}/healthz", self.base);
        self.send(&url, self.agent.get(&url), Payload::None).map(drop)
    }

    /// `POST /v1/sandboxes`.
    pub fn create_sandbox(&self, req: &CreateSandbox, idempotency_key: Option<&str>) -> Result<Sandbox> {
        let url = self.url(&["sandboxes"]);
        let mut r = self.authed("POST", &url);
        if let Some(k) = idempotency_key {
            r = r.set("Idempotency-Key", k);
        }
        self.json(&url, r, Payload::Json(to_value(req)))
    }

    /// `GET /v1/sandboxes`: one page, newest first.
    /// A page of sandboxes; with `live`, only those not yet terminated.
    pub fn list_sandboxes(&self, limit: Option<u32>, cursor: Option<&str>, live: bool) -> Result<SandboxList> {
        let url = self.url(&["sandboxes"]);
        let mut r = self.authed("GET", &url);
        if live {
            r = r.query("live", "true");
        }
        if let Some(l) = limit {
            r = r.query("limit", &l.to_string());
        }
        if let Some(c) = cursor {
            r = r.query("cursor", c);
        }
        self.json(&url, r, Payload::None)
    }

    /// `GET /v1/sandboxes/{id}`.
    pub fn get_sandbox(&self, id: &str) -> Result<Sandbox> {
        let url = self.url(&["sandboxes", id]);
        self.json(&url, self.authed("GET", &url), Payload::None)
    }

    /// `DELETE /v1/sandboxes/{id}`.
    pub fn delete_sandbox(&self, id: &str) -> Result<Sandbox> {
        let url = self.url(&["sandboxes", id]);
        self.json(&url, self.authed("DELETE", &url), Payload::None)
    }

    /// `POST /v1/sandboxes/{id}/snapshots`.
    pub fn create_snapshot(&self, id: &str, req: &hutch_api::CreateSnapshot) -> Result<hutch_api::Snapshot> {
        let url = self.url(&["sandboxes", id, "snapshots"]);
        self.json(&url, self.authed("POST", &url), Payload::Json(to_value(req)))
    }

    /// `GET /v1/snapshots`.
    pub fn list_snapshots(&self) -> Result<hutch_api::SnapshotList> {
        let url = self.url(&["snapshots"]);
        self.json(&url, self.authed("GET", &url), Payload::None)
    }

    /// `GET /v1/snapshots/{id}`.
    pub fn get_snapshot(&self, id: &str) -> Result<hutch_api::Snapshot> {
        let url = self.url(&["snapshots", id]);
        self.json(&url, self.authed("GET", &url), Payload::None)
    }

    /// `DELETE /v1/snapshots/{id}`.
    pub fn delete_snapshot(&self, id: &str) -> Result<()> {
        let url = self.url(&["snapshots", id]);
        self.send(&url, self.authed("DELETE", &url), Payload::None).map(drop)
    }

    /// `GET /v1/snapshots/{id}/export`: the image archive as it arrives
    /// (a stream cut short fails to read: it carries a Content-Length).
    pub fn export_snapshot(&self, id: &str) -> Result<Body> {
        let url = self.url(&["snapshots", id, "export"]);
        self.body(&url, self.authed("GET", &url), Payload::None)
    }

    /// `POST /v1/volumes`.
    pub fn create_volume(&self, req: &hutch_api::CreateVolume) -> Result<hutch_api::Volume> {
        let url = self.url(&["volumes"]);
        self.json(&url, self.authed("POST", &url), Payload::Json(to_value(req)))
    }

    /// `GET /v1/volumes`.
    /// `GET /v1/nodes`.
    pub fn list_nodes(&self) -> Result<hutch_api::NodeList> {
        let url = self.url(&["nodes"]);
        self.json(&url, self.authed("GET", &url), Payload::None)
    }

    /// `POST /v1/nodes/{name}/drain` (`undrain` false) or `/undrain`.
    pub fn drain_node(&self, name: &str, undrain: bool) -> Result<hutch_api::Node> {
        let url = self.url(&["nodes", name, if undrain { "undrain" } else { "drain" }]);
        self.json(&url, self.authed("POST", &url), Payload::None)
    }

    pub fn list_volumes(&self) -> Result<hutch_api::VolumeList> {
        let url = self.url(&["volumes"]);
        self.json(&url, self.authed("GET", &url), Payload::None)
    }

    /// `GET /v1/volumes/{id or name}`.
    pub fn get_volume(&self, id: &str) -> Result<hutch_api::Volume> {
        let url = self.url(&["volumes", id]);
        self.json(&url, self.authed("GET", &url), Payload::None)
    }

    /// `PATCH /v1/volumes/{id or name}`.
    pub fn update_volume(&self, id: &str, req: &hutch_api::UpdateVolume) -> Result<hutch_api::Volume> {
        let url = self.url(&["volumes", id]);
        self.json(&url, self.authed("PATCH", &url), Payload::Json(to_value(req)))
    }

    /// `DELETE /v1/volumes/{id or name}`.
    pub fn delete_volume(&self, id: &str) -> Result<()> {
        let url = self.url(&["volumes", id]);
        self.send(&url, self.authed("DELETE", &url), Payload::None).map(drop)
    }

    /// `POST /v1/sandboxes/{id}/fork`.
    pub fn fork_sandbox(&self, id: &str, req: &hutch_api::Fork) -> Result<hutch_api::ForkResult> {
        let url = self.url(&["sandboxes", id, "fork"]);
        self.json(&url, self.authed("POST", &url), Payload::Json(to_value(req)))
    }

    /// `POST /v1/sandboxes/{id}/extend`.
    pub fn extend_sandbox(&self, id: &str, req: &Extend) -> Result<Sandbox> {
        let url = self.url(&["sandboxes", id, "extend"]);
        self.json(&url, self.authed("POST", &url), Payload::Json(to_value(req)))
    }

    /// `POST /v1/sandboxes/{id}/suspend`.
    pub fn suspend_sandbox(&self, id: &str) -> Result<Sandbox> {
        let url = self.url(&["sandboxes", id, "suspend"]);
        self.json(&url, self.authed("POST", &url), Payload::Empty)
    }

    /// `POST /v1/sandboxes/{id}/resume`.
    pub fn resume_sandbox(&self, id: &str) -> Result<Sandbox> {
        let url = self.url(&["sandboxes", id, "resume"]);
        self.json(&url, self.authed("POST", &url), Payload::Empty)
    }

    /// `POST /v1/sandboxes/{id}/access`: a short-lived credential for one port.
    pub fn create_access(&self, id: &str, req: &hutch_api::CreateAccess) -> Result<hutch_api::AccessGrant> {
        let url = self.url(&["sandboxes", id, "access"]);
        self.json(&url, self.authed("POST", &url), Payload::Json(to_value(req)))
    }

    /// `POST /v1/sandboxes/{id}/exec`, waiting for the whole result.
    pub fn exec(&self, id: &str, req: &ExecRequest, idempotency_key: &str) -> Result<ExecResult> {
        let url = self.url(&["sandboxes", id, "exec"]);
        let r = self.authed("POST", &url).set("Idempotency-Key", idempotency_key);
        self.json(&url, r, Payload::Json(to_value(req)))
    }

    /// `POST /v1/sandboxes/{id}/exec` with `background: true`: the pid.
    pub fn exec_background(&self, id: &str, req: &ExecRequest, idempotency_key: &str) -> Result<Started> {
        let mut req = req.clone();
        req.background = Some(true);
        let url = self.url(&["sandboxes", id, "exec"]);
        let r = self.authed("POST", &url).set("Idempotency-Key", idempotency_key);
        self.json(&url, r, Payload::Json(to_value(&req)))
    }

    /// `POST /v1/sandboxes/{id}/exec` as an NDJSON stream of `ExecEvent`s.
    pub fn exec_stream(&self, id: &str, req: &ExecRequest, idempotency_key: &str) -> Result<Body> {
        let url = self.url(&["sandboxes", id, "exec"]);
        let r = self.authed("POST", &url).set("Idempotency-Key", idempotency_key).set("Accept", "application/x-ndjson");
        self.body(&url, r, Payload::Json(to_value(req)))
    }

    /// `GET /v1/sandboxes/{id}/processes`.
    #[allow(dead_code, reason = "API surface for the end-to-end tests and later subcommands")]
    pub fn processes(&self, id: &str) -> Result<ProcessList> {
        let url = self.url(&["sandboxes", id, "processes"]);
        self.json(&url, self.authed("GET", &url), Payload::None)
    }

    /// `POST /v1/sandboxes/{id}/processes/{pid}/signal`.
    #[allow(dead_code, reason = "API surface for the end-to-end tests and later subcommands")]
    pub fn signal(&self, id: &str, pid: u32, req: &SignalRequest) -> Result<()> {
        let url = self.url(&["sandboxes", id, "processes", &pid.to_string(), "signal"]);
        self.send(&url, self.authed("POST", &url), Payload::Json(to_value(req))).map(drop)
    }

    /// `POST /v1/sandboxes/{id}/processes/{pid}/stdin`.
    #[allow(dead_code, reason = "API surface for the end-to-end tests and later subcommands")]
    pub fn stdin(&self, id: &str, pid: u32, req: &StdinRequest) -> Result<()> {
        let url = self.url(&["sandboxes", id, "processes", &pid.to_string(), "stdin"]);
        self.send(&url, self.authed("POST", &url), Payload::Json(to_value(req))).map(drop)
    }

    /// `GET /v1/sandboxes/{id}/processes/{pid}/stream`: NDJSON events.
    #[allow(dead_code, reason = "API surface for the end-to-end tests and later subcommands")]
    pub fn process_stream(&self, id: &str, pid: u32) -> Result<Body> {
        let url = self.url(&["sandboxes", id, "processes", &pid.to_string(), "stream"]);
        self.body(&url, self.authed("GET", &url).set("Accept", "application/x-ndjson"), Payload::None)
    }

    /// `GET /v1/sandboxes/{id}/files?path=`: the file's bytes as they arrive.
    pub fn read_file(&self, id: &str, path: &str) -> Result<Body> {
        let url = self.url(&["sandboxes", id, "files"]);
        self.body(&url, self.authed("GET", &url).query("path", path), Payload::None)
    }

    /// `PUT /v1/sandboxes/{id}/files?path=`: the body is sent as read;
    /// `len` (when known) is sent as Content-Length, else it is chunked.
    pub fn write_file(&self, id: &str, path: &str, body: impl Read, len: Option<u64>) -> Result<()> {
        let url = self.url(&["sandboxes", id, "files"]);
        let mut r = self.authed("PUT", &url).query("path", path).set("Content-Type", "application/octet-stream");
        if let Some(n) = len {
            r = r.set("Content-Length", &n.to_string());
        }
        self.send(&url, r, Payload::Reader(Box::new(body))).map(drop)
    }

    /// `GET /v1/sandboxes/{id}/files/list`: one page.
    pub fn list_files(&self, id: &str, q: &ListQuery) -> Result<Listing> {
        let url = self.url(&["sandboxes", id, "files", "list"]);
        let mut r = self.authed("GET", &url);
        if let Some(p) = &q.path {
            r = r.query("path", p);
        }
        if q.recursive {
            r = r.query("recursive", "true");
        }
        if q.include_sha256 {
            r = r.query("include_sha256", "true");
        }
        if let Some(l) = q.limit {
            r = r.query("limit", &l.to_string());
        }
        if let Some(c) = &q.cursor {
            r = r.query("cursor", c);
        }
        self.json(&url, r, Payload::None)
    }

    /// `POST /v1/sandboxes/{id}/archives`: a tar or tar.gz unpacked under
    /// `path`, sent as multipart/form-data.
    pub fn upload_archive(&self, id: &str, path: &str, archive: &[u8]) -> Result<ArchiveResult> {
        let url = self.url(&["sandboxes", id, "archives"]);
        let boundary = format!("hutch-{}", crate::cli::uuid_v4().unwrap_or_else(|_| "b0undary-7f3a9c".to_owned()));
        let body = multipart(&boundary, path, archive);
        let r = self.authed("POST", &url).set("Content-Type", &format!("multipart/form-data; boundary={boundary}"));
        self.json(&url, r, Payload::Bytes(&body))
    }

    /// `GET /v1/sandboxes/{id}/archives?path=`: a tar of `path`.
    #[allow(dead_code, reason = "API surface for the end-to-end tests and later subcommands")]
    pub fn download_archive(&self, id: &str, path: &str) -> Result<Body> {
        let url = self.url(&["sandboxes", id, "archives"]);
        self.body(&url, self.authed("GET", &url).query("path", path), Payload::None)
    }

    /// `POST /v1/sandboxes/{id}/file-parts`.
    #[allow(dead_code, reason = "API surface for the end-to-end tests and later subcommands")]
    pub fn put_file_part(&self, id: &str, part: &FilePart) -> Result<FilePartResult> {
        let url = self.url(&["sandboxes", id, "file-parts"]);
        self.json(&url, self.authed("POST", &url), Payload::Json(to_value(part)))
    }

    /// `POST /v1/templates`.
    pub fn create_template(&self, req: &hutch_api::CreateTemplate) -> Result<hutch_api::Template> {
        let url = self.url(&["templates"]);
        self.json(&url, self.authed("POST", &url), Payload::Json(to_value(req)))
    }

    /// `GET /v1/templates`.
    pub fn list_templates(&self) -> Result<hutch_api::TemplateList> {
        let url = self.url(&["templates"]);
        self.json(&url, self.authed("GET", &url), Payload::None)
    }

    /// `GET /v1/templates/{id}`.
    pub fn get_template(&self, id: &str) -> Result<hutch_api::Template> {
        let url = self.url(&["templates", id]);
        self.json(&url, self.authed("GET", &url), Payload::None)
    }

    /// `PATCH /v1/templates/{id}` with the fields to change.
    pub fn update_template(
        &self,
        id: &str,
        fields: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<hutch_api::Template> {
        let url = self.url(&["templates", id]);
        self.json(&url, self.authed("PATCH", &url), Payload::Json(to_value(fields)))
    }

    /// `POST /v1/keys` (admin keys only).
    pub fn create_key(&self, req: &hutch_api::CreateKey) -> Result<hutch_api::ApiKey> {
        let url = self.url(&["keys"]);
        self.json(&url, self.authed("POST", &url), Payload::Json(to_value(req)))
    }

    /// `GET /v1/keys` (admin keys only).
    pub fn list_keys(&self) -> Result<hutch_api::ApiKeyList> {
        let url = self.url(&["keys"]);
        self.json(&url, self.authed("GET", &url), Payload::None)
    }

    /// `PATCH /v1/keys/{id}`: replaces the key's quotas.
    pub fn set_key_quotas(&self, id: &str, quotas: &hutch_api::KeyQuotas) -> Result<hutch_api::ApiKey> {
        let url = self.url(&["keys", id]);
        self.json(&url, self.authed("PATCH", &url), Payload::Json(to_value(quotas)))
    }

    /// `DELETE /v1/keys/{id}`: revokes it and ends its sandboxes.
    pub fn revoke_key(&self, id: &str) -> Result<()> {
        let url = self.url(&["keys", id]);
        self.send(&url, self.authed("DELETE", &url), Payload::None).map(drop)
    }

    /// `DELETE /v1/templates/{id}`.
    pub fn delete_template(&self, id: &str) -> Result<()> {
        let url = self.url(&["templates", id]);
        self.send(&url, self.authed("DELETE", &url), Payload::None).map(drop)
    }

    /// `POST /v1/templates/{id}/builds` with a tar.gz build context.
    pub fn start_build(&self, id: &str, context: &[u8]) -> Result<hutch_api::Build> {
        let url = self.url(&["templates", id, "builds"]);
        let r = self.authed("POST", &url).set("Content-Type", "application/gzip");
        self.json(&url, r, Payload::Bytes(context))
    }

    /// `GET /v1/templates/{id}/builds/{build}`.
    pub fn get_build(&self, id: &str, build: &str) -> Result<hutch_api::Build> {
        let url = self.url(&["templates", id, "builds", build]);
        self.json(&url, self.authed("GET", &url), Payload::None)
    }

    /// `GET /v1/templates/{id}/builds/{build}/logs`, streamed when `follow`.
    pub fn build_log(&self, id: &str, build: &str, follow: bool) -> Result<Body> {
        let url = self.url(&["templates", id, "builds", build, "logs"]);
        let r = self.authed("GET", &url).query("follow", if follow { "true" } else { "false" });
        self.body(&url, r, Payload::None)
    }

    /// `GET /v1/images`: the images the key may name.
    pub fn list_images(&self) -> Result<hutch_api::ImageList> {
        let url = self.url(&["images"]);
        self.json(&url, self.authed("GET", &url), Payload::None)
    }

    /// `POST /v1/images/import` (admin keys): the archive streams as the
    /// body, with `len` as its Content-Length when known.
    pub fn import_image(
        &self,
        archive: impl Read,
        len: Option<u64>,
        name: Option<&str>,
        filename: Option<&str>,
    ) -> Result<hutch_api::ImageInfo> {
        let url = self.url(&["images", "import"]);
        let request = || {
            let mut r = self.authed("POST", &url).set("Content-Type", "application/x-tar");
            if let Some(n) = name {
                r = r.query("name", n);
            }
            if let Some(f) = filename {
                r = r.query("filename", f);
            }
            r
        };
        // A refusal (the key, the name, the size) comes before the body is
        // read, and the daemon closes the connection rather than read a
        // large body it refused; this client would only see the broken
        // pipe. So the refusal is asked for first, with no body.
        let mut check = request().query("check", "true");
        if let Some(n) = len {
            check = check.query("size", &n.to_string());
        }
        self.send(&url, check, Payload::Empty)?;
        let mut r = request();
        if let Some(n) = len {
            r = r.set("Content-Length", &n.to_string());
        }
        let resp = self.send(&url, r, Payload::Reader(Box::new(archive)))?;
        serde_json::from_reader(resp.into_reader())
            .map_err(|e| ApiError::Decode { url: url.to_owned(), detail: e.to_string() })
    }

    /// `POST /v1/images/pull` (admin keys).
    pub fn pull_image(&self, req: &hutch_api::PullImage) -> Result<hutch_api::ImageInfo> {
        let url = self.url(&["images", "pull"]);
        self.json(&url, self.authed("POST", &url), Payload::Json(to_value(req)))
    }

    /// `POST /v1/images/build` (admin keys): NDJSON `ImageBuildEvent`s, the
    /// last one `done` or `error`. The build takes minutes: no read timeout.
    pub fn build_image(&self, req: &hutch_api::BuildImage) -> Result<Body> {
        let url = self.url(&["images", "build"]);
        self.body(&url, self.authed("POST", &url).set("Accept", "application/x-ndjson"), Payload::Json(to_value(req)))
    }

    /// `DELETE /v1/images/{name}` (admin keys).
    pub fn delete_image(&self, name: &str) -> Result<()> {
        let url = self.url(&["images", name]);
        self.send(&url, self.authed("DELETE", &url), Payload::None).map(drop)
    }

    /// `POST /v1/images/gc` (admin keys): the number of layers removed.
    pub fn collect_images(&self) -> Result<u64> {
        let url = self.url(&["images", "gc"]);
        let v: serde_json::Value = self.json(&url, self.authed("POST", &url), Payload::Empty)?;
        Ok(v["layers_removed"].as_u64().unwrap_or(0))
    }

    fn url(&self, segments: &[&str]) -> String {
        let mut u = format!("{}/v1", self.base);
        for s in segments {
            u.push('/');
            u.push_str(&encode_segment(s));
        }
        u
    }

    /// A request to `path` (below the base URL, outside `/v1`) with the
    /// key, and its URL: for `hutch mcp`, which relays bodies as they are.
    pub fn raw(&self, method: &str, path: &str) -> (String, ureq::Request) {
        let url = format!("{}{path}", self.base);
        let r = self.authed(method, &url);
        (url, r)
    }

    fn authed(&self, method: &str, url: &str) -> ureq::Request {
        self.agent.request(method, url).set("Authorization", &format!("Bearer {}", self.key))
    }

    fn json<T: DeserializeOwned>(&self, url: &str, r: ureq::Request, p: Payload<'_>) -> Result<T> {
        let resp = self.send(url, r, p)?;
        serde_json::from_reader(resp.into_reader())
            .map_err(|e| ApiError::Decode { url: url.to_owned(), detail: e.to_string() })
    }

    fn body(&self, url: &str, r: ureq::Request, p: Payload<'_>) -> Result<Body> {
        Ok(Body { reader: self.send(url, r, p)?.into_reader() })
    }

    fn send(&self, url: &str, r: ureq::Request, p: Payload<'_>) -> Result<ureq::Response> {
        let out = match p {
            Payload::None => r.call(),
            Payload::Empty => r.send_bytes(&[]),
            Payload::Json(v) => match v {
                Ok(v) => r.set("Content-Type", "application/json").send_bytes(&v),
                Err(e) => return Err(ApiError::Decode { url: url.to_owned(), detail: e }),
            },
            Payload::Bytes(b) => r.send_bytes(b),
            Payload::Reader(rd) => r.send(rd),
        };
        out.map_err(|e| match e {
            ureq::Error::Status(status, resp) => error_from_response(url, status, resp),
            ureq::Error::Transport(t) => ApiError::Transport { url: self.base.clone(), detail: transport_detail(&t) },
        })
    }
}

/// What a request carries.
enum Payload<'a> {
    None,
    Empty,
    Json(std::result::Result<Vec<u8>, String>),
    Bytes(&'a [u8]),
    Reader(Box<dyn Read + 'a>),
}

fn to_value<T: serde::Serialize>(v: &T) -> std::result::Result<Vec<u8>, String> {
    serde_json::to_vec(v).map_err(|e| format!("encoding the request: {e}"))
}

/// An error status into an `ApiError`, reading hutch's `{error, code}`
/// when the body is one.
fn error_from_response(url: &str, status: u16, resp: ureq::Response) -> ApiError {
    let mut text = String::new();
    // A body that cannot be read leaves `text` short; the status remains.
    let _ = resp.into_reader().take(64 << 10).read_to_string(&mut text);
    parse_error_body(url, status, &text)
}

/// The error of a status and its body text.
pub fn parse_error_body(url: &str, status: u16, text: &str) -> ApiError {
    #[derive(serde::Deserialize)]
    struct Wire {
        error: String,
        code: String,
    }
    match serde_json::from_str::<Wire>(text) {
        Ok(w) => ApiError::Api { status, error: w.error, code: w.code },
        Err(_) => ApiError::Http { status, url: url.to_owned(), text: text.to_owned() },
    }
}

fn transport_detail(t: &ureq::Transport) -> String {
    let mut s = match t.message() {
        Some(m) => format!("{}: {m}", t.kind()),
        None => t.kind().to_string(),
    };
    let mut src = std::error::Error::source(t);
    while let Some(e) = src {
        s.push_str(": ");
        s.push_str(&e.to_string());
        src = e.source();
    }
    if t.kind() == ureq::ErrorKind::ConnectionFailed {
        s.push_str(" (is `hutch serve` running? set HUTCH_URL or --url to point elsewhere)");
    }
    s
}

/// Percent-encodes one path segment (everything but RFC 3986 unreserved).
fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A multipart/form-data body with a `path` field and an `archive` file.
fn multipart(boundary: &str, path: &str, archive: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(archive.len() + 512);
    b.extend_from_slice(
        format!("--{boundary}\r\nContent-Disposition: form-data; name=\"path\"\r\n\r\n{path}\r\n").as_bytes(),
    );
    b.extend_from_slice(
        format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"archive\"; filename=\"archive.tar.gz\"\r\n\
             Content-Type: application/gzip\r\n\r\n"
        )
        .as_bytes(),
    );
    b.extend_from_slice(archive);
    b.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_bodies_keep_unknown_codes() {
        let e = parse_error_body("u", 409, r#"{"error":"sandbox is suspended","code":"sandbox_session_not_running"}"#);
        assert_eq!(e.to_string(), "sandbox is suspended (sandbox_session_not_running)");
        assert_eq!(e.code(), Some("sandbox_session_not_running"));
        assert_eq!(e.status(), Some(409));
        let e = parse_error_body("u", 418, r#"{"error":"new","code":"code_from_the_future"}"#);
        assert_eq!(e.code(), Some("code_from_the_future"));
        let e = parse_error_body("http://h/v1/x", 502, "Bad Gateway");
        assert_eq!(e.to_string(), "HTTP 502 from http://h/v1/x: Bad Gateway");
        assert_eq!(e.code(), None);
    }

    #[test]
    fn urls_encode_segments_and_trim_the_base() {
        let c = Client::new("http://127.0.0.1:7700/", "k");
        assert_eq!(c.base_url(), "http://127.0.0.1:7700");
        assert_eq!(c.url(&["sandboxes", "sb-1", "exec"]), "http://127.0.0.1:7700/v1/sandboxes/sb-1/exec");
        assert_eq!(c.url(&["sandboxes", "a/b?c"]), "http://127.0.0.1:7700/v1/sandboxes/a%2Fb%3Fc");
    }

    #[test]
    fn multipart_has_path_then_archive() {
        let body = multipart("B", "/workspace/app", b"\x1f\x8bDATA");
        let text = String::from_utf8_lossy(&body);
        let path_at = text.find("name=\"path\"\r\n\r\n/workspace/app\r\n").expect("path field");
        let archive_at = text.find("name=\"archive\"; filename=\"archive.tar.gz\"").expect("archive part");
        assert!(path_at < archive_at);
        assert!(body.ends_with(b"\x1f\x8bDATA\r\n--B--\r\n"));
        assert!(body.starts_with(b"--B\r\n"));
    }

    #[test]
    fn connection_refused_names_the_url() {
        // Port 1 on localhost is closed; nothing listens there in CI.
        let c = Client::new("http://127.0.0.1:1", "k");
        let e = c.get_sandbox("sb-x").expect_err("refused");
        let msg = e.to_string();
        assert!(msg.contains("http://127.0.0.1:1"), "{msg}");
        assert!(matches!(e, ApiError::Transport { .. }));
    }
}

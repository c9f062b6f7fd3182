//! E2B's template builds, as the SDK's `Template` builder drives them,
//! mapped onto hutch's templates and builds:
//!
//! 1. `POST /v3/templates` names a template (`name` or `name:tag`): the
//!    caller's template of that name, made when missing, and a build id
//!    kept here until the steps arrive ([`E2bBuilds`]).
//! 2. For each COPY, `GET /templates/{id}/files/{hash}` answers whether the
//!    owner's files cache holds that hash, or a signed upload URL (the
//!    scheme of signed `/files` URLs, [`SignedUrl`], under a token of the
//!    owner, template and hash) that takes one tar (gzip or not) of at most
//!    [`UPLOAD_CAP`] bytes, streamed to disk. The cache is per owner: no
//!    other key is told a hash is cached, nor gets its files.
//! 3. `POST /v2/templates/{id}/builds/{build}` carries the steps: they are
//!    translated into hutch's Dockerfile fragment ([`translate`]) over a
//!    build context made of the uploaded tars, and run as a hutch build
//!    whose parent is `base` (E2B's `e2bdev/base`), a shared image of the
//!    host, or another template of the owner (`from_template`).
//! 4. Status and logs are the build's record and log; tags are kept per
//!    owner in `<state>/e2b-tags/`, each naming a build.

use super::{parse_build_id, BuildOptions};
use crate::control::{now_ms, Control};
use crate::e2b::{same, Operation, SignedUrl};
use crate::error::{ControlError, Result};
use crate::files::archive::{self, PlannedKind};
use crate::files::{Chunks, FilesError};
use crate::ids::Caller;
use crate::templates::TemplateId;
use hmac::{Hmac, Mac};
use hutch_api::{Build, BuildState, CreateTemplate, ErrorCode, LimitsRequest, Readiness};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;

/// Most bytes of one uploaded tar (as sent). The build context they make
/// is held whole while a build starts, as native contexts are.
pub const UPLOAD_CAP: u64 = archive::ARCHIVE_CAP as u64;
/// Most bytes an owner's files cache keeps: past it, the files used least
/// recently are dropped (a build that needs one again uploads it again).
pub const OWNER_FILES_CAP: u64 = 1 << 30;
/// How long an upload URL is good for.
pub const UPLOAD_TTL_SECONDS: i64 = 3600;
/// How long a requested build waits for its steps.
const PENDING_TTL_MS: i64 = 3600 * 1000;
/// Most requested builds an owner may have waiting for their steps.
const PENDING_PER_OWNER: usize = 32;
/// The tag of a build asked for without one.
pub const DEFAULT_TAG: &str = "default";
/// Most tags one template may have.
const TAGS_PER_TEMPLATE: usize = 256;
/// E2B's base image: hutch's `base`.
const E2B_BASE: &str = "e2bdev/base";

/// Requested builds waiting for their steps, and the lock of tag files.
#[derive(Default)]
pub struct E2bBuilds {
    pending: Mutex<HashMap<String, Pending>>,
    tags: Mutex<()>,
    /// For recent builds, the E2B step of each Dockerfile step (see
    /// [`Translated::origins`]), to name the step a failure is in.
    origins: Mutex<HashMap<String, Vec<usize>>>,
}

/// Builds whose step origins are kept (a daemon restart forgets them).
const ORIGINS_KEPT: usize = 1024;

#[derive(Debug, Clone)]
struct Pending {
    owner: String,
    template_id: String,
    tags: Vec<String>,
    at_ms: i64,
}

/// `POST /v3/templates` (`TemplateBuildRequestV3`).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BuildRequest {
    pub name: Option<String>,
    /// Older SDKs' name.
    pub alias: Option<String>,
    #[serde(default)]
    pub tags: Vec<String>,
    pub cpu_count: Option<u32>,
    #[serde(rename = "memoryMB")]
    pub memory_mb: Option<u64>,
}

/// The answer to [`Control::e2b_request_build`].
#[derive(Debug, Clone)]
pub struct Requested {
    pub template_id: String,
    /// `bld-…`; see [`wire_build_id`].
    pub build_id: String,
    pub name: String,
    pub tags: Vec<String>,
}

/// One step of `TemplateBuildStartV2`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Step {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub args: Vec<String>,
    pub files_hash: Option<String>,
    #[serde(default)]
    pub force: bool,
}

/// `POST /v2/templates/{id}/builds/{build}` (`TemplateBuildStartV2`).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BuildSpec {
    pub from_image: Option<String>,
    pub from_template: Option<String>,
    pub from_image_registry: Option<serde_json::Value>,
    #[serde(default)]
    pub force: bool,
    #[serde(default)]
    pub steps: Vec<Step>,
    pub start_cmd: Option<String>,
    pub ready_cmd: Option<String>,
}

/// Where an E2B build is, with the log lines asked for.
#[derive(Debug, Clone)]
pub struct Status {
    pub template_id: String,
    pub build_id: String,
    /// `waiting`, `building`, `ready` or `error`.
    pub status: &'static str,
    pub entries: Vec<LogLine>,
    /// Why it failed: the message and the E2B step (`"1"`… or `finalize`).
    pub reason: Option<(String, Option<String>)>,
}

#[derive(Debug, Clone)]
pub struct LogLine {
    pub at_ms: i64,
    /// `info` or `error`.
    pub level: &'static str,
    pub message: String,
}

/// A tag of a template, as listed.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Tag {
    pub tag: String,
    pub build_id: String,
    pub at_ms: i64,
}

/// A build id as E2B's API carries it (a UUID, which the SDK parses):
/// `00000000-0000-0000-` and the 16 hex digits of `bld-…`.
pub fn wire_build_id(bld: &str) -> String {
    let hex = bld.strip_prefix("bld-").unwrap_or(bld);
    if hex.len() != 16 {
        return bld.to_owned();
    }
    format!("00000000-0000-0000-{}-{}", &hex[..4], &hex[4..])
}

/// The `bld-…` id of a build id as E2B's API carries it (either form).
pub fn parse_wire_build_id(s: &str) -> Result<String> {
    let s = s.to_ascii_lowercase();
    let hex = match s.strip_prefix("00000000-0000-0000-") {
        Some(rest) if rest.len() == 17 && rest.as_bytes()[4] == b'-' => format!("{}{}", &rest[..4], &rest[5..]),
        _ => s.strip_prefix("bld-").unwrap_or("").to_owned(),
    };
    let bld = format!("bld-{hex}");
    parse_build_id(&bld).map(str::to_owned).map_err(|_| ControlError::NoBuild(crate::ids::truncated(&s)))
}

/// `name` or `name:tag` split; the name is checked as template names are
/// (by the create), tags here.
pub fn split_name(s: &str) -> Result<(String, Option<String>)> {
    match s.split_once(':') {
        Some((n, t)) => {
            check_tag(t)?;
            Ok((n.to_owned(), Some(t.to_owned())))
        }
        None => Ok((s.to_owned(), None)),
    }
}

fn check_tag(t: &str) -> Result<()> {
    let ok = !t.is_empty()
        && t.len() <= 64
        && t.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        && t.as_bytes()[0].is_ascii_alphanumeric();
    if ok {
        Ok(())
    } else {
        Err(ControlError::Invalid(format!(
            "tag {:?}: 1 to 64 of letters, digits, - _ and ., starting with a letter or digit",
            crate::ids::truncated(t)
        )))
    }
}

fn check_hash(h: &str) -> Result<()> {
    if h.len() == 64 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        Ok(())
    } else {
        Err(ControlError::Invalid("a files hash is 64 lowercase hex digits".into()))
    }
}

/// A directory name for an owner: its id hashed (ids are not paths).
fn owner_dir(owner: &str) -> String {
    hex::encode(&Sha256::digest(owner.as_bytes())[..16])
}

/// The path an upload URL names (and signs).
pub fn upload_path(template_id: &str, hash: &str) -> String {
    format!("/templates/{template_id}/files/{hash}/upload")
}

/// What the SDK's steps become: the Dockerfile, each COPY's (step index,
/// files hash, roots of its tar), and the readiness check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Translated {
    pub dockerfile: String,
    /// For each Dockerfile step (in order), the E2B step it came from
    /// (1-based; 0 for the prelude).
    pub origins: Vec<usize>,
}

/// A double-quoted word for the Dockerfile's ENV and WORKDIR (its
/// `words` reads backslash escapes).
fn quoted(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

fn json(v: &[&str]) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

/// Runs `$0` with bash where the image has it (as E2B's steps run), else
/// with sh: a RUN's exec form, so that a command of many lines stays one.
const BASH_OR_SH: &str = r#"command -v bash >/dev/null 2>&1 && exec bash -c "$0" || exec sh -c "$0""#;

/// Translates the SDK's steps into hutch's Dockerfile fragment. `roots`
/// gives, for a COPY's step index, the top paths of its uploaded tar (what
/// its source matched). Steps run as `user` in /home/user unless they say
/// otherwise, as E2B's do; a RUN's own user holds for that step only.
/// Pure, so it is tested without a build.
pub fn translate(spec: &BuildSpec, roots: &HashMap<usize, Vec<String>>) -> Result<Translated> {
    let bad = |i: usize, m: String| ControlError::Invalid(format!("step {}: {m}", i + 1));
    let mut lines = vec!["USER user".to_owned(), format!("WORKDIR {}", quoted("/home/user"))];
    let mut origins = vec![0, 0];
    let mut user = "user".to_owned();
    let push = |lines: &mut Vec<String>, origins: &mut Vec<usize>, line: String, i: usize| {
        lines.push(line);
        origins.push(i + 1);
    };
    for (i, step) in spec.steps.iter().enumerate() {
        let args: Vec<&str> = step.args.iter().map(String::as_str).collect();
        if args.iter().any(|a| a.contains('\0')) {
            return Err(bad(i, "an argument holds a NUL byte".into()));
        }
        match step.kind.as_str() {
            "RUN" => {
                let (cmd, as_user) = match args.as_slice() {
                    [cmd] => (*cmd, None),
                    [cmd, ""] => (*cmd, None),
                    [cmd, u] => (*cmd, Some(*u)),
                    _ => return Err(bad(i, "RUN takes a command and an optional user".into())),
                };
                let run = format!("RUN {}", json(&["/bin/sh", "-c", BASH_OR_SH, cmd]));
                match as_user.filter(|u| *u != user) {
                    Some(u) => {
                        push(&mut lines, &mut origins, format!("USER {u}"), i);
                        push(&mut lines, &mut origins, run, i);
                        push(&mut lines, &mut origins, format!("USER {user}"), i);
                    }
                    None => push(&mut lines, &mut origins, run, i),
                }
            }
            "COPY" => {
                let (src, dest) = match args.as_slice() {
                    [s, d, ..] if !s.is_empty() && !d.is_empty() => (*s, *d),
                    _ => return Err(bad(i, "COPY takes a source and a destination".into())),
                };
                let owner = args.get(2).copied().filter(|u| !u.is_empty()).unwrap_or(&user);
                if !matches!(owner, "user" | "root") {
                    return Err(bad(i, format!("COPY as {owner:?}: use root or user")));
                }
                let mode = args.get(3).copied().filter(|m| !m.is_empty());
                if mode.is_some_and(|m| m.len() > 4 || !m.bytes().all(|b| (b'0'..=b'7').contains(&b))) {
                    return Err(bad(i, "COPY's mode must be octal, such as 0644".into()));
                }
                let mut sources: Vec<String> =
                    roots.get(&i).cloned().unwrap_or_default().into_iter().map(|r| join_ctx(i, &r)).collect();
                if sources.is_empty() {
                    return Err(bad(i, format!("COPY {src:?}: the uploaded files hold nothing")));
                }
                // A directory, a pattern or several files land inside the
                // destination; so does anything copied onto a directory
                // every sandbox has.
                let many = sources.len() > 1 || src.contains(['*', '?', '[']) || src == "." || src.ends_with('/');
                let mut dest = dest.to_owned();
                let known_dir =
                    matches!(dest.trim_end_matches('/'), "" | "." | "~" | "/home/user" | "/workspace" | "/tmp");
                if dest.starts_with("~/") {
                    dest = format!("/home/user/{}", &dest[2..]);
                } else if dest == "~" {
                    dest = "/home/user/".into();
                }
                if (many || known_dir) && !dest.ends_with('/') {
                    dest.push('/');
                }
                sources.push(dest);
                let refs: Vec<&str> = sources.iter().map(String::as_str).collect();
                let chmod = mode.map(|m| format!(" --chmod={m}")).unwrap_or_default();
                push(&mut lines, &mut origins, format!("COPY --chown={owner}:{owner}{chmod} {}", json(&refs)), i);
            }
            "ENV" => {
                if args.is_empty() || !args.len().is_multiple_of(2) {
                    return Err(bad(i, "ENV takes names and values in pairs".into()));
                }
                let mut pairs = Vec::new();
                for kv in args.chunks(2) {
                    let name_ok = !kv[0].is_empty() && kv[0].bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
                    if !name_ok || kv[0].as_bytes()[0].is_ascii_digit() {
                        return Err(bad(i, format!("ENV name {:?}: use letters, digits and _", kv[0])));
                    }
                    if kv[1].contains(['\n', '\r']) {
                        return Err(bad(i, format!("ENV {}: a value on more than one line", kv[0])));
                    }
                    pairs.push(format!("{}={}", kv[0], quoted(kv[1])));
                }
                push(&mut lines, &mut origins, format!("ENV {}", pairs.join(" ")), i);
            }
            "WORKDIR" => {
                let [dir] = args.as_slice() else { return Err(bad(i, "WORKDIR takes one path".into())) };
                let dir = if *dir == "~" { "/home/user".to_owned() } else { dir.replacen("~/", "/home/user/", 1) };
                if dir.contains(['\n', '\r']) {
                    return Err(bad(i, "WORKDIR on more than one line".into()));
                }
                push(&mut lines, &mut origins, format!("WORKDIR {}", quoted(&dir)), i);
            }
            "USER" => {
                let [u] = args.as_slice() else { return Err(bad(i, "USER takes one user".into())) };
                if !matches!(*u, "user" | "root") {
                    return Err(bad(i, format!("USER {u:?} is not supported: use root or user")));
                }
                user = (*u).to_owned();
                push(&mut lines, &mut origins, format!("USER {u}"), i);
            }
            other => return Err(bad(i, format!("{other:?} is not a step hutch knows"))),
        }
    }
    if let Some(cmd) = spec.start_cmd.as_deref().filter(|c| !c.trim().is_empty()) {
        // The startup command runs in bash where the image has it: one
        // line as it is, more in the exec form.
        let one_line =
            !cmd.contains(['\n', '\r']) && !cmd.trim_end().ends_with('\\') && !cmd.trim_start().starts_with('[');
        if one_line {
            lines.push(format!("CMD {}", cmd.trim()));
        } else {
            lines.push(format!("CMD {}", json(&["/bin/sh", "-c", BASH_OR_SH, cmd])));
        }
        origins.push(spec.steps.len() + 1);
    }
    Ok(Translated { dockerfile: lines.join("\n") + "\n", origins })
}

/// A path of COPY step `i`'s files in the build context.
fn join_ctx(i: usize, rel: &str) -> String {
    if rel.is_empty() {
        format!("s{i}")
    } else {
        format!("s{i}/{rel}")
    }
}

/// The readiness check of a `ready_cmd`.
fn readiness_of(cmd: Option<&str>) -> Option<Readiness> {
    cmd.filter(|c| !c.trim().is_empty()).map(|c| Readiness {
        command: Some(c.to_owned()),
        port: None,
        timeout_seconds: Some(super::VALIDATE_TIMEOUT),
    })
}

/// The tar of one upload, checked as a build context is, and its entries
/// re-rooted under `s<i>/` in `out`; answers the top paths (those whose
/// parent the tar does not hold).
fn add_upload(out: &mut tar::Builder<impl Write>, i: usize, bytes: &[u8]) -> Result<Vec<String>> {
    let refused = |m: String| {
        ControlError::Files(FilesError::new(
            ErrorCode::SandboxArchiveInvalid,
            format!("files of COPY step {}: {m}", i + 1),
        ))
    };
    let plan = archive::validate(bytes).map_err(|e| refused(e.to_string()))?;
    let mut contents: Vec<Vec<u8>> = plan.files_in_order.iter().map(|_| Vec::new()).collect();
    archive::stream_files(bytes, &plan, 64 * 1024, |f, chunk| {
        if let Some(c) = contents.get_mut(f) {
            c.extend_from_slice(&chunk);
        }
        true
    })
    .map_err(|e| refused(e.to_string()))?;
    let paths: BTreeSet<&str> = plan.entries.iter().map(|e| e.path.as_str()).collect();
    let mut roots = Vec::new();
    for e in &plan.entries {
        let has_parent = {
            let mut p = e.path.as_str();
            let mut found = false;
            while let Some((parent, _)) = p.rsplit_once('/') {
                if paths.contains(parent) {
                    found = true;
                    break;
                }
                p = parent;
            }
            found
        };
        if !has_parent && !e.path.is_empty() {
            roots.push(e.path.clone());
        }
        let mut h = tar::Header::new_gnu();
        h.set_mode(e.mode & 0o7777);
        h.set_mtime(0);
        let name = join_ctx(i, &e.path);
        match e.kind {
            PlannedKind::Dir => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_size(0);
                out.append_data(&mut h, &name, std::io::empty()).map_err(|e| refused(e.to_string()))?;
            }
            PlannedKind::File(_) => {
                let idx = plan.files_in_order.iter().position(|p| p == &e.path).unwrap_or(usize::MAX);
                let data = contents.get(idx).map_or(&[][..], Vec::as_slice);
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(data.len() as u64);
                out.append_data(&mut h, &name, data).map_err(|e| refused(e.to_string()))?;
            }
        }
    }
    Ok(roots)
}

impl Control {
    fn e2b_dir(&self, what: &str, owner: &str) -> PathBuf {
        self.runtime.config().state_dir.join(what).join(owner_dir(owner))
    }

    /// The token a files upload URL is signed under: the owner, template
    /// and hash, under the daemon's E2B secret.
    fn files_token(&self, owner: &str, template_id: &str, hash: &str) -> String {
        let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(&self.e2b_secret) else { return String::new() };
        mac.update(format!("template-files:{owner}:{template_id}:{hash}").as_bytes());
        hex::encode(mac.finalize().into_bytes())
    }

    fn pending_sweep(&self) -> std::sync::MutexGuard<'_, HashMap<String, Pending>> {
        let mut p = self.builds.e2b.pending.lock().unwrap_or_else(|e| e.into_inner());
        let now = now_ms();
        p.retain(|_, v| now - v.at_ms < PENDING_TTL_MS);
        p
    }

    /// `POST /v3/templates`: the caller's template of that name (made when
    /// missing, with the limits asked for) and a build id for its steps.
    pub async fn e2b_request_build(&self, caller: &Caller, req: &BuildRequest) -> Result<Requested> {
        let full = req.name.as_deref().or(req.alias.as_deref()).unwrap_or("").trim();
        if full.is_empty() {
            return Err(ControlError::Invalid("name is required".into()));
        }
        let (name, tag) = split_name(full)?;
        let mut tags: Vec<String> = tag.into_iter().chain(req.tags.iter().cloned()).collect();
        for t in &tags {
            check_tag(t)?;
        }
        tags.sort();
        tags.dedup();
        if tags.is_empty() {
            tags.push(DEFAULT_TAG.into());
        }
        let (o, n) = (caller.owner.to_string(), name.clone());
        let t = match self.db(move |s| s.template_by_name(&o, &n)).await? {
            Some(t) => t.id,
            None => {
                let create = CreateTemplate {
                    name: name.clone(),
                    image: None,
                    class: None,
                    memory_mb: req.memory_mb,
                    limits: req
                        .cpu_count
                        .map(|c| LimitsRequest { vcpus: Some(f64::from(c)), ..LimitsRequest::default() }),
                    env: BTreeMap::new(),
                    default_ttl_seconds: None,
                    max_ttl_seconds: None,
                    warm: None,
                    startup: None,
                    readiness: None,
                    network: None,
                    storage: None,
                    ..CreateTemplate::default()
                };
                self.create_template(caller, &create).await?.id
            }
        };
        let build_id = format!("bld-{}", hutch_runtime::sys::random_hex(8));
        let owner = caller.owner.to_string();
        let mut pending = self.pending_sweep();
        if pending.values().filter(|p| p.owner == owner).count() >= PENDING_PER_OWNER {
            return Err(ControlError::Invalid(format!(
                "at most {PENDING_PER_OWNER} builds may wait for their steps; start or drop some first"
            )));
        }
        pending
            .insert(build_id.clone(), Pending { owner, template_id: t.clone(), tags: tags.clone(), at_ms: now_ms() });
        Ok(Requested { template_id: t, build_id, name, tags })
    }

    /// `GET /templates/{id}/files/{hash}`: whether the caller's files cache
    /// holds `hash`, else the path and query of a signed upload URL.
    pub async fn e2b_files(&self, caller: &Caller, template_id: &str, hash: &str) -> Result<Option<String>> {
        let tid = TemplateId::parse(template_id)?;
        let t = self.template_of(caller, &tid).await?;
        check_hash(hash)?;
        if self.e2b_dir("e2b-files", &t.owner).join(hash).is_file() {
            return Ok(None);
        }
        let exp = now_ms() / 1000 + UPLOAD_TTL_SECONDS;
        let path = upload_path(&t.id, hash);
        let signed = SignedUrl {
            path: path.clone(),
            operation: Operation::Write,
            username: String::new(),
            signature: String::new(),
            expiration: Some(exp),
        };
        let sig = signed.expected(&self.files_token(&t.owner, &t.id, hash));
        let sig = sig.replace('+', "%2B").replace('/', "%2F");
        Ok(Some(format!("{path}?expires={exp}&signature={sig}")))
    }

    /// Whether a signed upload URL is good (its signature, its expiry, its
    /// template): checked before the body is read. Answers the template's
    /// owner.
    pub async fn e2b_upload_authorized(
        &self,
        template_id: &str,
        hash: &str,
        expires: i64,
        signature: &str,
    ) -> Result<String> {
        let invalid = || ControlError::Unauthorized("invalid signature");
        let tid = TemplateId::parse(template_id).map_err(|_| invalid())?;
        check_hash(hash).map_err(|_| invalid())?;
        let id = tid.to_string();
        let t = self.db(move |s| s.get_template(&id)).await?.filter(|t| t.deleted_at.is_none());
        let Some(t) = t else { return Err(invalid()) };
        let signed = SignedUrl {
            path: upload_path(&t.id, hash),
            operation: Operation::Write,
            username: String::new(),
            signature: signature.to_owned(),
            expiration: Some(expires),
        };
        if !same(signature, &signed.expected(&self.files_token(&t.owner, &t.id, hash))) {
            return Err(invalid());
        }
        if expires < now_ms() / 1000 {
            return Err(ControlError::Unauthorized("signature is already expired"));
        }
        Ok(t.owner)
    }

    /// The signed upload (`PUT` to the URL [`Control::e2b_files`] gave):
    /// checked as [`Control::e2b_upload_authorized`] does, then the body,
    /// at most [`UPLOAD_CAP`] bytes, is streamed to a file of the template
    /// owner's cache and named by its hash once whole.
    pub async fn e2b_upload(
        &self,
        template_id: &str,
        hash: &str,
        expires: i64,
        signature: &str,
        mut body: Chunks,
    ) -> Result<()> {
        let owner = self.e2b_upload_authorized(template_id, hash, expires, signature).await?;
        let dir = self.e2b_dir("e2b-files", &owner);
        std::fs::create_dir_all(&dir).map_err(|e| ControlError::Runtime(format!("files cache: {e}")))?;
        let tmp = dir.join(format!(".{hash}.{}", hutch_runtime::sys::random_hex(4)));
        let path = tmp.clone();
        // Written on a thread of its own, chunk by chunk as they arrive.
        let written = tokio::task::spawn_blocking(move || -> Result<()> {
            use std::os::unix::fs::OpenOptionsExt;
            let io = |e: std::io::Error| ControlError::Runtime(format!("files cache: {e}"));
            let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path).map_err(io)?;
            let mut total = 0u64;
            while let Some(chunk) = body.blocking_recv() {
                let chunk = chunk?;
                total += chunk.len() as u64;
                if total > UPLOAD_CAP {
                    return Err(ControlError::Files(FilesError::new(
                        ErrorCode::PayloadTooLarge,
                        format!("the files of one COPY are limited to {UPLOAD_CAP} bytes"),
                    )));
                }
                f.write_all(&chunk).map_err(io)?;
            }
            f.sync_all().map_err(io)
        })
        .await
        .map_err(|e| ControlError::Runtime(format!("files cache: {e}")))
        .and_then(|r| r);
        match written {
            Ok(()) => {
                std::fs::rename(&tmp, dir.join(hash)).map_err(|e| {
                    let _ = std::fs::remove_file(&tmp);
                    ControlError::Runtime(format!("files cache: {e}"))
                })?;
                let keep = dir.join(hash);
                tokio::task::spawn_blocking(move || trim_cache(&keep, OWNER_FILES_CAP)).await?;
                Ok(())
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    /// The image an E2B build starts from, and the reference to pull into
    /// it first (from a registry the operator allows).
    async fn e2b_parent(&self, caller: &Caller, spec: &BuildSpec) -> Result<(String, Option<String>)> {
        if spec.from_image_registry.is_some() {
            return Err(ControlError::Invalid(
                "registry credentials (from_image with a username, from_aws_registry, from_gcp_registry) are not \
                 supported"
                    .into(),
            ));
        }
        match (spec.from_template.as_deref(), spec.from_image.as_deref()) {
            (Some(_), Some(_)) => Err(ControlError::Invalid("fromImage and fromTemplate exclude each other".into())),
            // E2B's public `base` template is hutch's `base`.
            (Some("base"), None) => Ok(("base".into(), None)),
            (Some(name), None) => {
                let (name, _) = split_name(name)?;
                let (o, n) = (caller.owner.to_string(), name.clone());
                let t = match TemplateId::parse(&name) {
                    Ok(id) => self.template_of(caller, &id).await.ok(),
                    Err(_) => self.db(move |s| s.template_by_name(&o, &n)).await?,
                };
                match t {
                    Some(t) if t.owner == caller.owner.to_string() => Ok((t.image, None)),
                    _ => Err(ControlError::UnknownTemplate(name)),
                }
            }
            (None, None) => Ok(("base".into(), None)),
            (None, Some(image)) => {
                let bare = image.strip_suffix(":latest").unwrap_or(image);
                if bare == E2B_BASE || bare == "base" {
                    return Ok(("base".into(), None));
                }
                if let Ok(r) = hutch_runtime::image::registry::Reference::parse(image) {
                    let host =
                        if r.registry.is_empty() { "docker.io".to_owned() } else { r.registry.to_ascii_lowercase() };
                    if self.e2b_registries.contains(&host) {
                        // Pulled for this owner alone, under a name of its own.
                        let owner = owner_dir(caller.owner.as_ref());
                        let local = hutch_runtime::image::local_name(image);
                        let name: String = format!("e2b-{}-{local}", &owner[..12]).chars().take(128).collect();
                        return Ok((name, Some(image.to_owned())));
                    }
                }
                // A shared image of the host's store, by its name or the
                // name a pull of that reference gets.
                let store = self.images()?;
                for name in [image.to_owned(), hutch_runtime::image::local_name(image)] {
                    if let Ok(img) = store.get(&name) {
                        if img.is_shared() {
                            return Ok((name, None));
                        }
                    }
                }
                Err(ControlError::Invalid(format!(
                    "from_image({image:?}): the host has no such image and its registry is not one the daemon pulls \
                     from (--e2b-registries); the operator may pull it with `hutch image pull {image}`, or use \
                     from_base_image or from_template"
                )))
            }
        }
    }

    /// `POST /v2/templates/{id}/builds/{build}`: the steps of a requested
    /// build, run as a hutch build.
    pub async fn e2b_start_build(
        self: &std::sync::Arc<Self>,
        caller: &Caller,
        template_id: &str,
        build: &str,
        spec: &BuildSpec,
    ) -> Result<Build> {
        let tid = TemplateId::parse(template_id)?;
        let t = self.template_of(caller, &tid).await?;
        let bld = parse_wire_build_id(build)?;
        let owner = caller.owner.to_string();
        let pending = {
            let mut p = self.pending_sweep();
            match p.get(&bld) {
                Some(e) if e.owner == owner && e.template_id == t.id => p.remove(&bld),
                _ => None,
            }
        };
        let Some(pending) = pending else { return Err(ControlError::NoBuild(wire_build_id(&bld))) };
        let (parent, pull) = self.e2b_parent(caller, spec).await?;
        // The uploaded files of each COPY, re-rooted in one context.
        let dir = self.e2b_dir("e2b-files", &owner);
        let copies: Vec<(usize, String)> = spec
            .steps
            .iter()
            .enumerate()
            .filter(|(_, s)| s.kind == "COPY")
            .map(|(i, s)| (i, s.files_hash.clone().unwrap_or_default()))
            .collect();
        let spec2 = spec.clone();
        let (context, origins) = tokio::task::spawn_blocking(move || -> Result<(Vec<u8>, Vec<usize>)> {
            let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            let mut out = tar::Builder::new(gz);
            let mut roots = HashMap::new();
            for (i, hash) in &copies {
                check_hash(hash)
                    .map_err(|_| ControlError::Invalid(format!("step {}: COPY without its files hash", i + 1)))?;
                let path = dir.join(hash);
                let bytes = std::fs::read(&path).map_err(|_| {
                    ControlError::Invalid(format!("step {}: the files of this COPY were not uploaded", i + 1))
                })?;
                // Used now: the last the cache drops.
                let _ = std::fs::File::options()
                    .append(true)
                    .open(&path)
                    .and_then(|f| f.set_modified(std::time::SystemTime::now()));
                roots.insert(*i, add_upload(&mut out, *i, &bytes)?);
            }
            let tr = translate(&spec2, &roots)?;
            let mut h = tar::Header::new_gnu();
            h.set_mode(0o644);
            h.set_size(tr.dockerfile.len() as u64);
            h.set_entry_type(tar::EntryType::Regular);
            let io = |e: std::io::Error| ControlError::Runtime(format!("build context: {e}"));
            out.append_data(&mut h, "Dockerfile", tr.dockerfile.as_bytes()).map_err(io)?;
            let gz = out.into_inner().map_err(io)?;
            Ok((gz.finish().map_err(io)?, tr.origins))
        })
        .await??;
        // `skip_cache`: from the first Dockerfile step of the first forced
        // SDK step (all of them when the whole build is forced).
        let forced = spec.steps.iter().position(|s| s.force);
        let no_cache_from =
            if spec.force { Some(0) } else { forced.and_then(|f| origins.iter().position(|&o| o == f + 1)) };
        let opts = BuildOptions {
            id: Some(bld.clone()),
            parent: Some(parent),
            readiness: readiness_of(spec.ready_cmd.as_deref()),
            pull,
            no_cache_from,
        };
        let started = self.start_build_with(caller, &tid, context, opts).await?;
        {
            let mut kept = self.builds.e2b.origins.lock().unwrap_or_else(|e| e.into_inner());
            if kept.len() >= ORIGINS_KEPT {
                kept.clear();
            }
            kept.insert(bld.clone(), origins);
        }
        self.e2b_set_tags(&owner, &t.id, &pending.tags, &bld)?;
        Ok(started)
    }

    /// `GET /templates/{id}/builds/{build}/status`: the state and the log
    /// lines from `offset` (at most `limit`).
    pub async fn e2b_build_status(
        self: &std::sync::Arc<Self>,
        caller: &Caller,
        template_id: &str,
        build: &str,
        offset: usize,
        limit: usize,
    ) -> Result<Status> {
        let tid = TemplateId::parse(template_id)?;
        let t = self.template_of(caller, &tid).await?;
        let bld = parse_wire_build_id(build)?;
        let waiting = self
            .pending_sweep()
            .get(&bld)
            .is_some_and(|p| p.owner == caller.owner.to_string() && p.template_id == t.id);
        if waiting {
            return Ok(Status {
                template_id: t.id,
                build_id: bld,
                status: "waiting",
                entries: Vec::new(),
                reason: None,
            });
        }
        let b = self.get_build(caller, &tid, &bld).await?;
        let finished = matches!(b.state, BuildState::Succeeded | BuildState::Failed);
        let path = self.images()?.build_log(&bld);
        let text = tokio::task::spawn_blocking(move || std::fs::read(path).unwrap_or_default()).await?;
        let text = String::from_utf8_lossy(&text);
        let mut lines: Vec<&str> = text.split('\n').collect();
        // The last piece is a line still being written (or empty).
        if !finished || lines.last().is_some_and(|l| l.is_empty()) {
            lines.pop();
        }
        let at = now_ms();
        let entries = lines
            .iter()
            .skip(offset)
            .take(limit)
            .map(|l| LogLine {
                at_ms: at,
                level: if l.starts_with("---> failed") || l.starts_with("Build failed") { "error" } else { "info" },
                message: (*l).to_owned(),
            })
            .collect();
        let status = match b.state {
            BuildState::Queued => "waiting",
            BuildState::Building => "building",
            BuildState::Succeeded => "ready",
            BuildState::Failed => "error",
        };
        let reason = (b.state == BuildState::Failed).then(|| {
            let msg = b.error.clone().unwrap_or_else(|| "the build failed".into());
            let kept = self.builds.e2b.origins.lock().unwrap_or_else(|e| e.into_inner());
            let step = failed_step(&msg, kept.get(&bld).map(Vec::as_slice));
            (msg, step)
        });
        Ok(Status { template_id: t.id, build_id: bld, status, entries, reason })
    }

    /// `GET /templates/aliases/{alias}`: the caller's template of that name.
    pub async fn e2b_alias(&self, caller: &Caller, alias: &str) -> Result<String> {
        let (name, _) = split_name(alias)?;
        let (o, n) = (caller.owner.to_string(), name.clone());
        match self.db(move |s| s.template_by_name(&o, &n)).await? {
            Some(t) => Ok(t.id),
            None => Err(ControlError::UnknownTemplate(name)),
        }
    }

    /// The caller's template by E2B's reference: its id, name or
    /// `name:tag`; with a tag, only when the tag names the template's
    /// current build (hutch runs a template's latest build). A template
    /// the E2B API built (it has tags) but never successfully is refused,
    /// as E2B refuses it, rather than started on the image it began with.
    pub async fn e2b_template_name(&self, caller: &Caller, reference: &str) -> Result<String> {
        let (name, tag) = split_name(reference)?;
        let t = match TemplateId::parse(&name) {
            Ok(id) => self.template_of(caller, &id).await.map_err(|_| ControlError::UnknownTemplate(name.clone()))?,
            Err(_) => {
                let (o, n) = (caller.owner.to_string(), name.clone());
                self.db(move |s| s.template_by_name(&o, &n))
                    .await?
                    .ok_or(ControlError::UnknownTemplate(name.clone()))?
            }
        };
        let tags = self.e2b_tags_of(&t.owner, &t.id);
        if !tags.is_empty() {
            let tid = t.id.clone();
            let builds = self.db(move |s| s.list_builds(&tid)).await?;
            if !builds.iter().any(|b| b.state == BuildState::Succeeded) {
                return Err(ControlError::Conflict(format!("template {} has no successful build", t.name)));
            }
        }
        if let Some(tag) = tag {
            let Some(entry) = tags.get(&tag) else { return Err(ControlError::UnknownTemplate(reference.to_owned())) };
            let id = entry.build_id.clone();
            let b = self.db(move |s| s.get_build(&id)).await?;
            if b.and_then(|b| b.version) != Some(t.version) {
                return Err(ControlError::Conflict(format!(
                    "tag {tag} names a build that is not the template's current one; hutch runs a template's latest \
                     build only"
                )));
            }
        }
        Ok(t.name)
    }

    fn tags_path(&self, owner: &str) -> PathBuf {
        self.runtime.config().state_dir.join("e2b-tags").join(format!("{}.json", owner_dir(owner)))
    }

    fn e2b_all_tags(&self, owner: &str) -> BTreeMap<String, BTreeMap<String, Tag>> {
        std::fs::read(self.tags_path(owner)).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default()
    }

    fn e2b_tags_of(&self, owner: &str, template_id: &str) -> BTreeMap<String, Tag> {
        self.e2b_all_tags(owner).remove(template_id).unwrap_or_default()
    }

    /// Changes the owner's tags under the tag lock, written whole (a
    /// temporary renamed into place).
    fn e2b_edit_tags<T>(
        &self,
        owner: &str,
        edit: impl FnOnce(&mut BTreeMap<String, BTreeMap<String, Tag>>) -> Result<T>,
    ) -> Result<T> {
        let _lock = self.builds.e2b.tags.lock().unwrap_or_else(|e| e.into_inner());
        let mut all = self.e2b_all_tags(owner);
        let out = edit(&mut all)?;
        let path = self.tags_path(owner);
        let io = |e: std::io::Error| ControlError::Runtime(format!("tags: {e}"));
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec(&all).unwrap_or_default()).map_err(io)?;
        std::fs::rename(&tmp, &path).map_err(io)?;
        Ok(out)
    }

    fn e2b_set_tags(&self, owner: &str, template_id: &str, tags: &[String], build: &str) -> Result<()> {
        self.e2b_edit_tags(owner, |all| {
            let mine = all.entry(template_id.to_owned()).or_default();
            for tag in tags {
                mine.insert(tag.clone(), Tag { tag: tag.clone(), build_id: build.to_owned(), at_ms: now_ms() });
            }
            if mine.len() > TAGS_PER_TEMPLATE {
                return Err(ControlError::Invalid(format!("a template has at most {TAGS_PER_TEMPLATE} tags")));
            }
            Ok(())
        })
    }

    /// The caller's template by id or name (no tag).
    async fn e2b_template(&self, caller: &Caller, reference: &str) -> Result<hutch_store::TemplateRecord> {
        let (name, _) = split_name(reference)?;
        match TemplateId::parse(&name) {
            Ok(id) => self.template_of(caller, &id).await,
            Err(_) => {
                let (o, n) = (caller.owner.to_string(), name.clone());
                self.db(move |s| s.template_by_name(&o, &n)).await?.ok_or(ControlError::NoTemplate(name))
            }
        }
    }

    /// `GET /templates/{id}/tags`.
    pub async fn e2b_list_tags(&self, caller: &Caller, reference: &str) -> Result<Vec<Tag>> {
        let t = self.e2b_template(caller, reference).await?;
        Ok(self.e2b_tags_of(&t.owner, &t.id).into_values().collect())
    }

    /// `POST /templates/tags`: `tags` name the build `target` (`name:tag`,
    /// `default` without a tag) names. Answers that build.
    pub async fn e2b_assign_tags(&self, caller: &Caller, target: &str, tags: &[String]) -> Result<String> {
        let t = self.e2b_template(caller, target).await?;
        let (_, tag) = split_name(target)?;
        let tag = tag.unwrap_or_else(|| DEFAULT_TAG.into());
        if tags.is_empty() {
            return Err(ControlError::Invalid("tags must name at least one tag".into()));
        }
        for tag in tags {
            check_tag(tag)?;
        }
        let build = self
            .e2b_tags_of(&t.owner, &t.id)
            .get(&tag)
            .map(|e| e.build_id.clone())
            .ok_or_else(|| ControlError::NoTemplate(format!("{}:{tag}", t.name)))?;
        self.e2b_set_tags(&t.owner, &t.id, tags, &build)?;
        Ok(build)
    }

    /// `DELETE /templates/tags`.
    pub async fn e2b_remove_tags(&self, caller: &Caller, name: &str, tags: &[String]) -> Result<()> {
        let t = self.e2b_template(caller, name).await?;
        self.e2b_edit_tags(&t.owner, |all| {
            let mine = all.entry(t.id.clone()).or_default();
            for tag in tags {
                if mine.remove(tag).is_none() {
                    return Err(ControlError::NoTemplate(format!("{}:{tag}", t.name)));
                }
            }
            Ok(())
        })
    }
}

/// Drops the files of an owner's cache used least recently (by mtime: a
/// build that reads one touches it) until the directory holds at most
/// `cap` bytes; `keep`, just written, stays.
fn trim_cache(keep: &std::path::Path, cap: u64) {
    let Some(dir) = keep.parent() else { return };
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut files: Vec<(std::time::SystemTime, u64, PathBuf)> = entries
        .flatten()
        .filter_map(|e| {
            let m = e.metadata().ok()?;
            m.is_file().then(|| (m.modified().unwrap_or(std::time::UNIX_EPOCH), m.len(), e.path()))
        })
        .collect();
    let mut total: u64 = files.iter().map(|(_, n, _)| n).sum();
    files.sort();
    for (_, n, path) in files {
        if total <= cap {
            break;
        }
        if path != keep && std::fs::remove_file(&path).is_ok() {
            total -= n;
        }
    }
}

/// E2B's name of the step a failure is in: `finalize` for a failed check of
/// the result, `base` for the image it starts from, else the number of the
/// SDK's step (1-based, as the SDK counts its stack traces) the failed
/// Dockerfile step (`step N/M (...)`) came from.
fn failed_step(msg: &str, origins: Option<&[usize]>) -> Option<String> {
    if msg.starts_with("validation failed") {
        return Some("finalize".into());
    }
    if msg.starts_with("pulling the image failed") {
        return Some("base".into());
    }
    let n: usize = msg.strip_prefix("step ")?.split('/').next()?.parse().ok()?;
    match origins?.get(n.checked_sub(1)?)? {
        0 => Some("base".into()),
        i => Some(i.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(kind: &str, args: &[&str]) -> Step {
        Step { kind: kind.into(), args: args.iter().map(|s| s.to_string()).collect(), files_hash: None, force: false }
    }

    #[test]
    fn build_ids_round_trip_as_uuids() {
        let w = wire_build_id("bld-0123456789abcdef");
        assert_eq!(w, "00000000-0000-0000-0123-456789abcdef");
        assert_eq!(parse_wire_build_id(&w).expect("parse"), "bld-0123456789abcdef");
        assert_eq!(parse_wire_build_id("bld-0123456789abcdef").expect("parse"), "bld-0123456789abcdef");
        for bad in ["", "00000000-0000-0000-0123-456789abcdeg", "12345678-0000-0000-0123-456789abcdef", "bld-12"] {
            assert!(parse_wire_build_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_files_cache_drops_the_least_recently_used_past_its_cap() {
        let dir = std::env::temp_dir().join(format!("hutch-e2b-cache-{}", hutch_runtime::sys::random_hex(4)));
        std::fs::create_dir_all(&dir).expect("dir");
        let t0 = std::time::SystemTime::now();
        for (i, name) in ["old", "mid", "new"].iter().enumerate() {
            std::fs::write(dir.join(name), [0u8; 10]).expect("write");
            let f = std::fs::File::options().append(true).open(dir.join(name)).expect("open");
            f.set_modified(t0 - std::time::Duration::from_secs(100 - i as u64 * 10)).expect("mtime");
        }
        trim_cache(&dir.join("old"), 20);
        let left: BTreeSet<String> =
            std::fs::read_dir(&dir).expect("read").flatten().map(|e| e.file_name().to_string_lossy().into()).collect();
        assert_eq!(left, BTreeSet::from(["old".to_owned(), "new".to_owned()]));
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn a_failure_names_the_sdk_step_it_came_from() {
        let origins = [0, 0, 1, 2, 2, 2, 3];
        assert_eq!(failed_step("step 5/7 (RUN x) failed: exit code 3", Some(&origins)).as_deref(), Some("2"));
        assert_eq!(failed_step("step 1/7 (USER user) failed: x", Some(&origins)).as_deref(), Some("base"));
        assert_eq!(failed_step("validation failed: not ready", None).as_deref(), Some("finalize"));
        assert_eq!(failed_step("step 9/7 (x) failed", Some(&origins)), None);
        assert_eq!(failed_step("step 2/7 (x) failed", None), None);
    }

    #[test]
    fn names_and_tags_split() {
        assert_eq!(split_name("app:v1").expect("ok"), ("app".into(), Some("v1".into())));
        assert_eq!(split_name("app").expect("ok"), ("app".into(), None));
        assert!(split_name("app:").is_err());
        assert!(split_name("app:a b").is_err());
    }

    #[test]
    fn steps_become_the_dockerfile_fragment() {
        let spec = BuildSpec {
            steps: vec![
                step("COPY", &["app.txt", "/home/user/app.txt", "", ""]),
                step("RUN", &["echo 'hi'\necho there", "root"]),
                step("ENV", &["A", "one \"two\"", "B", "x"]),
                step("WORKDIR", &["/opt/app"]),
                step("USER", &["root"]),
                step("COPY", &["dir", "/opt/app", "user", "0750"]),
                step("RUN", &["make"]),
            ],
            start_cmd: Some("python3 -m http.server 8000".into()),
            ready_cmd: Some("curl -s localhost:8000".into()),
            ..BuildSpec::default()
        };
        let roots = HashMap::from([(0, vec!["app.txt".to_owned()]), (5, vec!["dir".to_owned()])]);
        let t = translate(&spec, &roots).expect("translate");
        let steps = super::super::dockerfile::parse(&t.dockerfile).expect("our parser takes it");
        assert_eq!(steps.len(), t.origins.len());
        let text: Vec<&str> = t.dockerfile.lines().collect();
        assert_eq!(text[0], "USER user");
        assert_eq!(text[2], r#"COPY --chown=user:user ["s0/app.txt","/home/user/app.txt"]"#);
        assert_eq!(text[3], "USER root");
        let bash = serde_json::to_string(BASH_OR_SH).expect("json");
        assert_eq!(text[4], format!(r#"RUN ["/bin/sh","-c",{bash},"echo 'hi'\necho there"]"#));
        assert_eq!(text[5], "USER user");
        assert_eq!(text[6], r#"ENV A="one \"two\"" B="x""#);
        assert_eq!(text[9], r#"COPY --chown=user:user --chmod=0750 ["s5/dir","/opt/app"]"#);
        assert_eq!(text[10], format!(r#"RUN ["/bin/sh","-c",{bash},"make"]"#));
        assert_eq!(text[11], "CMD python3 -m http.server 8000");
        assert_eq!(t.origins[4], 2);
        match &steps[6].instruction {
            super::super::dockerfile::Instruction::Env(pairs) => {
                assert_eq!(pairs[0], ("A".into(), "one \"two\"".into()))
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn bad_steps_are_refused() {
        for s in [
            step("USER", &["nobody"]),
            step("ENV", &["A"]),
            step("COPY", &["a"]),
            step("ADD", &["x", "y"]),
            step("RUN", &["a", "b", "c"]),
            step("COPY", &["a", "/b", "nobody", ""]),
        ] {
            let spec = BuildSpec { steps: vec![s.clone()], ..BuildSpec::default() };
            assert!(translate(&spec, &HashMap::from([(0, vec!["a".to_owned()])])).is_err(), "{s:?}");
        }
    }
}

//! Template builds: a Dockerfile fragment and the files it copies (a tar.gz
//! build context) run over the template's image, one step at a time, into
//! new image layers; the result is checked (its startup command starts and
//! becomes ready) and activated as the template's next version. A failed
//! build leaves the active version serving.
//!
//! Each RUN step runs in a build sandbox with the template's limits, as
//! root, whose writable layer is a size-capped tmpfs of the host
//! ([`hutch_runtime::capture::Scratch`]); after the step the sandbox is
//! destroyed and its layer captured ([`hutch_runtime::capture::capture`]).
//! COPY and WORKDIR write their layer directly from the validated context.
//! A step's cache key chains the key before it, the instruction and the
//! digests of the files it copies, from a first key that names the build's
//! owner; an unchanged step of the same owner reuses its layer. Builds,
//! their cache, layers, images and logs are their owner's: the image store
//! keeps the cache per owner and names an owner's layers apart from any
//! other's ([`hutch_runtime::image::LayerScope::Owner`]), so no answer of a
//! build (cached or not, a layer's id) says what another owner built.
//!
//! The context is validated whole before anything runs, with the same rules
//! as archive uploads (`files/archive.rs`); so is the Dockerfile, whose
//! refusal names the line. Builds of one template run one at a time.

pub mod dockerfile;
pub mod e2b;

use crate::control::{now_ms, rfc3339, Control};
use crate::error::{ControlError, Result};
use crate::files::archive::{self, ArchiveError, ArchivePlan, PlannedKind};
use crate::ids::Caller;
use crate::ready::{describe_exit, until_ready, ReadyCheck};
use crate::templates::TemplateId;
use dockerfile::{Command, Instruction, Step};
use hutch_agent::proto::{Cmd, ExitStatus, FromAgent, Reply, Request, Spawn};
use hutch_api::{Build, BuildList, BuildState, ErrorCode, Readiness, Startup};
use hutch_runtime::capture::{capture, CaptureLimits, Scratch};
use hutch_runtime::cgroup::Limits as CgLimits;
use hutch_runtime::image::{Image, ImageError, ImageStore, LayerScope};
use hutch_runtime::RootSource;
use hutch_runtime::SandboxSpec;
use hutch_store::{BuildRecord, TemplateRecord};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{self, Read, Seek, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// Most bytes of a build's log; output past it is dropped with a note.
pub const LOG_CAP: u64 = 8 << 20;
/// Room kept past the cap for step headers and the outcome.
const LOG_SLACK: u64 = 64 << 10;
/// Longest one RUN step may run.
const STEP_TIMEOUT: Duration = Duration::from_secs(30 * 60);
/// A build's readiness check waits at most this long.
pub const VALIDATE_TIMEOUT: u32 = 30;
/// Without a readiness check, the startup command must keep running this long.
const STARTUP_GRACE: Duration = Duration::from_secs(1);
/// The working directory when the image names none.
const DEFAULT_WORKDIR: &str = "/workspace";
/// Owner of directories WORKDIR makes: the sandbox user.
const USER_ID: u32 = 1000;
/// Bumped when what a cache key covers changes (v2: the owner).
const CACHE_VERSION: &str = "hutch-build-v2";

/// Whether `name` is an image that a build of template `id` made.
pub fn is_build_image_of(name: &str, id: &str) -> bool {
    name.strip_prefix(id)
        .and_then(|r| r.strip_prefix("-v"))
        .is_some_and(|n| !n.is_empty() && n.len() <= 12 && n.bytes().all(|b| b.is_ascii_digit()))
}

/// A build's id: `bld-` and 16 hex digits.
pub fn parse_build_id(s: &str) -> Result<&str> {
    let ok = s.len() == 20 && s.starts_with("bld-") && s[4..].bytes().all(|b| b.is_ascii_hexdigit());
    if ok && !s[4..].bytes().any(|b| b.is_ascii_uppercase()) {
        Ok(s)
    } else {
        Err(ControlError::NoBuild(crate::ids::truncated(s)))
    }
}

/// Per-template build queues inside [`Control`], and the daemon instance
/// whose build sandboxes these are.
#[derive(Default)]
pub struct Builds {
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    instance: OnceLock<String>,
    /// E2B builds asked for and not yet started, and tag writes.
    e2b: e2b::E2bBuilds,
}

impl Builds {
    fn lock_for(&self, template_id: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut map = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        map.entry(template_id.to_owned()).or_default().clone()
    }

    /// The prefix of this daemon's build sandboxes' ids, `bi-<instance>-`:
    /// see [`instance_tag`].
    fn sandbox_prefix(&self, state_dir: &Path) -> io::Result<String> {
        if let Some(tag) = self.instance.get() {
            return Ok(format!("{BUILD_SANDBOX_PREFIX}{tag}-"));
        }
        let tag = instance_tag(state_dir)?;
        Ok(format!("{BUILD_SANDBOX_PREFIX}{}-", self.instance.get_or_init(|| tag)))
    }
}

/// Length of an instance tag, and of the random part of a build sandbox's
/// id after it: `bi-` 8 + 1 + 7 is 19 bytes, the length of every random
/// sandbox id (the run directory was checked to fit agent sockets of it).
const INSTANCE_TAG_LEN: usize = 8;
const BUILD_SANDBOX_RANDOM_LEN: usize = 7;

/// The tag of the daemon that owns `state_dir` (8 hex digits in
/// `<state>/instance`, made on first use). Daemons on one host share the
/// cgroup tree: a build sandbox's id carries its daemon's tag, and a
/// restarted daemon sweeps only the build sandboxes of its own.
pub fn instance_tag(state_dir: &Path) -> io::Result<String> {
    let path = state_dir.join("instance");
    let valid = |s: &str| s.len() == INSTANCE_TAG_LEN && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
    loop {
        match fs::read_to_string(&path) {
            Ok(s) if valid(s.trim()) => return Ok(s.trim().to_owned()),
            Ok(_) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{}: not an instance tag ({INSTANCE_TAG_LEN} hex digits)", path.display()),
                ))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let tag = hutch_runtime::sys::random_hex(INSTANCE_TAG_LEN / 2);
        let tmp = state_dir.join(format!(".instance.{tag}"));
        fs::write(&tmp, format!("{tag}\n"))?;
        // A link fails if another process made the file first: then read
        // theirs.
        let linked = fs::hard_link(&tmp, &path);
        let _ = fs::remove_file(&tmp);
        match linked {
            Ok(()) => return Ok(tag),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Whether `id` is a build sandbox of the instance whose prefix is
/// `prefix` (as [`Builds::sandbox_prefix`] makes it).
fn is_own_build_sandbox(id: &str, prefix: &str) -> bool {
    id.strip_prefix(prefix).is_some_and(|r| {
        r.len() == BUILD_SANDBOX_RANDOM_LEN && r.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    })
}

/// Whether `id` has the form build sandboxes had before they carried their
/// daemon's instance (`bs-` and 16 hex digits).
fn is_unscoped_build_sandbox(id: &str) -> bool {
    id.strip_prefix(UNSCOPED_BUILD_SANDBOX_PREFIX)
        .is_some_and(|r| r.len() == 16 && r.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
}

/// What a sandbox of an image mounts and runs with.
#[derive(Debug, Clone, Default)]
pub struct ImageRoot {
    /// `base`, or a store image's (or preset's) own layers.
    pub root: RootSource,
    /// Layers a build stacked over `root`, bottom first.
    pub layers: Vec<PathBuf>,
    pub env: Vec<(String, String)>,
    pub workdir: Option<String>,
}

/// The working directory of image `name`, without resolving its layers
/// (nor building a preset).
fn image_workdir(store: &ImageStore, name: &str) -> Option<String> {
    store.get(name).ok().and_then(|i| i.workdir)
}

/// The root of an image that needs nothing read to resolve: `base`, the
/// host's own. A boot takes it without a trip to the blocking pool.
pub fn root_without_disk(name: &str) -> Option<ImageRoot> {
    (name == "base").then(ImageRoot::default)
}

/// Resolves an image name for a boot or a build: `base`, a store image or
/// preset (built here on first use: call it on the blocking pool), or a
/// built image over one of those. `owner` is the key the sandbox is for
/// (`None` on the daemon's host only): a build's image resolves only for
/// its owner, as if no other key's existed.
pub fn image_root(state_dir: &Path, name: &str, owner: Option<&str>) -> Result<ImageRoot> {
    if let Some(root) = root_without_disk(name) {
        return Ok(root);
    }
    let gone = |why: String| ControlError::ImageUnavailable(format!("{name}: {why}"));
    let store = ImageStore::open(state_dir).map_err(|e| gone(e.to_string()))?;
    let img = match store.get(name) {
        Ok(img) => Some(img),
        Err(ImageError::NotFound(_)) => None,
        Err(e) => return Err(gone(e.to_string())),
    };
    if let (Some(img), Some(owner)) = (&img, owner) {
        if !img.is_shared() && img.owner.as_deref() != Some(owner) {
            return Err(ControlError::NoImage(name.to_owned()));
        }
    }
    let Some(img) = img.filter(|i| i.parent.is_some()) else {
        // A store image or a preset: a whole root file system of its own.
        let (root, env) = crate::sandboxes::store_image_root(state_dir, name)?;
        return Ok(ImageRoot { root, env, ..ImageRoot::default() });
    };
    let root = match img.parent.as_deref() {
        Some("base") | None => RootSource::Base,
        Some(parent) => crate::sandboxes::store_image_root(state_dir, parent)?.0,
    };
    let layers = store.layer_dirs(&img).map_err(|e| gone(e.to_string()))?;
    // A build's env began as its parent's: it holds both.
    Ok(ImageRoot { root, layers, env: img.env_pairs(), workdir: img.workdir })
}

/// The validated build context: the archive, its plan, and each regular
/// file's SHA-256.
struct Context {
    bytes: Vec<u8>,
    plan: ArchivePlan,
    digests: BTreeMap<String, String>,
}

impl Context {
    fn new(bytes: Vec<u8>) -> Result<(Context, String)> {
        let plan = archive::validate(&bytes).map_err(context_error)?;
        let mut digests = BTreeMap::new();
        let mut hashers: Vec<Sha256> = plan.files_in_order.iter().map(|_| Sha256::new()).collect();
        let dockerfile_index = plan.files_in_order.iter().position(|p| p == "Dockerfile");
        let mut dockerfile = Vec::new();
        archive::stream_files(&bytes, &plan, 64 * 1024, |i, chunk| {
            if Some(i) == dockerfile_index && dockerfile.len() <= dockerfile::MAX_DOCKERFILE {
                dockerfile.extend_from_slice(&chunk);
            }
            if let Some(h) = hashers.get_mut(i) {
                h.update(&chunk);
            }
            true
        })
        .map_err(context_error)?;
        for (path, h) in plan.files_in_order.iter().zip(hashers) {
            digests.insert(path.clone(), hex::encode(h.finalize()));
        }
        if dockerfile_index.is_none() {
            return Err(ControlError::Files(crate::files::FilesError::new(
                ErrorCode::SandboxArchiveInvalid,
                "the build context has no Dockerfile at its top",
            )));
        }
        let text = String::from_utf8(dockerfile)
            .map_err(|_| ControlError::BuildRefused { line: 1, message: "the Dockerfile is not UTF-8".into() })?;
        Ok((Context { bytes, plan, digests }, text))
    }

    fn kind(&self, path: &str) -> Option<PlannedKind> {
        if path.is_empty() {
            return Some(PlannedKind::Dir);
        }
        self.plan.entries.iter().find(|e| e.path == path).map(|e| e.kind)
    }

    /// Entries at or below `src` ("" is the root), with their paths
    /// relative to `src`.
    fn below<'a>(&'a self, src: &'a str) -> impl Iterator<Item = (&'a archive::PlannedEntry, &'a str)> + 'a {
        self.plan.entries.iter().filter_map(move |e| {
            if src.is_empty() {
                Some((e, e.path.as_str()))
            } else {
                e.path.strip_prefix(src).and_then(|r| r.strip_prefix('/')).map(|r| (e, r))
            }
        })
    }
}

fn context_error(e: ArchiveError) -> ControlError {
    let (code, message) = match e {
        ArchiveError::Invalid(m) => (ErrorCode::SandboxArchiveInvalid, format!("build context refused: {m}")),
        ArchiveError::TooLarge(m) => (ErrorCode::SandboxArchiveTooLarge, format!("build context too large: {m}")),
    };
    ControlError::Files(crate::files::FilesError::new(code, message))
}

/// A step ready to run: its instruction resolved against the WORKDIR.
#[derive(Debug, Clone)]
enum Action {
    Run(Command),
    /// (layer-relative destination, context path) of files and directories.
    Copy {
        files: Vec<(String, String)>,
        dirs: Vec<(String, u32)>,
        chown: (u32, u32),
        chmod: Option<u32>,
    },
    Env(Vec<(String, String)>),
    Workdir(String),
    User(String),
    Cmd(Command),
}

#[derive(Debug, Clone)]
struct Planned {
    step: Step,
    action: Action,
    /// The WORKDIR in effect for this step.
    cwd: String,
    /// The USER in effect for this step (`root` until one says otherwise).
    user: String,
    /// Digest of what a COPY copies (names, modes, contents).
    inputs: String,
}

fn refused(line: usize, message: impl Into<String>) -> ControlError {
    ControlError::BuildRefused { line, message: message.into() }
}

/// Resolves every step before anything runs; a problem refuses the build.
fn plan_steps(steps: Vec<Step>, ctx: &Context, workdir: &str) -> Result<Vec<Planned>> {
    let mut cwd = workdir.to_owned();
    let mut user = String::from("root");
    let mut out = Vec::new();
    for step in steps {
        let line = step.line;
        let mut inputs = String::new();
        let action = match &step.instruction {
            Instruction::Run(c) => Action::Run(c.clone()),
            Instruction::Cmd(c) => Action::Cmd(c.clone()),
            Instruction::Env(pairs) => Action::Env(pairs.clone()),
            Instruction::User(u) => {
                user = u.clone();
                Action::User(u.clone())
            }
            Instruction::Workdir(dir) => {
                cwd = dockerfile::resolve_workdir(line, &cwd, dir)
                    .map_err(|r| ControlError::BuildRefused { line: r.line, message: r.message })?;
                Action::Workdir(cwd.clone())
            }
            Instruction::Copy { sources, dest, chown, chmod } => {
                let abs = dockerfile::absolute(&cwd, dest)
                    .ok_or_else(|| refused(line, format!("COPY destination {dest:?} is not a path")))?;
                let into_dir = dest.ends_with('/') || sources.len() > 1;
                let base = abs.trim_start_matches('/').to_owned();
                let (mut files, mut dirs) = (Vec::new(), Vec::new());
                let mut h = Sha256::new();
                for src in sources {
                    match ctx.kind(src) {
                        None => return Err(refused(line, format!("COPY {src:?}: not in the build context"))),
                        Some(PlannedKind::File(_)) => {
                            let name = src.rsplit('/').next().unwrap_or(src);
                            let target = if into_dir { join(&base, name) } else { base.clone() };
                            if target.is_empty() {
                                return Err(refused(line, "COPY cannot replace the root directory with a file"));
                            }
                            h.update(format!("f {target} {src} {}\n", ctx.digests.get(src.as_str()).map_or("", |d| d)));
                            files.push((target, src.clone()));
                        }
                        Some(PlannedKind::Dir) => {
                            for (e, rel) in ctx.below(src) {
                                let target = join(&base, rel);
                                match e.kind {
                                    PlannedKind::Dir => {
                                        h.update(format!("d {target} {:o}\n", e.mode));
                                        dirs.push((target, e.mode));
                                    }
                                    PlannedKind::File(_) => {
                                        let digest = ctx.digests.get(&e.path).map_or("", |d| d);
                                        h.update(format!("f {target} {:o} {digest}\n", e.mode));
                                        files.push((target, e.path.clone()));
                                    }
                                }
                            }
                        }
                    }
                }
                inputs = hex::encode(h.finalize());
                Action::Copy { files, dirs, chown: chown.unwrap_or((0, 0)), chmod: *chmod }
            }
        };
        out.push(Planned { step, action, cwd: cwd.clone(), user: user.clone(), inputs });
    }
    Ok(out)
}

fn join(base: &str, rel: &str) -> String {
    match (base.is_empty(), rel.is_empty()) {
        (true, _) => rel.to_owned(),
        (_, true) => base.to_owned(),
        _ => format!("{base}/{rel}"),
    }
}

/// The first key of a build's chain: its owner (a step is never cached
/// across owners), its parent image and the template's environment.
fn first_cache_key(owner: &str, parent: &str, env: &str) -> String {
    let mut h = Sha256::new();
    for part in [CACHE_VERSION, "owner", owner, parent, env] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    hex::encode(h.finalize())
}

/// A step's key: the key before it, the instruction and its inputs.
fn cache_key(before: &str, text: &str, inputs: &str) -> String {
    let mut h = Sha256::new();
    for part in [CACHE_VERSION, before, text, inputs] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part.as_bytes());
    }
    hex::encode(h.finalize())
}

/// A build's log file, bounded: output past [`LOG_CAP`] is dropped with a
/// note; step headers and the outcome still fit in the slack after it.
struct Log {
    file: File,
    written: u64,
    truncated: bool,
}

impl Log {
    fn create(path: &Path) -> io::Result<Log> {
        let file = fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
        Ok(Log { file, written: 0, truncated: false })
    }

    fn put(&mut self, bytes: &[u8]) {
        if self.file.write_all(bytes).is_ok() {
            self.written += bytes.len() as u64;
        }
    }

    fn output(&mut self, bytes: &[u8]) {
        if self.truncated {
            return;
        }
        if self.written + bytes.len() as u64 <= LOG_CAP {
            self.put(bytes);
        } else {
            self.truncated = true;
            self.put(format!("\n[log truncated: output past {} MiB is dropped]\n", LOG_CAP >> 20).as_bytes());
        }
    }

    fn line(&mut self, text: &str) {
        if self.written + (text.len() as u64) < LOG_CAP + LOG_SLACK {
            self.put(format!("{text}\n").as_bytes());
        }
    }
}

fn view(b: &BuildRecord) -> Build {
    Build {
        id: b.id.clone(),
        template_id: b.template_id.clone(),
        state: b.state,
        created_at: rfc3339(b.created_at),
        finished_at: b.finished_at.map(rfc3339),
        error: b.error.clone(),
        version: b.version.map(|v| v as u64),
    }
}

/// Why a build failed, for its record (the log says more).
type Failure = String;

/// What a build takes besides its context (the E2B API's builds).
#[derive(Debug, Clone, Default)]
pub struct BuildOptions {
    /// The build's id (`bld-` and 16 hex digits), chosen before it starts.
    pub id: Option<String>,
    /// The image it starts from instead of the template's own: `base`, a
    /// shared image, or one of the owner's builds.
    pub parent: Option<String>,
    /// The template's readiness check from this build on (its result is
    /// checked with it).
    pub readiness: Option<Readiness>,
    /// Pulled (reference, registry allowed) into `parent` before the steps,
    /// as the build's owner's own image.
    pub pull: Option<String>,
    /// The first step (0-based) that runs even when cached (E2B's
    /// `skip_cache`): it and every step after it.
    pub no_cache_from: Option<usize>,
}

/// What a build carries to its task besides its steps.
struct Extra {
    readiness: Option<Readiness>,
    pull: Option<String>,
    no_cache_from: Option<usize>,
}

impl Control {
    fn state_dir(&self) -> PathBuf {
        self.runtime.config().state_dir.clone()
    }

    fn log_path(&self, build_id: &str) -> Result<PathBuf> {
        Ok(self.images()?.build_log(build_id))
    }

    /// Checks a build context and its Dockerfile, records the build
    /// (`queued`) and starts it in the background.
    pub async fn start_build(self: &Arc<Self>, caller: &Caller, id: &TemplateId, context: Vec<u8>) -> Result<Build> {
        self.start_build_with(caller, id, context, BuildOptions::default()).await
    }

    /// [`Control::start_build`] with [`BuildOptions`].
    pub async fn start_build_with(
        self: &Arc<Self>,
        caller: &Caller,
        id: &TemplateId,
        context: Vec<u8>,
        opts: BuildOptions,
    ) -> Result<Build> {
        if self.is_shutting_down() {
            return Err(ControlError::ShuttingDown);
        }
        let t = self.template_of(caller, id).await?;
        if !caller.may_use(&t.owner) {
            return Err(ControlError::Forbidden("only a template's owner may build it".into()));
        }
        let owner = caller.owner.as_str();
        let store = self.images()?;
        let (ctx, text) = Context::new(context)?;
        let steps =
            dockerfile::parse(&text).map_err(|r| ControlError::BuildRefused { line: r.line, message: r.message })?;
        let parent = match opts.parent.clone() {
            Some(p) => p,
            None => self.build_parent(&store, &t)?,
        };
        let workdir = image_workdir(&store, &parent).unwrap_or_else(|| DEFAULT_WORKDIR.into());
        let planned = plan_steps(steps, &ctx, &workdir)?;
        let build_id = match opts.id.clone() {
            Some(b) => parse_build_id(&b)?.to_owned(),
            None => {
                let rid = hutch_runtime::container::random_id().map_err(|e| ControlError::Runtime(e.to_string()))?;
                format!("bld-{}", rid.trim_start_matches("sb-"))
            }
        };
        let record = BuildRecord {
            id: build_id,
            template_id: t.id.clone(),
            owner: owner.to_owned(),
            state: BuildState::Queued,
            created_at: now_ms(),
            finished_at: None,
            error: None,
            parent,
            image: None,
            version: None,
            node: self.node.name.clone(),
        };
        let log = Log::create(&store.build_log(&record.id))
            .map_err(|e| ControlError::Runtime(format!("build log {}: {e}", record.id)))?;
        let quotas = self.caller_quotas(caller).await?;
        let rec = record.clone();
        if !self.db(move |s| s.insert_build(&rec, quotas.builds)).await? {
            let limit = quotas.builds.unwrap_or(0);
            return Err(self.refused(
                caller.owner.as_str(),
                hutch_store::Exceeded {
                    scope: hutch_store::Scope::Owner,
                    resource: hutch_store::Resource::Builds,
                    limit,
                    used: limit,
                    asked: 1,
                },
            ));
        }
        let this = self.clone();
        let answer = view(&record);
        let extra = Extra { readiness: opts.readiness, pull: opts.pull, no_cache_from: opts.no_cache_from };
        tokio::spawn(async move { this.run_build(record, ctx, planned, log, extra).await });
        Ok(answer)
    }

    /// The image a build of `t` starts from: the parent of the template's
    /// current built image, else its image.
    fn build_parent(&self, store: &ImageStore, t: &TemplateRecord) -> Result<String> {
        if is_build_image_of(&t.image, &t.id) {
            let img = match store.get(&t.image) {
                Ok(img) => Some(img),
                Err(ImageError::NotFound(_)) => None,
                Err(e) => return Err(ControlError::Runtime(format!("image {}: {e}", t.image))),
            };
            return Ok(img.and_then(|i| i.parent).unwrap_or_else(|| "base".into()));
        }
        Ok(t.image.clone())
    }

    pub async fn list_builds(&self, caller: &Caller, id: &TemplateId) -> Result<BuildList> {
        let t = self.template_of(caller, id).await?;
        let tid = t.id.clone();
        Ok(BuildList { builds: self.db(move |s| s.list_builds(&tid)).await?.iter().map(view).collect() })
    }

    /// A build of a template the caller may see (its own; any, for an admin).
    async fn build_of(&self, caller: &Caller, id: &TemplateId, build: &str) -> Result<BuildRecord> {
        let t = self.template_of(caller, id).await?;
        let build = parse_build_id(build)?.to_owned();
        let bid = build.clone();
        match self.db(move |s| s.get_build(&bid)).await? {
            Some(b) if b.template_id == t.id && b.owner == t.owner => Ok(b),
            _ => Err(ControlError::NoBuild(build)),
        }
    }

    pub async fn get_build(&self, caller: &Caller, id: &TemplateId, build: &str) -> Result<Build> {
        Ok(view(&self.build_of(caller, id, build).await?))
    }

    /// A build's log as it is now, or (`follow`) a stream of it that ends
    /// when the build does.
    pub async fn build_log(
        self: &Arc<Self>,
        caller: &Caller,
        id: &TemplateId,
        build: &str,
        follow: bool,
    ) -> Result<tokio::sync::mpsc::Receiver<io::Result<Vec<u8>>>> {
        let b = self.build_of(caller, id, build).await?;
        let path = self.log_path(&b.id)?;
        let (tx, rx) = tokio::sync::mpsc::channel(8);
        let this = self.clone();
        tokio::spawn(async move {
            let mut offset = 0u64;
            let deadline = tokio::time::Instant::now() + Duration::from_secs(6 * 3600);
            loop {
                let bid = b.id.clone();
                let finished = !follow
                    || this
                        .db(move |s| s.get_build(&bid))
                        .await
                        .ok()
                        .flatten()
                        .is_none_or(|r| matches!(r.state, BuildState::Succeeded | BuildState::Failed));
                // Read everything written so far (after the state, so that a
                // finished build's last lines are in).
                loop {
                    let chunk = read_from(&path, offset);
                    match chunk {
                        Ok(c) if c.is_empty() => break,
                        Ok(c) => {
                            offset += c.len() as u64;
                            if tx.send(Ok(c)).await.is_err() {
                                return;
                            }
                        }
                        Err(e) => {
                            let _ = tx.send(Err(e)).await;
                            return;
                        }
                    }
                }
                if finished || tokio::time::Instant::now() >= deadline {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        Ok(rx)
    }

    /// Marks builds a stopped daemon left unfinished as failed, and removes
    /// their sandboxes, scratch layers and half-made layers: only this
    /// daemon's (its node's builds; its instance's build sandboxes; its
    /// own state directory).
    /// Brings a store of an earlier version up to date: drops the step
    /// cache entries that were keyed without their owner and names the
    /// owner of each build's image.
    pub(crate) fn recover_builds(&self) -> Result<()> {
        // Only this node's: other nodes' builds run on.
        let error = "interrupted: the daemon stopped during the build";
        let n = self.store.fail_unfinished_builds(&self.node.name, now_ms(), error)?;
        if n > 0 {
            tracing::warn!("{n} template builds were interrupted by a daemon restart; marked failed");
        }
        let prefix = self
            .builds
            .sandbox_prefix(&self.state_dir())
            .map_err(|e| ControlError::Runtime(format!("daemon instance tag: {e}")))?;
        for id in self.runtime.cgroups() {
            // Another daemon's build sandboxes have its tag. One of an
            // earlier version (no tag) is ours if our run dir has its socket.
            let ours = is_own_build_sandbox(&id, &prefix)
                || (is_unscoped_build_sandbox(&id) && self.runtime.socket_path(&id).exists());
            if ours {
                if let Err(e) = self.runtime.adopt(&id).destroy() {
                    tracing::warn!("build sandbox {id} left by the last daemon: {e}");
                }
            }
        }
        let store = self.images()?;
        store.sweep_builds();
        match store.drop_unowned_cache() {
            Ok(0) => {}
            Ok(n) => tracing::info!("build cache: dropped {n} entries of an earlier version (not keyed by owner)"),
            Err(e) => return Err(ControlError::Runtime(format!("build cache: {e}"))),
        }
        self.name_build_image_owners(&store)
    }

    /// Images of builds made before images named their owner get the owner
    /// of the template that made them; one whose template is gone stays
    /// no one's (only the admin sees it).
    fn name_build_image_owners(&self, store: &ImageStore) -> Result<()> {
        for mut img in store.list() {
            if img.parent.is_none() || img.owner.is_some() {
                continue;
            }
            let template = img.name.rsplit_once("-v").map(|(id, _)| id.to_owned());
            let Some(t) = template.and_then(|id| self.store.get_template(&id).ok().flatten()) else { continue };
            if !is_build_image_of(&img.name, &t.id) {
                continue;
            }
            img.owner = Some(t.owner.clone());
            if let Err(e) = store.put(&img) {
                tracing::warn!("image {}: cannot record its owner: {e}", img.name);
            }
        }
        Ok(())
    }

    async fn run_build(
        self: Arc<Self>,
        mut rec: BuildRecord,
        ctx: Context,
        planned: Vec<Planned>,
        mut log: Log,
        extra: Extra,
    ) {
        let queue = self.builds.lock_for(&rec.template_id);
        let _turn = queue.lock().await;
        rec.state = BuildState::Building;
        let r = rec.clone();
        match self.db(move |s| s.update_build(&r, &[BuildState::Queued])).await {
            Ok(true) => self.emit_build(&rec, crate::events::Kind::TemplateBuildStarted),
            Ok(false) => {}
            Err(e) => tracing::warn!("build {}: cannot record its state: {e}", rec.id),
        }
        let outcome = self.build(&rec, Arc::new(ctx), &planned, &mut log, extra).await;
        rec.finished_at = Some(now_ms());
        match outcome {
            Ok((image, version)) => {
                // Pushed before it says it succeeded, so that every node
                // may start its sandboxes as soon as it has (see `moves`).
                match self.push_build(&rec.id, &rec.owner, &image).await {
                    Ok(Some(reference)) => log.line(&format!("Pushed to the fleet's registry as {reference}")),
                    Ok(None) if self.registry.is_some() => {
                        log.line("Not pushed to the fleet's registry: built over `base` (the host's own files)")
                    }
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(
                            "build {}: its push failed (its sandboxes start on this node only): {e}",
                            rec.id
                        );
                        log.line(&format!(
                            "Pushing to the fleet's registry failed: its sandboxes start on this node only: {e}"
                        ));
                    }
                }
                log.line(&format!("Build succeeded: image {image}, template version {version}"));
                rec.state = BuildState::Succeeded;
                rec.image = Some(image);
                rec.version = Some(version);
            }
            Err(why) => {
                log.line(&format!("Build failed: {why}"));
                rec.state = BuildState::Failed;
                rec.error = Some(why);
            }
        }
        let r = rec.clone();
        match self.db(move |s| s.update_build(&r, &[BuildState::Building])).await {
            Ok(false) => {}
            Ok(true) => {
                let kind = if rec.state == BuildState::Succeeded {
                    crate::events::Kind::TemplateBuildSucceeded
                } else {
                    crate::events::Kind::TemplateBuildFailed
                };
                self.emit_build(&rec, kind);
            }
            Err(e) => tracing::warn!("build {}: cannot record its outcome: {e}", rec.id),
        }
    }

    /// Runs the steps, checks the result and activates it: (image, version).
    async fn build(
        self: &Arc<Self>,
        rec: &BuildRecord,
        ctx: Arc<Context>,
        planned: &[Planned],
        log: &mut Log,
        Extra { readiness: new_readiness, pull, no_cache_from }: Extra,
    ) -> std::result::Result<(String, i64), Failure> {
        let state = self.state_dir();
        if let Some(reference) = pull {
            log.line(&format!("Pulling {reference}"));
            let (st, name, owner) = (state.clone(), rec.parent.clone(), rec.owner.clone());
            let pulled = blocking(move || pull_owned(&st, &reference, &name, &owner)).await;
            match pulled {
                Ok(layers) => log.line(&format!("---> image {} ({layers} layers)", rec.parent)),
                Err(why) => {
                    log.line(&format!("---> failed: {why}"));
                    return Err(format!("pulling the image failed: {why}"));
                }
            }
        }
        let t = self
            .store
            .get_template(&rec.template_id)
            .map_err(|e| format!("store: {e}"))?
            .filter(|t| t.deleted_at.is_none())
            .ok_or("the template was deleted")?;
        let store = ImageStore::open(&state).map_err(|e| format!("image store: {e}"))?;
        let (st, name, owner) = (state.clone(), rec.parent.clone(), rec.owner.clone());
        let parent = blocking(move || image_root(&st, &name, Some(&owner)).map_err(|e| e.to_string())).await?;
        let tpl_env: BTreeMap<String, String> = serde_json::from_str(&t.env).unwrap_or_default();
        let mut env: Vec<(String, String)> = parent.env.clone();
        let mut layers: Vec<String> = Vec::new();
        let mut cmd: Option<Command> = None;
        // The last USER: who runs the startup command.
        let mut startup_user: Option<String> = None;
        // The parent's layers too: a name pulled again (or a store image
        // made again) may hold other files.
        let parent_key = match store.get(&rec.parent) {
            Ok(img) => format!("{}@{}", rec.parent, img.layers.join(",")),
            Err(_) => rec.parent.clone(),
        };
        let mut key = first_cache_key(&rec.owner, &parent_key, &serde_json::to_string(&tpl_env).unwrap_or_default());
        let total = planned.len();
        let mut workdir = parent.workdir.clone().unwrap_or_else(|| DEFAULT_WORKDIR.into());
        for (i, p) in planned.iter().enumerate() {
            let n = i + 1;
            log.line(&format!("Step {n}/{total}: {}", p.step.text));
            key = cache_key(&key, &p.step.text, &p.inputs);
            match &p.action {
                Action::Env(pairs) => {
                    for (k, v) in pairs {
                        env.retain(|(ek, _)| ek != k);
                        env.push((k.clone(), v.clone()));
                    }
                    continue;
                }
                Action::Cmd(c) => {
                    cmd = Some(c.clone());
                    continue;
                }
                Action::User(u) => {
                    startup_user = Some(u.clone());
                    continue;
                }
                Action::Workdir(dir) => workdir = dir.clone(),
                Action::Run(_) | Action::Copy { .. } => {}
            }
            let cached = if no_cache_from.is_some_and(|f| i >= f) { None } else { store.cached_step(&rec.owner, &key) };
            if let Some(hex) = cached {
                log.line(&format!("---> cached {}", &hex[..12]));
                layers.push(hex);
                continue;
            }
            let made = match &p.action {
                Action::Run(c) => {
                    let mut step_env: Vec<(String, String)> = tpl_env.clone().into_iter().collect();
                    for (k, v) in &env {
                        step_env.retain(|(ek, _)| ek != k);
                        step_env.push((k.clone(), v.clone()));
                    }
                    self.run_step(&store, &t, &parent, &layers, step_env, (&p.cwd, &p.user), c, log).await
                }
                Action::Copy { files, dirs, chown, chmod } => {
                    let (st, owner, ctx, files, dirs) =
                        (store.clone(), t.owner.clone(), ctx.clone(), files.clone(), dirs.clone());
                    let (chown, chmod) = (*chown, *chmod);
                    blocking(move || copy_layer(&st, &owner, &ctx, &files, &dirs, chown, chmod)).await
                }
                Action::Workdir(dir) => {
                    let (st, dir, owner) = (store.clone(), dir.clone(), t.owner.clone());
                    let leaf = if p.user == "root" { 0 } else { USER_ID };
                    blocking(move || workdir_layer(&st, &owner, &dir, leaf)).await
                }
                Action::Env(_) | Action::Cmd(_) | Action::User(_) => continue,
            };
            match made {
                Ok(hex) => {
                    if let Err(e) = store.remember_step(&rec.owner, &key, &hex) {
                        tracing::warn!("build cache: {e}");
                    }
                    log.line(&format!("---> layer {}", &hex[..12]));
                    layers.push(hex);
                }
                Err(why) => {
                    log.line(&format!("---> failed: {why}"));
                    return Err(format!("step {n}/{total} ({}) failed: {why}", short(&p.step.text)));
                }
            }
        }
        // Check the result as its sandboxes will run it.
        let startup = cmd
            .as_ref()
            .map(|c| Startup { command: c.to_shell(), user: startup_user.clone() })
            .or_else(|| t.startup.as_deref().and_then(|s| serde_json::from_str(s).ok()));
        let readiness: Option<Readiness> =
            new_readiness.clone().or_else(|| t.readiness.as_deref().and_then(|s| serde_json::from_str(s).ok()));
        log.line("Validating: starting a sandbox from the result");
        let all_layers: Vec<PathBuf> =
            once_each(parent.layers.iter().cloned().chain(layers.iter().map(|h| store.layer_dir(h))).collect());
        let mut sandbox_env: Vec<(String, String)> = env.clone();
        for (k, v) in &tpl_env {
            sandbox_env.retain(|(ek, _)| ek != k);
            sandbox_env.push((k.clone(), v.clone()));
        }
        let spec =
            self.build_spec(&t, parent.root.clone(), all_layers, sandbox_env, hutch_runtime::Writable::Memory)?;
        let rt = self.runtime.clone();
        let net = self.network.clone().ok();
        let (n1, group) = (net.clone(), format!("{}/{}", t.owner, t.id));
        let sb = blocking(move || {
            start_build_sandbox(&rt, spec, n1.as_deref(), &group).map_err(|e| format!("the result does not start: {e}"))
        })
        .await?;
        let timeout =
            readiness.as_ref().and_then(|r| r.timeout_seconds).unwrap_or(VALIDATE_TIMEOUT).min(VALIDATE_TIMEOUT);
        let check = ReadyCheck {
            startup: startup.as_ref(),
            readiness: readiness.as_ref(),
            cwd: Some(workdir.clone()),
            timeout: Duration::from_secs(u64::from(timeout)),
            grace: if startup.is_some() && readiness.is_none() { STARTUP_GRACE } else { Duration::ZERO },
        };
        let ready = until_ready(&sb.socket, &check, |out| log.output(out), || true).await;
        let destroyed = blocking(move || end_build_sandbox(sb, net.as_deref())).await;
        match ready {
            Ok(()) => log.line("---> ready"),
            Err(e) => {
                log.line(&format!("---> not ready: {}", e.message()));
                return Err(format!("validation failed: {}", e.message()));
            }
        }
        if let Err(e) = destroyed {
            tracing::warn!("build {}: validation sandbox teardown: {e}", rec.id);
        }
        // It writes the image and the template's record: on the blocking pool.
        let (this, rec) = (self.clone(), rec.clone());
        let startup = cmd.as_ref().map(|c| Startup { command: c.to_shell(), user: startup_user });
        blocking(move || {
            this.activate(
                &store,
                &rec,
                &layers,
                &env,
                (cmd.as_ref(), startup.as_ref()),
                &workdir,
                new_readiness.as_ref(),
            )
        })
        .await
    }

    /// Writes the image and makes it the template's next version.
    #[allow(clippy::too_many_arguments)]
    fn activate(
        &self,
        store: &ImageStore,
        rec: &BuildRecord,
        layers: &[String],
        env: &[(String, String)],
        (cmd, startup): (Option<&Command>, Option<&Startup>),
        workdir: &str,
        readiness: Option<&Readiness>,
    ) -> std::result::Result<(String, i64), Failure> {
        let mut t = self
            .store
            .get_template(&rec.template_id)
            .map_err(|e| format!("store: {e}"))?
            .filter(|t| t.deleted_at.is_none())
            .ok_or("the template was deleted during the build")?;
        let version = t.version + 1;
        let name = format!("{}-v{version}", t.id);
        // A build over another build (E2B's `from_template`) holds that
        // build's layers under its own, over that build's parent: an image
        // names a whole root or one image's layers, never a chain.
        let (parent, layers) = match store.get(&rec.parent) {
            Ok(Image { parent: Some(p), layers: below, .. }) => {
                (p, below.iter().chain(layers.iter()).cloned().collect::<Vec<_>>())
            }
            _ => (rec.parent.clone(), layers.to_vec()),
        };
        let layers = once_each(layers);
        let image = Image {
            name: name.clone(),
            layers,
            env: env.iter().map(|(k, v)| format!("{k}={v}")).collect(),
            cmd: match cmd {
                Some(Command::Exec(argv)) => argv.clone(),
                Some(Command::Shell(s)) => vec!["/bin/sh".into(), "-c".into(), s.clone()],
                None => Vec::new(),
            },
            workdir: Some(workdir.to_owned()),
            source: format!("build {} of template {}", rec.id, t.id),
            created_at: (now_ms() / 1000) as u64,
            parent: Some(parent),
            owner: Some(rec.owner.clone()),
        };
        store.put(&image).map_err(|e| format!("cannot write image {name}: {e}"))?;
        t.image = name.clone();
        if let Some(s) = startup {
            t.startup = serde_json::to_string(s).ok();
        }
        if let Some(r) = readiness {
            t.readiness = serde_json::to_string(r).ok();
        }
        t.version = version;
        let read_at = t.updated_at;
        t.updated_at = now_ms().max(read_at + 1);
        if !self.store.update_template(&t, read_at).map_err(|e| format!("store: {e}"))? {
            return Err("the template was changed or deleted during the build; build again".into());
        }
        Ok((name, version))
    }

    /// Runs one RUN step in a build sandbox and captures its layer.
    #[allow(clippy::too_many_arguments)]
    async fn run_step(
        &self,
        store: &ImageStore,
        t: &TemplateRecord,
        parent: &ImageRoot,
        layers: &[String],
        env: Vec<(String, String)>,
        (cwd, user): (&str, &str),
        cmd: &Command,
        log: &mut Log,
    ) -> std::result::Result<String, Failure> {
        let lowers: Vec<PathBuf> =
            once_each(parent.layers.iter().cloned().chain(layers.iter().map(|h| store.layer_dir(h))).collect());
        let scratch_dir = store.scratch_dir();
        let disk = t.disk_mib << 20;
        let spec = self.build_spec(
            t,
            parent.root.clone(),
            lowers,
            env,
            hutch_runtime::Writable::HostDir(scratch_dir.clone()),
        )?;
        let rt = self.runtime.clone();
        let net = self.network.clone().ok();
        let (n1, group) = (net.clone(), format!("{}/{}", t.owner, t.id));
        let (scratch, sb) = blocking(move || {
            let scratch = Scratch::create(&scratch_dir, disk).map_err(|e| format!("scratch layer: {e}"))?;
            let sb = start_build_sandbox(&rt, spec, n1.as_deref(), &group)
                .map_err(|e| format!("the build sandbox did not start: {e}"))?;
            Ok((scratch, sb))
        })
        .await?;
        let spawn = Spawn {
            cmd: match cmd {
                Command::Shell(s) => Cmd::Argv(vec!["/bin/sh".into(), "-c".into(), s.clone()]),
                Command::Exec(argv) => Cmd::Argv(argv.clone()),
            },
            env: Vec::new(),
            cwd: Some(cwd.to_owned()),
            user: Some(user.to_owned()),
            stdin: false,
            pty: None,
            tag: None,
            timeout_ms: Some(STEP_TIMEOUT.as_millis() as u64),
            subscribe: true,
            output_limit: None,
        };
        let status = run_logged(&sb.socket, spawn, log).await;
        let id_base = sb.id_base().ok_or("the build sandbox lost its uid range")?;
        let (st, owner) = (store.clone(), t.owner.clone());
        blocking(move || {
            end_build_sandbox(sb, net.as_deref()).map_err(|e| format!("build sandbox teardown: {e}"))?;
            let status = status?;
            if status.code != Some(0) || status.timed_out {
                return Err(describe_exit(&status));
            }
            let tmp = st.build_temp_path("layer");
            let captured = capture(&scratch.upper(), &tmp, id_base, CaptureLimits::default())
                .map_err(|e| format!("the step's layer was refused: {e}"));
            drop(scratch);
            match captured {
                Ok(_) => st.commit_layer(&tmp, LayerScope::Owner(&owner)).map_err(|e| format!("commit layer: {e}")),
                Err(e) => {
                    let _ = fs::remove_dir_all(&tmp);
                    Err(e)
                }
            }
        })
        .await
    }
}

/// Pulls `reference` as image `name`, the image of `owner` alone (a pull
/// records an image as shared; it is made the owner's at once). Answers
/// its number of layers.
fn pull_owned(state: &Path, reference: &str, name: &str, owner: &str) -> std::result::Result<usize, Failure> {
    use hutch_runtime::image::registry;
    let store = ImageStore::open(state).map_err(|e| format!("image store: {e}"))?;
    let opts = registry::PullOptions {
        insecure: false,
        name: Some(name.to_owned()),
        limits: hutch_runtime::image::Limits::default(),
    };
    let mut img = registry::pull(&store, reference, &opts).map_err(|e| e.to_string())?;
    img.owner = Some(owner.to_owned());
    store.put(&img).map_err(|e| format!("image {name}: {e}"))?;
    Ok(img.layers.len())
}

/// Layers (bottom first) with each kept once, at its topmost place: a
/// layer made twice (the same content, so the same id: two equal steps, or
/// a build over a template that made it too) would stack one directory
/// twice, which overlayfs refuses (ELOOP). Dropping the lower copy changes
/// nothing: the upper one sets the same files over whatever lay between.
fn once_each<T: PartialEq + Clone>(layers: Vec<T>) -> Vec<T> {
    let mut out: Vec<T> = Vec::with_capacity(layers.len());
    for (i, l) in layers.iter().enumerate() {
        if !layers[i + 1..].contains(l) {
            out.push(l.clone());
        }
    }
    out
}

fn short(text: &str) -> String {
    let mut s: String = text.chars().take(60).collect();
    if s.len() < text.len() {
        s.push_str("...");
    }
    s
}

/// Prefix of build sandboxes' ids: they have no sandbox record; their id
/// carries their daemon's instance ([`instance_tag`]), and a restarted
/// daemon destroys the ones of its instance that it finds.
/// (Not `bs-`, the prefix of earlier versions, whose daemons destroy every
/// `bs-*` they find when they start: a host that runs an old daemon beside
/// a new one must not lose the new one's builds to it.)
const BUILD_SANDBOX_PREFIX: &str = "bi-";
/// Build sandboxes of earlier versions: `bs-` and 16 hex digits.
const UNSCOPED_BUILD_SANDBOX_PREFIX: &str = "bs-";

impl Control {
    /// A sandbox for a build step or check: the template's limits. Not tied to
    /// the daemon by a parent-death signal (that fires when the blocking-pool
    /// thread that started it exits); a restart destroys leftovers by prefix.
    fn build_spec(
        &self,
        t: &TemplateRecord,
        root: RootSource,
        extra_lowers: Vec<PathBuf>,
        env: Vec<(String, String)>,
        writable: hutch_runtime::Writable,
    ) -> std::result::Result<SandboxSpec, Failure> {
        let prefix = self.builds.sandbox_prefix(&self.state_dir()).map_err(|e| format!("daemon instance tag: {e}"))?;
        let random = hutch_runtime::sys::random_hex(BUILD_SANDBOX_RANDOM_LEN.div_ceil(2));
        Ok(SandboxSpec {
            class: hutch_runtime::Class::Container,
            id: Some(format!("{prefix}{}", &random[..BUILD_SANDBOX_RANDOM_LEN])),
            limits: CgLimits {
                memory_bytes: t.memory_mb << 20,
                pids: t.pids,
                cpu_millis: (t.vcpus * 1000.0).round() as u32,
            },
            disk_bytes: t.disk_mib << 20,
            env,
            die_with_parent: false,
            agent_override: None,
            extra_lowers,
            writable,
            root,
            netns: None,
            resolv_conf: None,
            ca_bundle: None,
            volumes: Vec::new(),
        })
    }
}

/// Starts a build sandbox with the default egress when the host has sandbox
/// networking (a RUN step that installs packages needs it), none otherwise.
/// The network is released by [`end_build_sandbox`].
fn start_build_sandbox(
    rt: &hutch_runtime::Runtime,
    mut spec: SandboxSpec,
    net: Option<&hutch_runtime::net::Network>,
    group: &str,
) -> std::result::Result<hutch_runtime::Sandbox, String> {
    let Some(net) = net else { return rt.start(&spec).map_err(|e| e.to_string()) };
    let id = spec.id.clone().unwrap_or_default();
    let policy = hutch_runtime::net::Policy {
        egress: hutch_runtime::net::Egress::Default,
        allow: Vec::new(),
        deny: Vec::new(),
        group: group.to_owned(),
        inject: false,
    };
    let attached = net.attach(&id, &policy).map_err(|e| format!("network: {e}"))?;
    spec.netns = attached.netns;
    spec.resolv_conf = Some(net.resolv_conf().to_path_buf());
    rt.start(&spec).map_err(|e| {
        net.release(&id);
        e.to_string()
    })
}

/// Destroys a build sandbox and releases its network.
fn end_build_sandbox(
    sb: hutch_runtime::Sandbox,
    net: Option<&hutch_runtime::net::Network>,
) -> std::result::Result<(), String> {
    let id = sb.id.clone();
    let result = sb.destroy().map_err(|e| e.to_string());
    if let Some(net) = net {
        net.release(&id);
    }
    result
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> std::result::Result<T, Failure> + Send + 'static,
) -> std::result::Result<T, Failure> {
    tokio::task::spawn_blocking(f).await.map_err(|e| format!("build task: {e}"))?
}

/// Runs a command to its end, its output into the log.
async fn run_logged(socket: &Path, spawn: Spawn, log: &mut Log) -> std::result::Result<ExitStatus, Failure> {
    let mut conn = hutch_runtime::agent_async::AsyncConn::connect(socket)
        .await
        .map_err(|e| format!("cannot reach the build sandbox's agent: {e}"))?;
    let pid = match conn.call(Request::Spawn(spawn), &[]).await {
        Ok((Reply::Spawned { pid }, _)) => pid,
        Ok(_) => return Err("the agent did not start the step".into()),
        Err(e) => return Err(format!("the step did not start: {e}")),
    };
    loop {
        match conn.recv().await {
            Ok((FromAgent::Output { pid: p, .. }, data)) if p == pid => log.output(&data),
            Ok((FromAgent::Dropped { pid: p, bytes, .. }, _)) if p == pid => {
                log.line(&format!("[{bytes} bytes of output dropped]"))
            }
            Ok((FromAgent::Exit { pid: p, status }, _)) if p == pid => return Ok(status),
            Ok(_) => {}
            Err(e) => return Err(format!("lost the build sandbox's agent: {e}")),
        }
    }
}

fn read_from(path: &Path, offset: u64) -> io::Result<Vec<u8>> {
    let mut f = File::open(path)?;
    f.seek(io::SeekFrom::Start(offset))?;
    let mut buf = Vec::new();
    f.take(256 * 1024).read_to_end(&mut buf)?;
    Ok(buf)
}

fn new_layer_dir(store: &ImageStore, what: &str) -> std::result::Result<PathBuf, Failure> {
    store.build_temp_dir(what).map_err(|e| e.to_string())
}

/// Makes every missing directory of `rel` (relative to `root`), mode 0755,
/// owned by `owner`.
fn mkdirs(root: &Path, rel: &str, owner: (u32, u32)) -> io::Result<()> {
    let mut path = root.to_path_buf();
    for part in rel.split('/').filter(|p| !p.is_empty()) {
        path.push(part);
        match fs::symlink_metadata(&path) {
            Ok(m) if m.is_dir() => continue,
            Ok(_) => return Err(io::Error::new(io::ErrorKind::AlreadyExists, format!("{rel}: a file is in the way"))),
            Err(_) => {
                fs::DirBuilder::new().mode(0o755).create(&path)?;
                std::os::unix::fs::lchown(&path, Some(owner.0), Some(owner.1))?;
            }
        }
    }
    Ok(())
}

/// The layer of a COPY: the context's files and directories at their
/// destinations, owned by `chown` (parents made on the way: root, 0755).
fn copy_layer(
    store: &ImageStore,
    owner: &str,
    ctx: &Context,
    files: &[(String, String)],
    dirs: &[(String, u32)],
    chown: (u32, u32),
    chmod: Option<u32>,
) -> std::result::Result<String, Failure> {
    let tmp = new_layer_dir(store, "copy")?;
    let made = (|| -> io::Result<()> {
        for (target, mode) in dirs {
            let parent = target.rsplit_once('/').map_or("", |(p, _)| p);
            mkdirs(&tmp, parent, (0, 0))?;
            let path = tmp.join(target);
            match fs::symlink_metadata(&path) {
                Ok(m) if m.is_dir() => {}
                Ok(_) => {
                    return Err(io::Error::new(io::ErrorKind::AlreadyExists, format!("{target}: a file is in the way")))
                }
                Err(_) => fs::DirBuilder::new().mode(0o755).create(&path)?,
            }
            fs::set_permissions(&path, fs::Permissions::from_mode(chmod.unwrap_or(*mode) & 0o7777))?;
            std::os::unix::fs::lchown(&path, Some(chown.0), Some(chown.1))?;
        }
        // Context path -> its destinations (one file may be copied twice).
        let mut wanted: HashMap<&str, Vec<&str>> = HashMap::new();
        for (target, src) in files {
            let parent = target.rsplit_once('/').map_or("", |(p, _)| p);
            mkdirs(&tmp, parent, (0, 0))?;
            wanted.entry(src.as_str()).or_default().push(target.as_str());
        }
        let mut failure: Option<io::Error> = None;
        let mut open: Option<(usize, Vec<File>)> = None;
        archive::stream_files(&ctx.bytes, &ctx.plan, 64 * 1024, |i, chunk| {
            let Some(src) = ctx.plan.files_in_order.get(i) else { return true };
            let Some(targets) = wanted.get(src.as_str()) else { return true };
            let mut step = || -> io::Result<()> {
                if open.as_ref().map(|(j, _)| *j) != Some(i) {
                    let mode = chmod.unwrap_or_else(|| {
                        ctx.plan.entries.iter().find(|e| &e.path == src).map_or(0o644, |e| e.mode & 0o777)
                    }) & 0o7777;
                    let mut handles = Vec::new();
                    for target in targets {
                        let path = tmp.join(target);
                        if fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir()) {
                            return Err(io::Error::new(
                                io::ErrorKind::AlreadyExists,
                                format!("{target}: a directory is in the way"),
                            ));
                        }
                        let f = fs::OpenOptions::new()
                            .write(true)
                            .create(true)
                            .truncate(true)
                            .custom_flags(libc::O_NOFOLLOW)
                            .mode(mode)
                            .open(&path)?;
                        f.set_permissions(fs::Permissions::from_mode(mode))?;
                        std::os::unix::fs::lchown(&path, Some(chown.0), Some(chown.1))?;
                        handles.push(f);
                    }
                    open = Some((i, handles));
                }
                if let Some((_, handles)) = open.as_mut() {
                    for f in handles {
                        f.write_all(&chunk)?;
                    }
                }
                Ok(())
            };
            match step() {
                Ok(()) => true,
                Err(e) => {
                    failure = Some(e);
                    false
                }
            }
        })
        .map_err(io::Error::other)?;
        match failure {
            Some(e) => Err(e),
            None => Ok(()),
        }
    })();
    match made {
        Ok(()) => store.commit_layer(&tmp, LayerScope::Owner(owner)).map_err(|e| format!("commit layer: {e}")),
        Err(e) => {
            let _ = fs::remove_dir_all(&tmp);
            Err(format!("copy: {e}"))
        }
    }
}

/// The layer of a WORKDIR: the directory, owned by `leaf` (the sandbox
/// user unless USER is root), and its parents: the sandbox user's under
/// /workspace and /home/user, root's elsewhere.
fn workdir_layer(store: &ImageStore, owner: &str, dir: &str, leaf: u32) -> std::result::Result<String, Failure> {
    let tmp = new_layer_dir(store, "workdir")?;
    let rel = dir.trim_start_matches('/');
    let made = (|| {
        let parent = rel.rsplit_once('/').map_or("", |(p, _)| p);
        let users = |p: &str| p == "workspace" || p.starts_with("workspace/") || p.starts_with("home/user/");
        let mut path = String::new();
        for part in parent.split('/').filter(|p| !p.is_empty()) {
            path = join(&path, part);
            let id = if users(&path) || path == "home/user" { USER_ID } else { 0 };
            mkdirs(&tmp, &path, (id, id))?;
        }
        mkdirs(&tmp, rel, (leaf, leaf))
    })();
    match made {
        Ok(()) => store.commit_layer(&tmp, LayerScope::Owner(owner)).map_err(|e| format!("commit layer: {e}")),
        Err(e) => {
            let _ = fs::remove_dir_all(&tmp);
            Err(format!("workdir: {e}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by fuzz/fuzz_targets/ids.rs: a refused build id was quoted
    /// whole in the error (and the log), however long the path segment.
    #[test]
    fn a_refused_build_id_is_quoted_short() {
        let long = format!("bld-{}", "x".repeat(10_000));
        let message = parse_build_id(&long).expect_err("refused").to_string();
        assert!(message.len() < 200, "{} bytes", message.len());
        assert!(parse_build_id("bld-0123456789abcdef").is_ok());
    }

    fn context(files: &[(&str, &str)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, data) in files {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_entry_type(tar::EntryType::Regular);
            b.append_data(&mut h, path, data.as_bytes()).expect("append");
        }
        b.into_inner().expect("tar")
    }

    #[test]
    fn build_images_and_ids_are_recognized() {
        assert!(is_build_image_of("tpl-0123456789abcdef-v3", "tpl-0123456789abcdef"));
        assert!(!is_build_image_of("tpl-0123456789abcdef-v", "tpl-0123456789abcdef"));
        assert!(!is_build_image_of("tpl-0123456789abcdef-v3x", "tpl-0123456789abcdef"));
        assert!(!is_build_image_of("base", "tpl-0123456789abcdef"));
        assert!(parse_build_id("bld-0123456789abcdef").is_ok());
        assert!(parse_build_id("bld-../../etc/passwd").is_err());
        assert!(parse_build_id("bld-0123456789ABCDEF").is_err());
    }

    #[test]
    fn copy_destinations_follow_docker_rules_and_sources_must_exist() {
        let bytes = context(&[("Dockerfile", "x"), ("app.py", "print(1)"), ("lib/a.py", "a"), ("lib/sub/b.py", "b")]);
        let (ctx, _) = Context::new(bytes).expect("context");
        let steps = dockerfile::parse(
            "COPY app.py /opt/app.py\nCOPY app.py lib /srv/\nWORKDIR /workspace/x\nCOPY lib ./l\nCOPY . /ctx\n",
        )
        .expect("parse");
        let planned = plan_steps(steps, &ctx, "/workspace").expect("plan");
        let files = |i: usize| match &planned[i].action {
            Action::Copy { files, .. } => files.iter().map(|(t, _)| t.clone()).collect::<Vec<_>>(),
            other => panic!("{other:?}"),
        };
        assert_eq!(files(0), ["opt/app.py"]);
        assert_eq!(files(1), ["srv/app.py", "srv/a.py", "srv/sub/b.py"]);
        assert_eq!(files(3), ["workspace/x/l/a.py", "workspace/x/l/sub/b.py"]);
        assert!(files(4).contains(&"ctx/Dockerfile".to_owned()));
        assert_ne!(planned[0].inputs, planned[1].inputs);
        let missing = dockerfile::parse("RUN true\nCOPY nothere /x\n").expect("parse");
        let err = plan_steps(missing, &ctx, "/workspace").expect_err("missing source");
        assert!(matches!(err, ControlError::BuildRefused { line: 2, .. }), "{err}");
        let kernel = dockerfile::parse("WORKDIR /proc/self\n").expect("parse");
        assert!(plan_steps(kernel, &ctx, "/workspace").is_err());
        let anywhere = dockerfile::parse("WORKDIR /tmp\n").expect("parse");
        assert_eq!(plan_steps(anywhere, &ctx, "/workspace").expect("plan")[0].cwd, "/tmp");
    }

    #[test]
    fn a_layer_made_twice_is_stacked_once_at_its_top() {
        assert_eq!(once_each(vec!["a", "b", "a", "c", "b"]), ["a", "c", "b"]);
        assert_eq!(once_each(Vec::<&str>::new()), Vec::<&str>::new());
    }

    #[test]
    fn a_context_needs_a_dockerfile_and_valid_entries() {
        assert!(Context::new(context(&[("app.py", "x")])).is_err());
        let (_, text) = Context::new(context(&[("Dockerfile", "RUN true\n")])).expect("context");
        assert_eq!(text, "RUN true\n");
        assert!(Context::new(b"not a tar at all, certainly not".to_vec()).is_err());
    }

    #[test]
    fn the_log_drops_output_past_its_cap_but_keeps_the_outcome() {
        let path = std::env::temp_dir().join(format!("hutch-build-log-{}", std::process::id()));
        let _ = fs::remove_file(&path);
        let mut log = Log::create(&path).expect("log");
        log.line("Step 1/1: RUN yes");
        let chunk = vec![b'y'; 1 << 20];
        for _ in 0..10 {
            log.output(&chunk);
        }
        log.output(b"small, but after the cut");
        log.line("Build failed: step 1/1");
        let text = fs::read_to_string(&path).expect("read");
        assert!(text.len() as u64 <= LOG_CAP + LOG_SLACK, "{}", text.len());
        assert!(text.contains("[log truncated") && text.ends_with("Build failed: step 1/1\n"));
        assert!(!text.contains("small, but after the cut"));
        fs::remove_file(&path).expect("cleanup");
    }

    #[test]
    fn cache_keys_chain_and_cover_inputs() {
        let a = cache_key("base", "RUN true", "");
        assert_eq!(a, cache_key("base", "RUN true", ""));
        assert_ne!(a, cache_key("base", "RUN  true", ""));
        assert_ne!(a, cache_key(&a, "RUN true", ""));
        assert_ne!(cache_key("p", "COPY a /a", "x"), cache_key("p", "COPY a /a", "y"));
        // Length-prefixed: no two splits of the same bytes collide.
        assert_ne!(cache_key("ab", "c", ""), cache_key("a", "bc", ""));
        // The chain starts from the owner: two owners' identical steps
        // never share a key.
        let (ka, kb) = (first_cache_key("key-a", "base", "{}"), first_cache_key("key-b", "base", "{}"));
        assert_ne!(ka, kb);
        assert_ne!(cache_key(&ka, "RUN true", ""), cache_key(&kb, "RUN true", ""));
        assert_eq!(ka, first_cache_key("key-a", "base", "{}"));
        assert_ne!(first_cache_key("key-a", "python", "{}"), ka);
    }

    #[test]
    fn build_sandboxes_carry_their_daemons_instance() {
        let dir = std::env::temp_dir().join(format!("hutch-instance-{}", hutch_runtime::sys::random_hex(6)));
        fs::create_dir_all(&dir).expect("mkdir");
        let tag = instance_tag(&dir).expect("made");
        assert_eq!(tag.len(), INSTANCE_TAG_LEN);
        assert_eq!(instance_tag(&dir).expect("kept"), tag, "the same state dir, the same instance");
        let other = std::env::temp_dir().join(format!("hutch-instance-{}", hutch_runtime::sys::random_hex(6)));
        fs::create_dir_all(&other).expect("mkdir");
        assert_ne!(instance_tag(&other).expect("made"), tag);
        let builds = Builds::default();
        let prefix = builds.sandbox_prefix(&dir).expect("prefix");
        assert_eq!(prefix, format!("bi-{tag}-"));
        let id = format!("{prefix}0123abc");
        assert_eq!(id.len(), 19, "as long as any random sandbox id");
        assert!(is_own_build_sandbox(&id, &prefix));
        let theirs = format!("bi-{}-0123abc", instance_tag(&other).expect("tag"));
        assert!(!is_own_build_sandbox(&theirs, &prefix), "another daemon's");
        assert!(!is_own_build_sandbox("sb-0123456789abcdef", &prefix));
        assert!(!is_own_build_sandbox(&format!("{prefix}0123abc/x"), &prefix));
        assert!(is_unscoped_build_sandbox("bs-0123456789abcdef"));
        assert!(!is_unscoped_build_sandbox(&id));
        fs::write(dir.join("instance"), "nonsense").expect("write");
        assert!(instance_tag(&dir).is_err(), "a damaged tag is an error, never a new instance");
        for d in [dir, other] {
            fs::remove_dir_all(d).expect("cleanup");
        }
    }
}

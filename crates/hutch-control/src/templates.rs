//! Templates: named, versioned recipes for sandboxes, one namespace per
//! owner (API key). A template fixes what runs (image, env, memory, limits),
//! the lifetimes of its sandboxes and the bounds of its warm pool. A change
//! to what runs (image, env, memory, limits, startup command, readiness
//! check) raises the version; sandboxes already running keep theirs.
//! Delete hides the template; its sandboxes live until they end.

use crate::control::{now_ms, resolve_limits, rfc3339, Control, BASE};
use crate::error::{ControlError, Result};
pub use crate::ids::TemplateId;
use crate::ids::{Caller, OwnerId};
use hutch_api::{
    Class, CreateTemplate, LimitsRequest, Readiness, SandboxState, Startup, Template, TemplateList, UpdateTemplate,
    Warm,
};
use hutch_store::{StoreError, TemplateRecord};
use std::collections::BTreeMap;
use std::time::Duration;

/// Most warm sandboxes one template may ask for.
pub const WARM_MAX: u32 = 16;
/// Longest `max_ttl_seconds` a template may set (7 days).
pub const MAX_TTL_CAP: u64 = 7 * 86_400;
/// The builtin image.
const IMAGE: &str = hutch_runtime::image::BASE;

/// The built-in template of E2B's code interpreter (`e2b-code-interpreter`
/// asks for it by this name): the `code-interpreter` preset image (built on
/// its first use), its server started at boot, ready once it listens on
/// its port. An owner's own template of the same name takes its place.
pub const INTERPRETER: &str = "code-interpreter-v1";
/// How long a boot waits for the interpreter's server to listen.
const INTERPRETER_READY_SECONDS: u32 = 60;

/// What a create runs: the builtin `base` or one of the caller's templates,
/// resolved to concrete values.
#[derive(Debug, Clone, PartialEq)]
pub struct Recipe {
    /// The name a sandbox shows in `template`.
    pub name: String,
    /// None for `base`.
    pub id: Option<String>,
    pub version: Option<i64>,
    pub memory_mb: u64,
    pub vcpus: f64,
    pub disk_mib: u64,
    pub pids: u32,
    pub env: BTreeMap<String, String>,
    pub default_ttl: Duration,
    pub max_ttl: Duration,
    pub warm_min: u32,
    /// The root filesystem: `base` or a built image's name.
    pub image: String,
    pub startup: Option<Startup>,
    pub readiness: Option<Readiness>,
    /// The network policy of its sandboxes unless a create sets one.
    pub network: hutch_api::NetworkRequest,
    /// Where its sandboxes' files live unless a create says; None: the
    /// host's default.
    pub storage: Option<hutch_api::StorageKind>,
    /// What its sandboxes do at their expiry unless a create says.
    pub on_expire: Option<hutch_api::OnExpire>,
    pub paused_ttl_s: Option<u64>,
    /// Its sandboxes' idle timeout and `on_idle` unless a create says.
    pub idle_timeout_s: Option<u64>,
    pub on_idle: Option<hutch_api::OnIdle>,
    /// The owner's secrets its sandboxes name.
    pub secrets: Vec<String>,
    /// How its sandboxes are isolated.
    pub class: Class,
}

/// The secrets a template's sandboxes name.
fn secrets_of(t: &TemplateRecord) -> Vec<String> {
    serde_json::from_str(&t.secrets).unwrap_or_default()
}

fn secrets_json(names: &[String]) -> String {
    serde_json::to_string(names).unwrap_or_else(|_| "[]".into())
}

/// A template's stored network policy.
fn network_of(t: &TemplateRecord) -> hutch_api::NetworkRequest {
    serde_json::from_str(&t.network).unwrap_or_default()
}

impl Recipe {
    /// The builtin `base` template, in `class` (the daemon's default).
    fn base(class: Class) -> Recipe {
        let (memory_mb, vcpus, disk_mib, pids) = resolve_limits(None, None).unwrap_or((1024, 1.0, 1024, 512));
        Recipe {
            name: BASE.name.to_owned(),
            id: None,
            version: None,
            memory_mb,
            vcpus,
            disk_mib,
            pids,
            env: BTreeMap::new(),
            default_ttl: BASE.default_ttl,
            max_ttl: BASE.max_ttl,
            warm_min: 0,
            image: IMAGE.into(),
            startup: None,
            readiness: None,
            network: hutch_api::NetworkRequest::default(),
            storage: None,
            on_expire: None,
            paused_ttl_s: None,
            idle_timeout_s: None,
            on_idle: None,
            secrets: Vec::new(),
            class,
        }
    }

    fn interpreter(class: Class) -> Recipe {
        use hutch_runtime::image::interp;
        Recipe {
            name: INTERPRETER.to_owned(),
            image: interp::NAME.to_owned(),
            startup: Some(Startup { command: interp::START_COMMAND.to_owned(), user: None }),
            readiness: Some(Readiness {
                command: None,
                port: Some(interp::PORT),
                timeout_seconds: Some(INTERPRETER_READY_SECONDS),
            }),
            ..Recipe::base(class)
        }
    }

    pub fn from_record(t: &TemplateRecord) -> Recipe {
        Recipe {
            name: t.name.clone(),
            id: Some(t.id.clone()),
            version: Some(t.version),
            memory_mb: t.memory_mb,
            vcpus: t.vcpus,
            disk_mib: t.disk_mib,
            pids: t.pids,
            env: serde_json::from_str(&t.env).unwrap_or_default(),
            default_ttl: Duration::from_secs(t.default_ttl_s),
            max_ttl: Duration::from_secs(t.max_ttl_s),
            warm_min: t.warm_min,
            image: t.image.clone(),
            startup: t.startup.as_deref().and_then(|s| serde_json::from_str(s).ok()),
            readiness: t.readiness.as_deref().and_then(|s| serde_json::from_str(s).ok()),
            network: network_of(t),
            storage: t.storage,
            on_expire: t.on_expire,
            paused_ttl_s: t.paused_ttl_s,
            idle_timeout_s: t.idle_timeout_s,
            on_idle: t.on_idle,
            secrets: secrets_of(t),
            // Written only by check_class: always one of the names.
            class: Class::parse(&t.class).unwrap_or_default(),
        }
    }

    /// The limits a create gets when it overrides none.
    pub fn limits(&self) -> (u64, f64, u64, u32) {
        (self.memory_mb, self.vcpus, self.disk_mib, self.pids)
    }
}

fn check_name(name: &str) -> Result<()> {
    let ok = (1..=64).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_' | b'.'))
        && name.as_bytes()[0].is_ascii_alphanumeric();
    if !ok {
        return Err(ControlError::Invalid(
            "name must be 1 to 64 of a-z, 0-9, '-', '_', '.', starting with a letter or digit".into(),
        ));
    }
    if name == BASE.name {
        return Err(ControlError::Invalid("the name `base` is reserved for the builtin template".into()));
    }
    Ok(())
}

/// A build's image, `tpl-<id>-v<n>`, may be named only by the template
/// whose build made it (others' builds are not theirs to read).
fn check_build_image(image: Option<&str>, own: Option<&str>) -> Result<()> {
    match image {
        Some(name) if name.starts_with("tpl-") => {
            if own.is_some_and(|id| crate::build::is_build_image_of(name, id)) {
                Ok(())
            } else {
                Err(ControlError::Invalid(format!("image {name:?}: only this template's own builds may be named")))
            }
        }
        _ => Ok(()),
    }
}

/// Longest startup or readiness command.
const COMMAND_MAX: usize = 16 * 1024;
/// Default and largest readiness timeout.
pub const READINESS_TIMEOUT: u32 = 30;
pub const READINESS_TIMEOUT_MAX: u32 = 300;

fn check_startup(s: Option<&Startup>) -> Result<()> {
    if let Some(s) = s {
        if s.command.trim().is_empty() || s.command.len() > COMMAND_MAX || s.command.contains('\0') {
            return Err(ControlError::Invalid(format!("startup.command must be 1 to {COMMAND_MAX} bytes, no NUL")));
        }
        if !matches!(s.user.as_deref(), None | Some("user") | Some("root")) {
            return Err(ControlError::Invalid("startup.user must be user or root".into()));
        }
    }
    Ok(())
}

fn check_readiness(r: Option<&Readiness>) -> Result<()> {
    let Some(r) = r else { return Ok(()) };
    match (&r.command, r.port) {
        (Some(c), None) => {
            if c.trim().is_empty() || c.len() > COMMAND_MAX || c.contains('\0') {
                return Err(ControlError::Invalid(format!(
                    "readiness.command must be 1 to {COMMAND_MAX} bytes, no NUL"
                )));
            }
        }
        (None, Some(p)) if p > 0 => {}
        (None, Some(_)) => return Err(ControlError::Invalid("readiness.port must be 1 to 65535".into())),
        _ => return Err(ControlError::Invalid("readiness: give exactly one of command and port".into())),
    }
    if let Some(t) = r.timeout_seconds {
        if !(1..=READINESS_TIMEOUT_MAX).contains(&t) {
            return Err(ControlError::Invalid(format!(
                "readiness.timeout_seconds must be 1 to {READINESS_TIMEOUT_MAX}"
            )));
        }
    }
    Ok(())
}

fn to_json<T: serde::Serialize>(v: Option<&T>) -> Option<String> {
    v.and_then(|v| serde_json::to_string(v).ok())
}

/// The class a template asks for (None: `default`, the daemon's default
/// class), if this host runs it.
/// (`runs`: the runtime's answer for a class.)
fn check_class(
    class: Option<&str>,
    default: Class,
    runs: impl Fn(Class) -> std::result::Result<(), String>,
) -> Result<Class> {
    let Some(name) = class else { return Ok(default) };
    let Some(class) = Class::parse(name) else {
        let names: Vec<&str> = Class::ALL.iter().map(|c| c.as_str()).collect();
        return Err(ControlError::Invalid(format!("class {name:?}: must be one of {}", names.join(", "))));
    };
    runs(class).map_err(|why| ControlError::Invalid(format!("class {class}: {why}")))?;
    Ok(class)
}

fn check_lifetimes(default_ttl: u64, max_ttl: u64) -> Result<()> {
    if !(1..=MAX_TTL_CAP).contains(&max_ttl) {
        return Err(ControlError::Invalid(format!("max_ttl_seconds must be 1 to {MAX_TTL_CAP}")));
    }
    if !(1..=max_ttl).contains(&default_ttl) {
        return Err(ControlError::Invalid("default_ttl_seconds must be 1 to max_ttl_seconds".into()));
    }
    Ok(())
}

fn check_warm(w: Warm) -> Result<()> {
    if w.max > WARM_MAX {
        return Err(ControlError::Invalid(format!("warm.max must be at most {WARM_MAX}")));
    }
    if w.min > w.max {
        return Err(ControlError::Invalid("warm.min must be at most warm.max".into()));
    }
    Ok(())
}

fn env_json(env: &BTreeMap<String, String>) -> String {
    serde_json::to_string(env).unwrap_or_else(|_| "{}".into())
}

impl Control {
    /// What a create of `name` (None: `base`) runs for `owner`.
    pub(crate) async fn recipe(&self, owner: &OwnerId, name: Option<&str>) -> Result<Recipe> {
        match name {
            None => Ok(Recipe::base(self.default_class)),
            Some(n) if n == BASE.name => Ok(Recipe::base(self.default_class)),
            Some(n) => {
                let (o, name) = (owner.to_string(), n.to_owned());
                match self.db_read(move |s| s.template_by_name(&o, &name)).await? {
                    Some(t) => Ok(Recipe::from_record(&t)),
                    None if n == INTERPRETER => Ok(Recipe::interpreter(self.default_class)),
                    None => Err(ControlError::UnknownTemplate(n.to_owned())),
                }
            }
        }
    }

    /// A template's network policy, checked as a create's would be, stored
    /// as given (JSON).
    fn template_network(&self, req: Option<&hutch_api::NetworkRequest>) -> Result<String> {
        self.network_record(req)?;
        Ok(serde_json::to_string(&req.cloned().unwrap_or_default()).unwrap_or_else(|_| "{}".into()))
    }

    /// The API view of a template, with its ready warm sandboxes counted.
    async fn template_view(&self, t: &TemplateRecord) -> Result<Template> {
        let pooled = self.db(|s| s.pooled_sandboxes(None)).await?;
        let ready = pooled
            .iter()
            .filter(|s| {
                s.state == SandboxState::Running
                    && s.template_id.as_deref() == Some(&t.id)
                    && s.template_version == Some(t.version)
            })
            .count() as u64;
        Ok(Template {
            id: t.id.clone(),
            name: t.name.clone(),
            version: t.version as u64,
            image: t.image.clone(),
            class: t.class.clone(),
            memory_mb: t.memory_mb,
            limits: LimitsRequest { vcpus: Some(t.vcpus), disk_mib: Some(t.disk_mib), pids: Some(t.pids) },
            env: serde_json::from_str(&t.env).unwrap_or_default(),
            default_ttl_seconds: t.default_ttl_s,
            max_ttl_seconds: t.max_ttl_s,
            warm: Warm { min: t.warm_min, max: t.warm_max },
            warm_ready: ready,
            startup: t.startup.as_deref().and_then(|s| serde_json::from_str(s).ok()),
            readiness: t.readiness.as_deref().and_then(|s| serde_json::from_str(s).ok()),
            network: network_of(t),
            created_at: rfc3339(t.created_at),
            updated_at: rfc3339(t.updated_at),
            owner: t.owner.clone(),
            storage: t.storage,
            on_expire: t.on_expire.unwrap_or_default(),
            paused_ttl_seconds: t.paused_ttl_s.unwrap_or(crate::sandboxes::PAUSED_TTL_DEFAULT),
            idle_timeout_seconds: t.idle_timeout_s,
            on_idle: t.idle_timeout_s.map(|_| t.on_idle.unwrap_or_default()),
            secrets: secrets_of(t),
        })
    }

    /// A live template the caller may see (its own; any, for an admin).
    pub(crate) async fn template_of(&self, caller: &Caller, id: &TemplateId) -> Result<TemplateRecord> {
        let tid = id.to_string();
        match self.db(move |s| s.get_template(&tid)).await? {
            Some(t) if caller.may_manage(&t.owner) && t.deleted_at.is_none() => Ok(t),
            _ => Err(ControlError::NoTemplate(id.to_string())),
        }
    }

    /// The images the caller may name: the host's shared ones and its own
    /// builds' (the admin key: every image).
    pub async fn list_images(&self, caller: &Caller) -> Result<hutch_api::ImageList> {
        let store = self.images()?;
        let images = tokio::task::spawn_blocking(move || store.summaries()).await?;
        let images = images
            .into_iter()
            .filter(|i| caller.admin || i.shared || i.owner.as_deref() == Some(caller.owner.as_str()))
            .map(|i| hutch_api::ImageInfo {
                name: i.name,
                layers: i.layers as u64,
                size_bytes: i.size_bytes,
                source: i.source,
                created_at: rfc3339(i.created_at.saturating_mul(1000).min(i64::MAX as u64) as i64),
            })
            .collect();
        Ok(hutch_api::ImageList { images })
    }

    /// The image a template may name: `base`, a preset (built on first
    /// use), or one in the image store.
    fn check_image(&self, image: Option<&str>) -> Result<String> {
        let name = image.unwrap_or(IMAGE);
        if name == IMAGE || hutch_runtime::image::debian::is_preset(name) {
            return Ok(name.to_owned());
        }
        match self.images()?.get(name) {
            // A build's image is its owner's, named only by its template.
            Ok(img) if img.is_shared() => Ok(name.to_owned()),
            Ok(_) => Err(ControlError::NoImage(name.to_owned())),
            Err(hutch_runtime::image::ImageError::NotFound(_)) => Err(ControlError::NoImage(name.to_owned())),
            Err(e) => Err(ControlError::Runtime(e.to_string())),
        }
    }

    pub async fn create_template(&self, caller: &Caller, req: &CreateTemplate) -> Result<Template> {
        check_name(&req.name)?;
        check_build_image(req.image.as_deref(), None)?;
        let image = self.check_image(req.image.as_deref())?;
        check_startup(req.startup.as_ref())?;
        check_readiness(req.readiness.as_ref())?;
        let class = check_class(req.class.as_deref(), self.default_class, |c| self.runtime.runs(c))?;
        let (memory_mb, vcpus, disk_mib, pids) = resolve_limits(req.memory_mb, req.limits.as_ref())?;
        crate::control::check_map("env", &req.env, 256)?;
        let max_ttl = req.max_ttl_seconds.unwrap_or(BASE.max_ttl.as_secs());
        let default_ttl = req.default_ttl_seconds.unwrap_or(BASE.default_ttl.as_secs().min(max_ttl));
        check_lifetimes(default_ttl, max_ttl)?;
        let warm = req.warm.unwrap_or_default();
        check_warm(warm)?;
        let now = now_ms();
        let t = TemplateRecord {
            id: TemplateId::random()?.to_string(),
            owner: caller.owner.to_string(),
            name: req.name.clone(),
            version: 1,
            image,
            class: class.as_str().into(),
            memory_mb,
            vcpus,
            disk_mib,
            pids,
            env: env_json(&req.env),
            default_ttl_s: default_ttl,
            max_ttl_s: max_ttl,
            warm_min: warm.min,
            warm_max: warm.max,
            created_at: now,
            updated_at: now,
            deleted_at: None,
            startup: to_json(req.startup.as_ref()),
            readiness: to_json(req.readiness.as_ref()),
            network: self.template_network(req.network.as_ref())?,
            storage: req.storage.map(|k| self.storage_kind(Some(k))).transpose()?,
            on_expire: req.on_expire,
            paused_ttl_s: req.paused_ttl_seconds.map(crate::sandboxes::check_paused_ttl).transpose()?,
            idle_timeout_s: req.idle_timeout_seconds,
            on_idle: req.on_idle,
            secrets: secrets_json(&self.secret_names(&caller.owner, &req.secrets).await?),
        };
        self.check_on_expire(t.on_expire, t.storage)?;
        crate::idle::IdlePolicy::from_request(t.idle_timeout_s, t.on_idle)?;
        let rec = t.clone();
        match self.db(move |s| s.insert_template(&rec)).await {
            Ok(()) => self.template_view(&t).await,
            Err(ControlError::Store(StoreError::Conflict)) => Err(ControlError::TemplateNameTaken(req.name.clone())),
            Err(e) => Err(e),
        }
    }

    /// The caller's live templates, or for an admin another owner's
    /// (`owner`) or everyone's (`*`).
    pub async fn list_templates(&self, caller: &Caller, owner: Option<&str>) -> Result<TemplateList> {
        let owners = caller.listing(owner)?;
        let filter = owners.filter().map(str::to_owned);
        let records = self.db(move |s| s.list_templates(filter.as_deref())).await?;
        let mut templates = Vec::with_capacity(records.len());
        for t in &records {
            templates.push(self.template_view(t).await?);
        }
        Ok(TemplateList { templates })
    }

    pub async fn get_template(&self, caller: &Caller, id: &TemplateId) -> Result<Template> {
        self.template_view(&self.template_of(caller, id).await?).await
    }

    pub async fn update_template(&self, caller: &Caller, id: &TemplateId, req: &UpdateTemplate) -> Result<Template> {
        let old = self.template_of(caller, id).await?;
        if !caller.may_use(&old.owner) {
            return Err(ControlError::Forbidden("only a template's owner may change it".into()));
        }
        check_build_image(req.image.as_deref(), Some(&old.id))?;
        let class = req
            .class
            .as_deref()
            .map(|c| check_class(Some(c), self.default_class, |c| self.runtime.runs(c)))
            .transpose()?;
        let mut t = old.clone();
        if let Some(class) = class {
            t.class = class.as_str().into();
        }
        if let Some(image) = &req.image {
            let state = &self.runtime.config().state_dir;
            if crate::build::is_build_image_of(image, &old.id) {
                if crate::build::image_root(state, image, Some(&old.owner)).is_err() {
                    return Err(ControlError::Invalid(format!("image {image:?} does not exist (or lost a layer)")));
                }
                t.image = image.clone();
            } else {
                t.image = self.check_image(Some(image))?;
            }
        }
        if let Some(startup) = &req.startup {
            check_startup(startup.as_ref())?;
            t.startup = to_json(startup.as_ref());
        }
        if let Some(readiness) = &req.readiness {
            check_readiness(readiness.as_ref())?;
            t.readiness = to_json(readiness.as_ref());
        }
        if req.memory_mb.is_some() || req.limits.is_some() {
            let limits = req.limits.clone().unwrap_or(LimitsRequest {
                vcpus: Some(old.vcpus),
                disk_mib: Some(old.disk_mib),
                pids: Some(old.pids),
            });
            let (m, v, d, p) = resolve_limits(Some(req.memory_mb.unwrap_or(old.memory_mb)), Some(&limits))?;
            (t.memory_mb, t.vcpus, t.disk_mib, t.pids) = (m, v, d, p);
        }
        if let Some(env) = &req.env {
            crate::control::check_map("env", env, 256)?;
            t.env = env_json(env);
        }
        t.max_ttl_s = req.max_ttl_seconds.unwrap_or(old.max_ttl_s);
        t.default_ttl_s = req.default_ttl_seconds.unwrap_or(old.default_ttl_s);
        check_lifetimes(t.default_ttl_s, t.max_ttl_s)?;
        if let Some(w) = req.warm {
            check_warm(w)?;
            (t.warm_min, t.warm_max) = (w.min, w.max);
        }
        // What runs changed: a new version. Lifetimes and the pool do not count.
        let old_env: BTreeMap<String, String> = serde_json::from_str(&old.env).unwrap_or_default();
        let new_env: BTreeMap<String, String> = serde_json::from_str(&t.env).unwrap_or_default();
        if let Some(network) = &req.network {
            t.network = self.template_network(Some(network))?;
        }
        if let Some(kind) = req.storage {
            t.storage = Some(self.storage_kind(Some(kind))?);
        }
        // What happens at expiry is read at each create: no new version.
        if let Some(on_expire) = req.on_expire {
            t.on_expire = Some(on_expire);
        }
        if let Some(secs) = req.paused_ttl_seconds {
            t.paused_ttl_s = Some(crate::sandboxes::check_paused_ttl(secs)?);
        }
        if let Some(secs) = req.idle_timeout_seconds {
            t.idle_timeout_s = Some(secs);
        }
        if let Some(on_idle) = req.on_idle {
            t.on_idle = Some(on_idle);
        }
        if let Some(names) = &req.secrets {
            t.secrets = secrets_json(&self.secret_names(&OwnerId::from_record(&old.owner), names).await?);
        }
        self.check_on_expire(t.on_expire, t.storage)?;
        crate::idle::IdlePolicy::from_request(t.idle_timeout_s, t.on_idle)?;
        let changed = t.image != old.image
            || t.class != old.class
            || t.storage != old.storage
            || network_of(&t) != network_of(&old)
            || t.startup != old.startup
            || t.readiness != old.readiness
            || t.secrets != old.secrets
            || new_env != old_env
            || (t.memory_mb, t.vcpus, t.disk_mib, t.pids) != (old.memory_mb, old.vcpus, old.disk_mib, old.pids);
        if changed {
            t.version += 1;
        }
        t.updated_at = now_ms().max(old.updated_at + 1);
        if t != old {
            let (rec, read_at) = (t.clone(), old.updated_at);
            if !self.db(move |s| s.update_template(&rec, read_at)).await? {
                return Err(ControlError::Conflict(format!(
                    "template {id} changed while this update was made; read it again and retry"
                )));
            }
        }
        self.template_view(&t).await
    }

    /// Hides a template and drains its warm pool now; sandboxes already
    /// claimed live until they end.
    pub async fn delete_template(self: &std::sync::Arc<Self>, caller: &Caller, id: &TemplateId) -> Result<()> {
        let mut t = self.template_of(caller, id).await?;
        let read_at = t.updated_at;
        t.deleted_at = Some(now_ms());
        t.updated_at = now_ms().max(read_at + 1);
        let rec = t.clone();
        if !self.db(move |s| s.update_template(&rec, read_at)).await? {
            // Deleted or changed meanwhile: gone is gone; a change, retry.
            return Err(ControlError::NoTemplate(id.to_string()));
        }
        self.drain_template(&t.id).await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_images_and_pools_are_checked() {
        assert!(check_name("py-3.12_x").is_ok());
        for bad in ["", "base", "-x", "Upper", "a/b", &"x".repeat(65)] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
        assert!(check_build_image(Some("base"), None).is_ok());
        assert!(check_build_image(Some("tpl-0123456789abcdef-v2"), Some("tpl-0123456789abcdef")).is_ok());
        assert!(check_build_image(Some("tpl-0123456789abcdef-v2"), Some("tpl-fedcba9876543210")).is_err());
        assert!(check_build_image(Some("tpl-0123456789abcdef-v2"), None).is_err());
        assert!(check_readiness(Some(&Readiness { command: None, port: None, timeout_seconds: None })).is_err());
        assert!(check_readiness(Some(&Readiness {
            command: Some("true".into()),
            port: Some(80),
            timeout_seconds: None
        }))
        .is_err());
        assert!(
            check_readiness(Some(&Readiness { command: None, port: Some(80), timeout_seconds: Some(301) })).is_err()
        );
        assert!(check_readiness(Some(&Readiness { command: None, port: Some(80), timeout_seconds: Some(5) })).is_ok());
        assert!(check_startup(Some(&Startup { command: " ".into(), user: None })).is_err());
        let none = |_| Err("not here".to_owned());
        assert!(check_class(Some("microvm"), Class::Container, none).is_err());
        assert!(check_class(Some("vm"), Class::Container, |_| Ok(())).is_err());
        assert_eq!(check_class(None, Class::Container, none).expect("default"), Class::Container);
        assert_eq!(check_class(None, Class::Gvisor, none).expect("default"), Class::Gvisor);
        assert_eq!(check_class(Some("gvisor"), Class::Container, |_| Ok(())).expect("runs"), Class::Gvisor);
        assert!(check_class(Some("container"), Class::Gvisor, none).is_err());
        assert!(check_warm(Warm { min: 3, max: 2 }).is_err());
        assert!(check_warm(Warm { min: 0, max: WARM_MAX + 1 }).is_err());
        assert!(check_warm(Warm { min: 2, max: 4 }).is_ok());
        assert!(check_lifetimes(601, 600).is_err());
        assert!(check_lifetimes(60, MAX_TTL_CAP + 1).is_err());
    }
}

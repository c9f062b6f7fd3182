//! `hutch template ...`: create, list, show and delete templates of a running
//! daemon, and build one from a directory holding a Dockerfile fragment.
//! Templates are named by id or by name (resolved through the list).

use super::output::{self, table};
use super::{parse_pairs, parse_seconds, parse_storage, report, ClientOpts, LifecycleArgs, NetworkArgs, ResourceArgs};
use anyhow::Context as _;
use clap::{Args, Subcommand};
use hutch_api::{BuildState, CreateTemplate, Readiness, Startup, Template, Warm};
use std::io::{Read, Write};
use std::path::Path;

/// Largest build context sent (the daemon's limit).
const CONTEXT_CAP: usize = 32 << 20;

#[derive(Args, Debug)]
pub struct TemplateArgs {
    #[command(flatten)]
    pub conn: ClientOpts,
    #[command(subcommand)]
    pub command: TemplateCommand,
}

#[derive(Subcommand, Debug)]
pub enum TemplateCommand {
    /// Create a template and print it.
    Create(CreateArgs),
    /// Change a template (by id or name): only the flags given change.
    Update(UpdateArgs),
    /// List your templates.
    List {
        /// Print JSON (a TemplateList).
        #[arg(long)]
        json: bool,
    },
    /// Show one template (by id or name).
    Show {
        template: String,
        /// Print JSON (a Template).
        #[arg(long)]
        json: bool,
    },
    /// Delete templates: hidden at once, their sandboxes live until they end.
    #[command(visible_alias = "rm")]
    Delete {
        #[arg(required = true)]
        templates: Vec<String>,
    },
    /// Build a template from DIR (a Dockerfile and the files it copies),
    /// following the log; exits non-zero when the build fails.
    Build {
        template: String,
        dir: std::path::PathBuf,
        /// Print the build's id and return without following it.
        #[arg(long)]
        detach: bool,
    },
}

#[derive(Args, Debug)]
pub struct CreateArgs {
    /// Unique among your templates.
    name: String,
    /// Root filesystem: base (the default), a preset (python, node), an
    /// image of the host's store, or one of this template's builds.
    #[arg(long)]
    image: Option<String>,
    /// Isolation class (container).
    #[arg(long)]
    class: Option<String>,
    /// Where its sandboxes' files live: disk or memory (the host's default
    /// when absent).
    #[arg(long, value_name = "KIND", value_parser = parse_storage)]
    storage: Option<hutch_api::StorageKind>,
    /// Its sandboxes' resources.
    #[command(flatten)]
    res: ResourceArgs,
    /// KEY=VALUE for every process of its sandboxes; repeatable.
    #[arg(long = "env", value_name = "KEY=VALUE")]
    env: Vec<String>,
    /// A secret its sandboxes name (repeatable).
    #[arg(long = "secret", value_name = "NAME")]
    secrets: Vec<String>,
    /// Default lifetime of its sandboxes: 10m, 1h, ...
    #[arg(long, value_parser = parse_seconds, value_name = "DURATION")]
    ttl: Option<u64>,
    /// Longest lifetime a sandbox may reach.
    #[arg(long, value_parser = parse_seconds, value_name = "DURATION")]
    max_ttl: Option<u64>,
    /// Warm sandboxes kept ready.
    #[arg(long, default_value_t = 0)]
    warm_min: u32,
    #[arg(long, default_value_t = 0)]
    warm_max: u32,
    /// Started in the background in each sandbox as it boots.
    #[arg(long, value_name = "COMMAND")]
    startup: Option<String>,
    /// Ready once this command exits 0.
    #[arg(long, value_name = "COMMAND", conflicts_with = "ready_port")]
    ready_command: Option<String>,
    /// Ready once this port accepts connections inside the sandbox.
    #[arg(long, value_name = "PORT")]
    ready_port: Option<u16>,
    /// How long a sandbox may take to become ready (default 30 s).
    #[arg(long, value_parser = parse_seconds, value_name = "DURATION")]
    ready_timeout: Option<u64>,
    #[command(flatten)]
    net: NetworkArgs,
    #[command(flatten)]
    life: LifecycleArgs,
    /// Print JSON (a Template).
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
pub struct UpdateArgs {
    /// The template's id or name.
    template: String,
    /// Root filesystem: base, or one of this template's builds
    /// (tpl-<id>-v<n>) to roll back.
    #[arg(long)]
    image: Option<String>,
    #[arg(long)]
    class: Option<String>,
    /// Its sandboxes' resources: any of --vcpus, --disk and --pids replaces
    /// the limits whole (the others take their defaults).
    #[command(flatten)]
    res: ResourceArgs,
    /// KEY=VALUE; repeatable; replaces the environment whole.
    #[arg(long = "env", value_name = "KEY=VALUE")]
    env: Vec<String>,
    /// Empty the environment.
    #[arg(long, conflicts_with = "env")]
    clear_env: bool,
    #[arg(long, value_parser = parse_seconds, value_name = "DURATION")]
    ttl: Option<u64>,
    #[arg(long, value_parser = parse_seconds, value_name = "DURATION")]
    max_ttl: Option<u64>,
    /// Warm sandboxes kept ready (both bounds are sent; one alone keeps the
    /// other as it is).
    #[arg(long)]
    warm_min: Option<u32>,
    #[arg(long)]
    warm_max: Option<u32>,
    #[arg(long, value_name = "COMMAND")]
    startup: Option<String>,
    /// Remove the startup command.
    #[arg(long, conflicts_with = "startup")]
    no_startup: bool,
    #[arg(long, value_name = "COMMAND", conflicts_with_all = ["ready_port", "no_readiness"])]
    ready_command: Option<String>,
    #[arg(long, value_name = "PORT", conflicts_with = "no_readiness")]
    ready_port: Option<u16>,
    #[arg(long, value_parser = parse_seconds, value_name = "DURATION", conflicts_with = "no_readiness")]
    ready_timeout: Option<u64>,
    /// Remove the readiness check.
    #[arg(long)]
    no_readiness: bool,
    #[command(flatten)]
    net: NetworkArgs,
    #[command(flatten)]
    life: LifecycleArgs,
    /// Print JSON (a Template).
    #[arg(long)]
    json: bool,
}

pub fn main(args: TemplateArgs) -> i32 {
    report(run(args), 1)
}

fn run(args: TemplateArgs) -> anyhow::Result<i32> {
    let client = args.conn.client()?;
    match args.command {
        TemplateCommand::Create(c) => {
            let t = client.create_template(&create_request(&c)?)?;
            show(&t, c.json)?;
            Ok(0)
        }
        TemplateCommand::Update(u) => {
            let id = resolve(&client, &u.template)?;
            let patch = update_request(&u, || client.get_template(&id).map_err(anyhow::Error::from))?;
            let t = client.update_template(&id, &patch)?;
            show(&t, u.json)?;
            Ok(0)
        }
        TemplateCommand::List { json } => {
            let list = client.list_templates()?;
            if json {
                print!("{}", output::json(&list)?);
            } else {
                let rows: Vec<Vec<String>> = list
                    .templates
                    .iter()
                    .map(|t| {
                        vec![
                            t.id.clone(),
                            t.name.clone(),
                            t.version.to_string(),
                            t.image.clone(),
                            format!("{}/{}", t.warm_ready, t.warm.min),
                        ]
                    })
                    .collect();
                print!("{}", table(&["ID", "NAME", "VERSION", "IMAGE", "WARM"], &rows));
            }
            Ok(0)
        }
        TemplateCommand::Show { template, json } => {
            let id = resolve(&client, &template)?;
            show(&client.get_template(&id)?, json)?;
            Ok(0)
        }
        TemplateCommand::Delete { templates } => {
            for t in templates {
                let id = resolve(&client, &t)?;
                client.delete_template(&id)?;
                println!("{id}");
            }
            Ok(0)
        }
        TemplateCommand::Build { template, dir, detach } => {
            let id = resolve(&client, &template)?;
            let context = pack(&dir)?;
            let build = client.start_build(&id, &context)?;
            if detach {
                println!("{}", build.id);
                return Ok(0);
            }
            eprintln!("build {} of template {id}", build.id);
            let mut log = client.build_log(&id, &build.id, true)?.into_reader();
            let mut buf = [0u8; 16 * 1024];
            let mut out = std::io::stdout();
            loop {
                let n = log.read(&mut buf).context("reading the build log")?;
                if n == 0 {
                    break;
                }
                out.write_all(&buf[..n])?;
                out.flush()?;
            }
            let done = client.get_build(&id, &build.id)?;
            match done.state {
                BuildState::Succeeded => Ok(0),
                BuildState::Failed => {
                    eprintln!("hutch: build failed: {}", done.error.unwrap_or_default());
                    Ok(1)
                }
                other => {
                    eprintln!("hutch: the log ended while the build is {}", other.as_str());
                    Ok(1)
                }
            }
        }
    }
}

fn create_request(c: &CreateArgs) -> anyhow::Result<CreateTemplate> {
    let limits = c.res.limits();
    let readiness = match (&c.ready_command, c.ready_port) {
        (None, None) => None,
        (command, port) => Some(Readiness {
            command: command.clone(),
            port,
            timeout_seconds: c.ready_timeout.map(|s| s.min(u64::from(u32::MAX)) as u32),
        }),
    };
    Ok(CreateTemplate {
        name: c.name.clone(),
        image: c.image.clone(),
        class: c.class.clone(),
        storage: c.storage,
        network: c.net.request()?,
        memory_mb: c.res.memory,
        limits,
        env: parse_pairs("--env", &c.env)?,
        default_ttl_seconds: c.ttl,
        max_ttl_seconds: c.max_ttl,
        warm: (c.warm_min > 0 || c.warm_max > 0).then_some(Warm { min: c.warm_min, max: c.warm_max.max(c.warm_min) }),
        startup: c.startup.clone().map(|command| Startup { command, user: None }),
        readiness,
        on_expire: c.life.on_expire,
        paused_ttl_seconds: c.life.paused_ttl,
        idle_timeout_seconds: c.life.idle_timeout,
        on_idle: c.life.on_idle,
        secrets: c.secrets.clone(),
    })
}

/// The PATCH body of `template update`'s flags: only the fields given.
/// `current` reads the template when one warm bound is given alone.
fn update_request(
    u: &UpdateArgs,
    current: impl FnOnce() -> anyhow::Result<Template>,
) -> anyhow::Result<serde_json::Map<String, serde_json::Value>> {
    use serde_json::{json, Value};
    let mut m = serde_json::Map::new();
    let mut put = |k: &str, v: Value| {
        m.insert(k.to_owned(), v);
    };
    if let Some(i) = &u.image {
        put("image", json!(i));
    }
    if let Some(c) = &u.class {
        put("class", json!(c));
    }
    if let Some(mb) = u.res.memory {
        put("memory_mb", json!(mb));
    }
    if let Some(limits) = u.res.limits() {
        put("limits", serde_json::to_value(limits)?);
    }
    if u.clear_env || !u.env.is_empty() {
        put("env", serde_json::to_value(parse_pairs("--env", &u.env)?)?);
    }
    if let Some(s) = u.ttl {
        put("default_ttl_seconds", json!(s));
    }
    if let Some(s) = u.max_ttl {
        put("max_ttl_seconds", json!(s));
    }
    if u.warm_min.is_some() || u.warm_max.is_some() {
        let (min, max) = match (u.warm_min, u.warm_max) {
            (Some(min), Some(max)) => (min, max),
            (min, max) => {
                let w = current()?.warm;
                (min.unwrap_or(w.min), max.unwrap_or(w.max))
            }
        };
        put("warm", serde_json::to_value(Warm { min, max: max.max(min) })?);
    }
    if u.no_startup {
        put("startup", Value::Null);
    } else if let Some(c) = &u.startup {
        put("startup", serde_json::to_value(Startup { command: c.clone(), user: None })?);
    }
    if u.no_readiness {
        put("readiness", Value::Null);
    } else if u.ready_command.is_some() || u.ready_port.is_some() {
        let r = Readiness {
            command: u.ready_command.clone(),
            port: u.ready_port,
            timeout_seconds: u.ready_timeout.map(|s| s.min(u64::from(u32::MAX)) as u32),
        };
        put("readiness", serde_json::to_value(r)?);
    } else if u.ready_timeout.is_some() {
        anyhow::bail!("--ready-timeout goes with --ready-command or --ready-port");
    }
    if let Some(n) = u.net.request()? {
        put("network", serde_json::to_value(n)?);
    }
    if let Some(s) = u.life.idle_timeout {
        put("idle_timeout_seconds", serde_json::to_value(s)?);
    }
    if let Some(o) = u.life.on_idle {
        put("on_idle", serde_json::to_value(o)?);
    }
    if let Some(w) = u.life.on_expire {
        put("on_expire", serde_json::to_value(w)?);
    }
    if let Some(s) = u.life.paused_ttl {
        put("paused_ttl_seconds", json!(s));
    }
    if m.is_empty() {
        anyhow::bail!("nothing to change: give at least one flag (hutch template update --help)");
    }
    Ok(m)
}

/// A template id, or the id of the caller's template of that name.
fn resolve(client: &super::client::Client, name_or_id: &str) -> anyhow::Result<String> {
    if name_or_id.starts_with("tpl-") {
        return Ok(name_or_id.to_owned());
    }
    let list = client.list_templates()?;
    list.templates
        .into_iter()
        .find(|t| t.name == name_or_id)
        .map(|t| t.id)
        .ok_or_else(|| anyhow::anyhow!("no template named {name_or_id:?}"))
}

fn show(t: &Template, json: bool) -> anyhow::Result<()> {
    if json {
        print!("{}", output::json(t)?);
        return Ok(());
    }
    let startup = t.startup.as_ref().map_or("-".to_owned(), |s| s.command.clone());
    let readiness = match &t.readiness {
        Some(Readiness { port: Some(p), .. }) => format!("port {p}"),
        Some(Readiness { command: Some(c), .. }) => format!("command {c}"),
        _ => "-".to_owned(),
    };
    let rows = vec![
        vec!["id".into(), t.id.clone()],
        vec!["name".into(), t.name.clone()],
        vec!["version".into(), t.version.to_string()],
        vec!["image".into(), t.image.clone()],
        vec!["memory".into(), format!("{} MiB", t.memory_mb)],
        vec!["startup".into(), startup],
        vec!["readiness".into(), readiness],
        vec!["warm".into(), format!("{} ready, min {}, max {}", t.warm_ready, t.warm.min, t.warm.max)],
        vec!["updated".into(), t.updated_at.clone()],
    ];
    print!("{}", table(&["FIELD", "VALUE"], &rows));
    Ok(())
}

/// DIR as a tar.gz: regular files and directories, names relative to DIR;
/// symlinks are sent as such (the daemon refuses them, naming the entry).
fn pack(dir: &Path) -> anyhow::Result<Vec<u8>> {
    if !dir.join("Dockerfile").is_file() {
        anyhow::bail!("{} holds no Dockerfile", dir.display());
    }
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    let mut tar = tar::Builder::new(gz);
    tar.follow_symlinks(false);
    tar.mode(tar::HeaderMode::Deterministic);
    tar.append_dir_all(".", dir).with_context(|| format!("packing {}", dir.display()))?;
    let bytes = tar.into_inner()?.finish()?;
    if bytes.len() > CONTEXT_CAP {
        anyhow::bail!("the build context is {} MiB packed; the limit is {} MiB", bytes.len() >> 20, CONTEXT_CAP >> 20);
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use serde_json::json;

    #[derive(Parser)]
    struct T {
        #[command(subcommand)]
        c: TemplateCommand,
    }

    fn update(args: &[&str]) -> UpdateArgs {
        let t = T::try_parse_from(["x", "update"].iter().chain(args)).expect("parse");
        let TemplateCommand::Update(u) = t.c else { panic!("not update") };
        u
    }

    fn never() -> anyhow::Result<Template> {
        panic!("the template was read though every field was given")
    }

    #[test]
    fn update_sends_only_the_fields_given() {
        let m = update_request(&update(&["web", "--memory", "1G", "--no-startup", "--allow", "pypi.org"]), never)
            .expect("request");
        assert_eq!(
            serde_json::Value::Object(m),
            json!({"memory_mb": 1024, "startup": null,
                   "network": {"egress": "default", "allow": ["pypi.org"], "deny": []}})
        );
        let m = update_request(&update(&["web", "--clear-env", "--warm-min", "1", "--warm-max", "3"]), never)
            .expect("request");
        assert_eq!(serde_json::Value::Object(m), json!({"env": {}, "warm": {"min": 1, "max": 3}}));
        assert!(update_request(&update(&["web"]), never).is_err(), "nothing to change");
        assert!(update_request(&update(&["web", "--ready-timeout", "5s"]), never).is_err());
        assert!(T::try_parse_from(["x", "update", "web", "--startup", "a", "--no-startup"]).is_err());
    }

    /// A template as the daemon answers one.
    fn never_used_template() -> Template {
        let t = CreateTemplate { name: "web".into(), ..CreateTemplate::default() };
        let network = serde_json::to_value(hutch_api::NetworkRequest::default()).expect("network");
        serde_json::from_value(json!({
            "id": "tpl-1", "name": t.name, "version": 1, "image": "base", "class": "container",
            "memory_mb": 512, "limits": {"vcpus": 1.0, "disk_mib": 1024, "pids": 512}, "env": {},
            "default_ttl_seconds": 600, "max_ttl_seconds": 86400, "warm": {"min": 0, "max": 0},
            "warm_ready": 0, "network": network, "created_at": "2026-01-01T00:00:00Z",
            "updated_at": "2026-01-01T00:00:00Z"
        }))
        .expect("a template")
    }

    #[test]
    fn one_warm_bound_keeps_the_other() {
        let current = || {
            let mut t = serde_json::to_value(never_used_template())?;
            t["warm"] = json!({"min": 2, "max": 4});
            Ok(serde_json::from_value(t)?)
        };
        let m = update_request(&update(&["web", "--warm-min", "3"]), current).expect("request");
        assert_eq!(m["warm"], json!({"min": 3, "max": 4}));
    }

    #[test]
    fn create_takes_image_class_and_network() {
        let t = T::try_parse_from([
            "x",
            "create",
            "web",
            "--image",
            "python",
            "--class",
            "container",
            "--network",
            "deny_all",
        ])
        .expect("parse");
        let TemplateCommand::Create(c) = t.c else { panic!("not create") };
        let req = create_request(&c).expect("request");
        assert_eq!(req.image.as_deref(), Some("python"));
        assert_eq!(req.class.as_deref(), Some("container"));
        assert_eq!(req.network.expect("network").egress, hutch_api::Egress::DenyAll);
    }
}

//! `hutch template ...`: create, list, show and delete templates of a running
//! daemon, and build one from a directory holding a Dockerfile fragment.
//! Templates are named by id or by name (resolved through the list).

use super::output::{self, table};
use super::{parse_mib, parse_pairs, parse_seconds, report, ClientOpts};
use anyhow::Context as _;
use clap::{Args, Subcommand};
use hutch_api::{BuildState, CreateTemplate, LimitsRequest, Readiness, Startup, Template, Warm};
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
    /// Memory limit of its sandboxes: 512M, 1G, ...
    #[arg(long, value_parser = parse_mib, value_name = "SIZE")]
    memory: Option<u64>,
    #[arg(long)]
    vcpus: Option<f64>,
    /// Size of the writable layer: 2G, ...
    #[arg(long, value_parser = parse_mib, value_name = "SIZE")]
    disk: Option<u64>,
    #[arg(long)]
    pids: Option<u32>,
    /// KEY=VALUE for every process of its sandboxes; repeatable.
    #[arg(long = "env", value_name = "KEY=VALUE")]
    env: Vec<String>,
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
    let limits = (c.vcpus.is_some() || c.disk.is_some() || c.pids.is_some()).then_some(LimitsRequest {
        vcpus: c.vcpus,
        disk_mib: c.disk,
        pids: c.pids,
    });
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
        memory_mb: c.memory,
        limits,
        env: parse_pairs("--env", &c.env)?,
        default_ttl_seconds: c.ttl,
        max_ttl_seconds: c.max_ttl,
        warm: (c.warm_min > 0 || c.warm_max > 0).then_some(Warm { min: c.warm_min, max: c.warm_max.max(c.warm_min) }),
        startup: c.startup.clone().map(|command| Startup { command }),
        readiness,
        ..CreateTemplate::default()
    })
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

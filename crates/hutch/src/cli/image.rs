//! `hutch image ...`: the image store, worked on directly on the daemon's
//! host (like `hutch key`): Debian builds with mmdebstrap, presets,
//! `docker save` and OCI-layout imports, registry pulls, listing, removal
//! and garbage collection. The daemon reads the same store when a template
//! names an image.

use super::output::table;
use super::{report, DEFAULT_STATE_DIR};
use anyhow::Context;
use clap::{Args, Subcommand};
use hutch_runtime::image::{self, debian, registry, ImageError, ImageStore, Limits};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct ImageArgs {
    /// The daemon's state directory, holding images/ (HUTCH_STATE_DIR).
    #[arg(long, global = true, env = "HUTCH_STATE_DIR", default_value = DEFAULT_STATE_DIR)]
    pub state_dir: PathBuf,
    #[command(subcommand)]
    pub command: ImageCommand,
}

#[derive(Subcommand, Debug)]
pub enum ImageCommand {
    /// Build an image: `debian` (mmdebstrap, minbase) or a preset (`python`, `node`, `code-interpreter`).
    Build {
        /// `debian`, `python`, `node` or `code-interpreter`.
        kind: String,
        /// Debian suite (debian only).
        #[arg(long, default_value = "bookworm")]
        suite: String,
        /// Packages to add, comma-separated (debian only).
        #[arg(long, value_delimiter = ',')]
        packages: Vec<String>,
        /// Name of the image (default: debian-SUITE, or the preset's name).
        #[arg(long)]
        name: Option<String>,
    },
    /// Import a `docker save` or OCI-layout archive (.tar or .tar.gz).
    Import {
        file: PathBuf,
        /// Name of the image (default: from the archive's tag, else the file name).
        #[arg(long)]
        name: Option<String>,
    },
    /// Pull an image from an OCI registry (e.g. 127.0.0.1:5000/app:1).
    Pull {
        reference: String,
        /// Name of the image (default: the reference, sanitized: a-z0-9._-).
        #[arg(long)]
        name: Option<String>,
        /// Allow plain HTTP to a registry not on loopback.
        #[arg(long)]
        insecure: bool,
    },
    /// List images.
    #[command(visible_alias = "ls")]
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove an image (its layers go at the next `gc` if no image uses them).
    #[command(visible_alias = "remove")]
    Rm { name: String },
    /// Remove layers no image uses (older than an hour).
    Gc,
}

pub fn main(args: ImageArgs) -> i32 {
    report(run(args), 1)
}

/// Progress on stderr: each line with the time since the start.
fn progress_printer() -> impl Fn(&str) + Sync {
    let start = Instant::now();
    let out = Mutex::new(());
    move |line: &str| {
        let _guard = out.lock();
        let mut e = std::io::stderr().lock();
        let _ = writeln!(e, "[{:5.1}s] {}", start.elapsed().as_secs_f64(), line.trim_end());
    }
}

fn coded(e: ImageError) -> anyhow::Error {
    anyhow::anyhow!("{e} [{}]", e.code())
}

fn run(args: ImageArgs) -> anyhow::Result<i32> {
    let store = ImageStore::open(&args.state_dir).map_err(coded).context("opening the image store")?;
    let show = |img: &image::Image| println!("{} ({} layers, {})", img.name, img.layers.len(), img.source);
    match args.command {
        ImageCommand::Build { kind, suite, packages, name } => {
            let progress = progress_printer();
            let img = if debian::is_preset(&kind) {
                if !packages.is_empty() || name.is_some() {
                    anyhow::bail!("a preset takes no --packages or --name; use `hutch image build debian` for those");
                }
                debian::ensure_preset(&store, &kind, &progress).map_err(coded)?
            } else if kind == "debian" {
                let spec = debian::DebianSpec {
                    name: name.unwrap_or_else(|| format!("debian-{suite}")),
                    suite,
                    packages: packages.into_iter().filter(|p| !p.is_empty()).collect(),
                };
                debian::build(&store, &spec, &progress).map_err(coded)?
            } else {
                anyhow::bail!("unknown image kind {kind:?}: use debian, python, node or code-interpreter");
            };
            show(&img);
        }
        ImageCommand::Import { file, name } => {
            let img = image::archive::import(&store, &file, name.as_deref(), &Limits::default()).map_err(coded)?;
            show(&img);
        }
        ImageCommand::Pull { reference, name, insecure } => {
            let opts = registry::PullOptions { insecure, name, limits: Limits::default() };
            let img = registry::pull(&store, &reference, &opts).map_err(coded)?;
            show(&img);
        }
        ImageCommand::List { json } => {
            let list = store.summaries();
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else {
                let rows: Vec<Vec<String>> = list
                    .iter()
                    .map(|i| {
                        vec![
                            i.name.clone(),
                            i.layers.to_string(),
                            format!("{:.1}M", i.size_bytes as f64 / (1 << 20) as f64),
                            i.source.clone(),
                        ]
                    })
                    .collect();
                print!("{}", table(&["NAME", "LAYERS", "SIZE", "SOURCE"], &rows));
            }
        }
        ImageCommand::Rm { name } => {
            store.remove(&name).map_err(coded)?;
            println!("removed {name}");
        }
        ImageCommand::Gc => {
            let removed = store.gc().map_err(coded)?;
            println!("removed {} layers", removed.len());
        }
    }
    Ok(0)
}

//! `hutch image ...`: the daemon's images. Imports of `docker save` and
//! OCI-layout archives (streamed to the daemon), registry pulls, listing,
//! removal and collection go through the API (`/v1/images`; all but the
//! listing take an admin key), from any machine that reaches it. With
//! `--local` they work on the store of `--state-dir` directly instead (as
//! root on the host, no daemon needed: for `hutch run --image`). Debian
//! builds and presets (mmdebstrap) run on the daemon's host either way; a
//! preset is also built by the daemon on the first template that names it.

use super::output::table;
use super::{report, ClientOpts};
use anyhow::Context;
use clap::{Args, Subcommand};
use hutch_runtime::image::{self, debian, registry, ImageError, ImageStore, Limits};
use std::io::Write;
use std::sync::Mutex;
use std::time::Instant;

const DEFAULT_SUITE: &str = "bookworm";

#[derive(Args, Debug)]
pub struct ImageArgs {
    #[command(flatten)]
    pub client: ClientOpts,
    /// Work on the store of --state-dir directly, not through the daemon's
    /// API (on its host, as root; no daemon needed).
    #[arg(long, global = true)]
    pub local: bool,
    #[command(subcommand)]
    pub command: ImageCommand,
}

#[derive(Subcommand, Debug)]
pub enum ImageCommand {
    /// Build an image on the daemon's host (admin key; with --local, in
    /// --state-dir as root): `debian` (mmdebstrap, minbase) or a preset
    /// (`python`, `node`, `code-interpreter`).
    Build {
        /// `debian`, `python`, `node` or `code-interpreter`.
        kind: String,
        /// Debian suite (debian only).
        #[arg(long, default_value = DEFAULT_SUITE)]
        suite: String,
        /// Packages to add, comma-separated (debian only).
        #[arg(long, value_delimiter = ',')]
        packages: Vec<String>,
        /// Name of the image (default: debian-SUITE, or the preset's name).
        #[arg(long)]
        name: Option<String>,
    },
    /// Import a `docker save` or OCI-layout archive (.tar or .tar.gz; `-`: stdin).
    Import {
        file: std::path::PathBuf,
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
    let show = |img: &hutch_api::ImageInfo| println!("{} ({} layers, {})", img.name, img.layers, img.source);
    if args.local {
        return run_local(&args.client.state_dir, args.command);
    }
    let client = args.client.client()?;
    match args.command {
        ImageCommand::Build { kind, suite, packages, name } => {
            let suite = (suite != DEFAULT_SUITE).then_some(suite);
            let req = hutch_api::BuildImage { kind, suite, packages, name };
            let progress = progress_printer();
            let mut image = None;
            for line in client.build_image(&req)?.lines() {
                let line = line.context("reading the build's progress")?;
                match serde_json::from_str::<hutch_api::ImageBuildEvent>(&line) {
                    Ok(hutch_api::ImageBuildEvent::Log { line }) => progress(&line),
                    Ok(hutch_api::ImageBuildEvent::Skipped { lines }) => progress(&format!("({lines} lines skipped)")),
                    Ok(hutch_api::ImageBuildEvent::Done { image: img }) => image = Some(img),
                    Ok(hutch_api::ImageBuildEvent::Error { code, error }) => {
                        anyhow::bail!("{error} [{}]", code.as_str())
                    }
                    Err(e) => anyhow::bail!("unexpected line from the daemon: {e}"),
                }
            }
            let img = image.context("the daemon ended the build's answer without an outcome")?;
            show(&img);
        }
        ImageCommand::Import { file, name } => {
            let img = if file.as_os_str() == "-" {
                client.import_image(std::io::stdin().lock(), None, name.as_deref(), None)?
            } else {
                let f = std::fs::File::open(&file).with_context(|| format!("opening {}", file.display()))?;
                let len = f.metadata().ok().map(|m| m.len());
                let filename = file.file_name().map(|n| n.to_string_lossy().into_owned());
                client.import_image(
                    std::io::BufReader::with_capacity(1 << 20, f),
                    len,
                    name.as_deref(),
                    filename.as_deref(),
                )?
            };
            show(&img);
        }
        ImageCommand::Pull { reference, name, insecure } => {
            let img = client.pull_image(&hutch_api::PullImage { reference, name, insecure })?;
            show(&img);
        }
        ImageCommand::List { json } => {
            let list = client.list_images()?.images;
            print_images(&list, json, |i| (&i.name, i.layers, i.size_bytes, &i.source))?;
        }
        ImageCommand::Rm { name } => {
            client.delete_image(&name)?;
            println!("removed {name}");
        }
        ImageCommand::Gc => {
            let removed = client.collect_images()?;
            println!("removed {removed} layers");
        }
    }
    Ok(0)
}

/// Prints images as JSON or as a table of `row`'s (name, layers, bytes,
/// source): the daemon's list and the local store's alike.
fn print_images<T: serde::Serialize>(
    list: &[T],
    json: bool,
    row: impl Fn(&T) -> (&str, u64, u64, &str),
) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(list)?);
        return Ok(());
    }
    let rows: Vec<Vec<String>> = list
        .iter()
        .map(|i| {
            let (name, layers, bytes, source) = row(i);
            vec![name.to_owned(), layers.to_string(), format!("{:.1}M", bytes as f64 / (1 << 20) as f64), source.into()]
        })
        .collect();
    print!("{}", table(&["NAME", "LAYERS", "SIZE", "SOURCE"], &rows));
    Ok(())
}

/// `--local`: the same commands on the store of `state_dir` itself.
fn run_local(state_dir: &std::path::Path, command: ImageCommand) -> anyhow::Result<i32> {
    if let ImageCommand::Build { kind, suite, packages, name } = command {
        let store = ImageStore::open(state_dir).map_err(coded).context("opening the image store")?;
        let progress = progress_printer();
        let img = if debian::is_preset(&kind) {
            if !packages.is_empty() || name.is_some() || suite != DEFAULT_SUITE {
                anyhow::bail!(
                    "a preset takes no --suite, --packages or --name; use `hutch image build debian` for those"
                );
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
        println!("{} ({} layers, {})", img.name, img.layers.len(), img.source);
        return Ok(0);
    }
    let store = ImageStore::open(state_dir).map_err(coded).context("opening the image store")?;
    let show = |img: &image::Image| println!("{} ({} layers, {})", img.name, img.layers.len(), img.source);
    match command {
        ImageCommand::Build { .. } => unreachable!("built before"),
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
            print_images(&list, json, |i| (&i.name, i.layers as u64, i.size_bytes, &i.source))?;
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

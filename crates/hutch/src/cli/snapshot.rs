//! `hutch snapshot ...`: take, list, show and delete snapshots of a running
//! daemon's sandboxes, and fork a sandbox. Snapshots are named by id; a
//! create takes `--snapshot` with an id or a name
//! (`hutch sandbox create --snapshot NAME`). `export` saves one as an image
//! archive that `hutch image import`, `docker load` and `podman load` read.

use super::output::{self, table};
use super::{report, ClientOpts};
use clap::{Args, Subcommand};
use hutch_api::{CreateSnapshot, Fork, Snapshot};

#[derive(Args, Debug)]
pub struct SnapshotArgs {
    #[command(flatten)]
    pub conn: ClientOpts,
    #[command(subcommand)]
    pub command: SnapshotCommand,
}

#[derive(Subcommand, Debug)]
pub enum SnapshotCommand {
    /// Take a snapshot of a sandbox's files and print it.
    Create {
        sandbox: String,
        /// Unique among your snapshots.
        #[arg(long)]
        name: Option<String>,
        /// Keep its memory and running processes too (gvisor sandboxes
        /// with `deny_all` egress).
        #[arg(long)]
        memory: bool,
        /// Print JSON (a Snapshot).
        #[arg(long)]
        json: bool,
    },
    /// List your snapshots, newest first.
    #[command(visible_alias = "ls")]
    List {
        /// Print JSON (a SnapshotList).
        #[arg(long)]
        json: bool,
    },
    /// Show one snapshot.
    Show {
        id: String,
        /// Print JSON (a Snapshot).
        #[arg(long)]
        json: bool,
    },
    /// Delete snapshots (sandboxes started from them keep their files).
    #[command(visible_alias = "rm")]
    Delete {
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Save a snapshot (id or name) as an image archive (OCI layout and
    /// docker-save manifest in one tar) for `hutch image import`,
    /// `docker load` or `podman load`.
    Export {
        id: String,
        /// Where to write it; `-` for stdout.
        file: std::path::PathBuf,
    },
    /// Start COUNT sandboxes holding a sandbox's files at one instant;
    /// prints their ids.
    Fork {
        sandbox: String,
        #[arg(long, default_value_t = 1)]
        count: u32,
    },
}

pub fn main(args: SnapshotArgs) -> i32 {
    report(run(args), 1)
}

fn show(s: &Snapshot, json: bool) -> anyhow::Result<()> {
    if json {
        print!("{}", output::json(s)?);
    } else {
        println!("{}", s.id);
    }
    Ok(())
}

fn run(args: SnapshotArgs) -> anyhow::Result<i32> {
    let client = args.conn.client()?;
    match args.command {
        SnapshotCommand::Create { sandbox, name, memory, json } => {
            let req = CreateSnapshot { name, memory: memory.then_some(true) };
            show(&client.create_snapshot(&sandbox, &req)?, json)?;
        }
        SnapshotCommand::List { json } => {
            let list = client.list_snapshots()?;
            if json {
                print!("{}", output::json(&list)?);
            } else {
                let rows: Vec<Vec<String>> = list
                    .snapshots
                    .iter()
                    .map(|s| {
                        vec![
                            s.id.clone(),
                            s.name.clone().unwrap_or_default(),
                            s.sandbox_id.clone(),
                            crate::units::show_size(s.size_bytes),
                            s.created_at.clone(),
                        ]
                    })
                    .collect();
                print!("{}", table(&["ID", "NAME", "SANDBOX", "SIZE", "CREATED"], &rows));
            }
        }
        SnapshotCommand::Show { id, json } => show(&client.get_snapshot(&id)?, json)?,
        SnapshotCommand::Delete { ids } => {
            for id in ids {
                client.delete_snapshot(&id)?;
            }
        }
        SnapshotCommand::Export { id, file } => {
            let mut reader = client.export_snapshot(&id)?.into_reader();
            if file.as_os_str() == "-" {
                let mut out = std::io::stdout().lock();
                std::io::copy(&mut reader, &mut out).map_err(|e| anyhow::anyhow!("exporting {id}: {e}"))?;
                std::io::Write::flush(&mut out)?;
            } else {
                super::files::save(&mut reader, &file)
                    .map_err(|e| anyhow::anyhow!("exporting {id} to {}: {e}", file.display()))?;
            }
        }
        SnapshotCommand::Fork { sandbox, count } => {
            for sb in client.fork_sandbox(&sandbox, &Fork { count: Some(count) })?.sandboxes {
                println!("{}", sb.id);
            }
        }
    }
    Ok(0)
}

//! `hutch volume ...`: make, list, show, grow and delete volumes of a
//! running daemon. A sandbox mounts them at its creation
//! (`hutch sandbox create --volume NAME:/data[:ro]`).

use super::output::{self, table};
use super::{report, ClientOpts};
use clap::{Args, Subcommand};
use hutch_api::{CreateVolume, UpdateVolume, Volume};

#[derive(Args, Debug)]
pub struct VolumeArgs {
    #[command(flatten)]
    pub conn: ClientOpts,
    #[command(subcommand)]
    pub command: VolumeCommand,
}

#[derive(Subcommand, Debug)]
pub enum VolumeCommand {
    /// Make a volume and print its id.
    Create {
        /// Unique among your volumes.
        name: String,
        /// Most it may hold: 512M, 10G, ... (1G when absent).
        #[arg(long, value_parser = crate::units::parse_size, value_name = "SIZE")]
        size: Option<u64>,
        /// Print JSON (a Volume).
        #[arg(long)]
        json: bool,
    },
    /// List your volumes, oldest first.
    #[command(visible_alias = "ls")]
    List {
        /// Print JSON (a VolumeList).
        #[arg(long)]
        json: bool,
    },
    /// Show one volume (by id or name).
    Show {
        volume: String,
        /// Print JSON (a Volume).
        #[arg(long)]
        json: bool,
    },
    /// Grow a volume (volumes never shrink).
    Resize {
        volume: String,
        /// The new size: 2G, ...
        #[arg(value_parser = crate::units::parse_size, value_name = "SIZE")]
        size: u64,
    },
    /// Delete volumes and their files (refused while a sandbox mounts one).
    #[command(visible_alias = "delete")]
    Rm {
        #[arg(required = true)]
        volumes: Vec<String>,
    },
}

pub fn main(args: VolumeArgs) -> i32 {
    report(run(args), 1)
}

/// MiB of a size in bytes, refusing what is not a whole number of them.
fn mib(bytes: u64) -> anyhow::Result<u64> {
    if !bytes.is_multiple_of(1 << 20) {
        anyhow::bail!("a volume's size is a whole number of MiB (as 512M or 10G)");
    }
    Ok(bytes >> 20)
}

fn show(v: &Volume, json: bool) -> anyhow::Result<()> {
    if json {
        print!("{}", output::json(v)?);
    } else {
        println!("id          {}", v.id);
        println!("name        {}", v.name);
        println!("size        {}", crate::units::show_size(v.size_mib << 20));
        println!("used        {}", v.used_bytes);
        println!("created_at  {}", v.created_at);
        for h in &v.mounted_by {
            println!("mounted_by  {} at {}{}", h.sandbox_id, h.path, if h.read_only { " (read-only)" } else { "" });
        }
    }
    Ok(())
}

fn run(args: VolumeArgs) -> anyhow::Result<i32> {
    let client = args.conn.client()?;
    match args.command {
        VolumeCommand::Create { name, size, json } => {
            let v = client.create_volume(&CreateVolume { name, size_mib: size.map(mib).transpose()? })?;
            if json {
                print!("{}", output::json(&v)?);
            } else {
                println!("{}", v.id);
            }
        }
        VolumeCommand::List { json } => {
            let list = client.list_volumes()?;
            if json {
                print!("{}", output::json(&list)?);
            } else {
                let rows: Vec<Vec<String>> = list
                    .volumes
                    .iter()
                    .map(|v| {
                        vec![
                            v.id.clone(),
                            v.name.clone(),
                            crate::units::show_size(v.size_mib << 20),
                            v.used_bytes.to_string(),
                            v.mounted_by.iter().map(|h| h.sandbox_id.as_str()).collect::<Vec<_>>().join(","),
                            v.created_at.clone(),
                        ]
                    })
                    .collect();
                print!("{}", table(&["ID", "NAME", "SIZE", "USED", "MOUNTED BY", "CREATED"], &rows));
            }
        }
        VolumeCommand::Show { volume, json } => show(&client.get_volume(&volume)?, json)?,
        VolumeCommand::Resize { volume, size } => {
            let v = client.update_volume(&volume, &UpdateVolume { size_mib: Some(mib(size)?) })?;
            println!("{} {}", v.id, crate::units::show_size(v.size_mib << 20));
        }
        VolumeCommand::Rm { volumes } => {
            for v in volumes {
                client.delete_volume(&v)?;
            }
        }
    }
    Ok(0)
}

/// `NAME:/path` or `NAME:/path:ro` (or `:rw`) of `--volume`.
pub fn parse_mount(s: &str) -> Result<hutch_api::VolumeMount, String> {
    let (name, rest) = s.split_once(':').ok_or_else(|| format!("--volume {s:?}: give NAME:/path[:ro]"))?;
    let (path, read_only) = match rest.rsplit_once(':') {
        Some((p, "ro")) => (p, true),
        Some((p, "rw")) => (p, false),
        _ => (rest, false),
    };
    if name.is_empty() || !path.starts_with('/') {
        return Err(format!("--volume {s:?}: give NAME:/path[:ro]"));
    }
    Ok(hutch_api::VolumeMount { name: name.into(), path: path.into(), read_only })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_flags_read_as_name_path_and_mode() {
        let m = parse_mount("cache:/data/c:ro").expect("ro");
        assert_eq!((m.name.as_str(), m.path.as_str(), m.read_only), ("cache", "/data/c", true));
        let m = parse_mount("vol-0123456789abcdef:/mnt").expect("rw");
        assert_eq!((m.name.as_str(), m.path.as_str(), m.read_only), ("vol-0123456789abcdef", "/mnt", false));
        assert!(!parse_mount("c:/mnt:rw").expect("rw").read_only);
        for bad in ["cache", ":/data", "cache:data", "cache:"] {
            assert!(parse_mount(bad).is_err(), "{bad}");
        }
        assert_eq!(mib(1 << 30).expect("1G"), 1024);
        assert!(mib(1000).is_err());
    }
}

//! `hutch key ...`: API keys. On the daemon's host, directly in its
//! database (no HTTP: whoever can read the state directory is already the
//! daemon's equal), through the same key functions as the daemon's admin
//! API (`hutch_control::keys`); from anywhere, with `--url`/`HUTCH_URL` or
//! `--api-key`/`HUTCH_API_KEY`, through that API (`/v1/keys`, admin keys
//! only). Secrets are printed once; the store keeps their hash.

use super::output::{self, table};
use super::{report, ClientOpts, DEFAULT_STATE_DIR, DEFAULT_URL};
use anyhow::Context;
use clap::{Args, Subcommand};
use hutch_api::ApiKey;
use hutch_control::keys;
use hutch_store::{Quotas, SqliteStore, Store};
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct KeyArgs {
    /// The daemon's state directory, holding hutch.db (HUTCH_STATE_DIR).
    #[arg(long, global = true, env = "HUTCH_STATE_DIR", default_value = DEFAULT_STATE_DIR)]
    pub state_dir: PathBuf,
    /// The daemon's PostgreSQL database, when it has one (`hutch serve
    /// --database`) (HUTCH_DATABASE).
    #[arg(long, global = true, env = "HUTCH_DATABASE", value_name = "URL", hide_env_values = true)]
    pub database: Option<String>,
    /// Manage the keys of this daemon through its API instead (HUTCH_URL).
    #[arg(long, global = true, env = "HUTCH_URL")]
    pub url: Option<String>,
    /// The admin key for the API (HUTCH_API_KEY); else <state-dir>/admin.key.
    #[arg(long, global = true, env = "HUTCH_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    #[command(subcommand)]
    pub command: KeyCommand,
}

#[derive(Subcommand, Debug)]
pub enum KeyCommand {
    /// Make a key and print its secret (once: only its hash is stored).
    Create {
        /// A name to tell keys apart.
        #[arg(long, default_value = "cli")]
        name: String,
        /// Shape the secret as the E2B SDK expects (`e2b_` and 40 hex digits).
        #[arg(long)]
        e2b: bool,
        #[command(flatten)]
        quotas: QuotaArgs,
        /// Print JSON (an ApiKey, with its secret).
        #[arg(long)]
        json: bool,
    },
    /// Set a key's quotas (those not given are removed).
    Quotas {
        id: String,
        #[command(flatten)]
        quotas: QuotaArgs,
        /// Print JSON (the ApiKey).
        #[arg(long)]
        json: bool,
    },
    /// List keys, oldest first.
    #[command(visible_alias = "ls")]
    List {
        /// Print JSON (an array of ApiKey).
        #[arg(long)]
        json: bool,
    },
    /// Revoke a key: requests with it are refused from now on, and the
    /// running daemon ends its sandboxes at its next tick.
    Revoke { id: String },
}

/// A key's caps; each left out is no cap of the key's own (the host's
/// capacity still applies).
#[derive(Args, Debug, Default)]
pub struct QuotaArgs {
    /// Sandboxes at once (its templates' warm sandboxes included).
    #[arg(long)]
    pub max_sandboxes: Option<u64>,
    /// Sum of the memory limits of its sandboxes, in MiB.
    #[arg(long)]
    pub max_memory_mb: Option<u64>,
    /// Sum of the disk sizes of its sandboxes, in MiB.
    #[arg(long)]
    pub max_disk_mib: Option<u64>,
    /// Longest lifetime of one sandbox, in seconds.
    #[arg(long)]
    pub max_ttl_seconds: Option<u64>,
    /// Template builds queued or running at once.
    #[arg(long)]
    pub max_builds: Option<u64>,
    /// Snapshots kept.
    #[arg(long)]
    pub max_snapshots: Option<u64>,
}

impl QuotaArgs {
    fn quotas(&self) -> Quotas {
        Quotas {
            sandboxes: self.max_sandboxes,
            memory_mb: self.max_memory_mb,
            disk_mib: self.max_disk_mib,
            ttl_seconds: self.max_ttl_seconds,
            builds: self.max_builds,
            snapshots: self.max_snapshots,
        }
    }
}

/// Where keys are managed: the host's database or a daemon's API.
enum Keys {
    Local(Box<dyn Store>),
    Remote(super::client::Client),
}

impl Keys {
    fn of(args: &KeyArgs) -> anyhow::Result<Keys> {
        if args.url.is_none() && args.api_key.is_none() {
            return Ok(Keys::Local(match args.database.as_deref().filter(|d| !d.is_empty()) {
                Some(url) => open_postgres(url)?,
                None => Box::new(open(&args.state_dir)?),
            }));
        }
        let conn = ClientOpts {
            url: args.url.clone().unwrap_or_else(|| DEFAULT_URL.to_owned()),
            api_key: args.api_key.clone(),
            state_dir: args.state_dir.clone(),
        };
        Ok(Keys::Remote(conn.client()?))
    }

    fn create(&self, name: &str, e2b: bool, quotas: Quotas) -> anyhow::Result<ApiKey> {
        Ok(match self {
            Keys::Local(s) => keys::create(s.as_ref(), name, false, e2b, quotas)?,
            Keys::Remote(c) => {
                c.create_key(&hutch_api::CreateKey { name: name.to_owned(), e2b, quotas: keys::to_api(&quotas) })?
            }
        })
    }

    fn set_quotas(&self, id: &str, quotas: Quotas) -> anyhow::Result<ApiKey> {
        Ok(match self {
            Keys::Local(s) => keys::set_quotas(s.as_ref(), id, quotas)?,
            Keys::Remote(c) => c.set_key_quotas(id, &keys::to_api(&quotas))?,
        })
    }

    fn list(&self) -> anyhow::Result<Vec<ApiKey>> {
        Ok(match self {
            Keys::Local(s) => keys::list(s.as_ref())?,
            Keys::Remote(c) => c.list_keys()?.keys,
        })
    }

    fn revoke(&self, id: &str) -> anyhow::Result<()> {
        match self {
            Keys::Local(s) => keys::revoke(s.as_ref(), id)?,
            Keys::Remote(c) => c.revoke_key(id)?,
        }
        Ok(())
    }
}

pub fn main(args: KeyArgs) -> i32 {
    report(run(args), 1)
}

fn run(args: KeyArgs) -> anyhow::Result<i32> {
    let store = Keys::of(&args)?;
    match args.command {
        KeyCommand::Create { name, e2b, quotas, json } => {
            let k = store.create(&name, e2b, quotas.quotas()).context("making a key")?;
            if json {
                print!("{}", output::json(&k)?);
            } else {
                println!("id:     {}", k.id);
                println!("name:   {}", k.name);
                println!("secret: {}", k.secret.as_deref().unwrap_or(""));
            }
            eprintln!("Keep the secret now: hutch stores only its hash and cannot show it again.");
            Ok(0)
        }
        KeyCommand::Quotas { id, quotas, json } => {
            let k = store.set_quotas(&id, quotas.quotas()).context("setting the key's quotas")?;
            if json {
                print!("{}", output::json(&k)?);
            } else {
                print!("{}", keys_table(&[k]));
            }
            Ok(0)
        }
        KeyCommand::List { json } => {
            let keys = store.list().context("listing keys")?;
            if json {
                print!("{}", output::json(&keys)?);
            } else {
                print!("{}", keys_table(&keys));
            }
            Ok(0)
        }
        KeyCommand::Revoke { id } => {
            store.revoke(&id).with_context(|| format!("revoking {id} (see `hutch key list`)"))?;
            println!("{id} revoked");
            Ok(0)
        }
    }
}

/// The daemon's PostgreSQL database (`--database`).
fn open_postgres(url: &str) -> anyhow::Result<Box<dyn Store>> {
    if !crate::serve::is_postgres_url(url) {
        anyhow::bail!("--database (HUTCH_DATABASE) must be a postgres:// or postgresql:// URL");
    }
    Ok(Box::new(
        hutch_store::PgStore::open(url).context("opening the PostgreSQL database of --database (HUTCH_DATABASE)")?,
    ))
}

/// Opens the daemon's database; refuses to create one where none is.
fn open(state_dir: &Path) -> anyhow::Result<SqliteStore> {
    let db = state_dir.join("hutch.db");
    match std::fs::metadata(&db) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => anyhow::bail!(
            "no hutch database at {}: start `hutch serve` once, or point --state-dir (HUTCH_STATE_DIR) at the \
             daemon's state directory",
            db.display()
        ),
        Err(e) => anyhow::bail!("cannot reach {}: {e} (run as the daemon's user?)", db.display()),
    }
    SqliteStore::open(&db).with_context(|| format!("opening {} (run as the daemon's user?)", db.display()))
}

/// Columns of `key list`.
fn keys_table(keys: &[ApiKey]) -> String {
    let cap = |v: Option<u64>| v.map_or_else(|| "-".to_owned(), |v| v.to_string());
    let rows: Vec<Vec<String>> = keys
        .iter()
        .map(|k| {
            vec![
                k.id.clone(),
                k.name.clone(),
                k.created_at.clone(),
                k.revoked_at.clone().unwrap_or_else(|| "-".to_owned()),
                if k.admin { "yes".to_owned() } else { "-".to_owned() },
                cap(k.quotas.max_sandboxes),
                cap(k.quotas.max_memory_mb),
            ]
        })
        .collect();
    table(&["ID", "NAME", "CREATED", "REVOKED", "ADMIN", "MAX SANDBOXES", "MAX MEMORY MB"], &rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_list_as_table_and_api_type() {
        let store = SqliteStore::open_in_memory().expect("store");
        let a =
            keys::create(&store, "ci", false, false, Quotas { sandboxes: Some(4), ..Quotas::default() }).expect("key");
        let b = keys::create(&store, "sdk", false, true, Quotas::default()).expect("key");
        keys::revoke(&store, &a.id).expect("revoke");
        let listed = keys::list(&store).expect("list");
        let t = keys_table(&listed);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("ID") && lines[0].contains("MAX SANDBOXES"), "{t}");
        let row_a = lines.iter().find(|l| l.starts_with(&a.id)).expect("a listed");
        assert!(row_a.contains(" ci ") && row_a.contains(" 4 "), "{row_a}");
        assert!(!row_a.contains(" -  ") || row_a.matches('Z').count() == 2, "revoked shows a time: {row_a}");
        assert!(lines.iter().any(|l| l.starts_with(&b.id)));
        let json = serde_json::to_string(&listed).expect("json");
        assert!(!json.contains("secret") && !json.contains("hash"), "{json}");
    }

    #[test]
    fn open_refuses_to_create_a_database() {
        let d = std::env::temp_dir().join(format!("hutch-cli-keys-{}", std::process::id()));
        let e = open(&d).err().expect("no database");
        assert!(e.to_string().contains("hutch serve"), "{e}");
        assert!(!d.join("hutch.db").exists());
    }
}

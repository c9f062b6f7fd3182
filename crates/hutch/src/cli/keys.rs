//! `hutch key ...`: API keys, managed on the daemon's host directly in its
//! database (no HTTP: whoever can read the state directory is already the
//! daemon's equal). Secrets are printed once; the store keeps their hash.

use super::output::{self, table};
use super::{report, DEFAULT_STATE_DIR};
use anyhow::Context;
use clap::{Args, Subcommand};
use hutch_api::ApiKey;
use hutch_store::{KeyRecord, SqliteStore, Store};
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct KeyArgs {
    /// The daemon's state directory, holding hutch.db (HUTCH_STATE_DIR).
    #[arg(long, global = true, env = "HUTCH_STATE_DIR", default_value = DEFAULT_STATE_DIR)]
    pub state_dir: PathBuf,
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
        /// Print JSON (an ApiKey, with its secret).
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
    /// Revoke a key: requests with it are refused from now on.
    Revoke { id: String },
}

pub fn main(args: KeyArgs) -> i32 {
    report(run(args), 1)
}

fn run(args: KeyArgs) -> anyhow::Result<i32> {
    let store = open(&args.state_dir)?;
    match args.command {
        KeyCommand::Create { name, e2b, json } => {
            let now = hutch_control::keys::now_ms();
            let k = hutch_control::keys::generate(&name, false, e2b, now).context("generating a key")?;
            store.insert_key(&k.record).context("storing the key")?;
            if json {
                let mut api = api_key(&k.record);
                api.secret = Some(k.secret);
                print!("{}", output::json(&api)?);
            } else {
                println!("id:     {}", k.record.id);
                println!("name:   {}", k.record.name);
                println!("secret: {}", k.secret);
            }
            eprintln!("Keep the secret now: hutch stores only its hash and cannot show it again.");
            Ok(0)
        }
        KeyCommand::List { json } => {
            let keys = store.list_keys().context("listing keys")?;
            if json {
                let api: Vec<ApiKey> = keys.iter().map(api_key).collect();
                print!("{}", output::json(&api)?);
            } else {
                print!("{}", keys_table(&keys));
            }
            Ok(0)
        }
        KeyCommand::Revoke { id } => {
            if store.revoke_key(&id, hutch_control::keys::now_ms()).context("revoking the key")? {
                println!("{id} revoked");
                Ok(0)
            } else {
                anyhow::bail!("no live key with id {id:?} (see `hutch key list`)")
            }
        }
    }
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

/// A stored key as the API lists it.
fn api_key(k: &KeyRecord) -> ApiKey {
    ApiKey {
        id: k.id.clone(),
        name: k.name.clone(),
        created_at: output::rfc3339(k.created_at),
        revoked_at: k.revoked_at.map(output::rfc3339),
        secret: None,
    }
}

/// Columns of `key list`.
fn keys_table(keys: &[KeyRecord]) -> String {
    let rows: Vec<Vec<String>> = keys
        .iter()
        .map(|k| {
            vec![
                k.id.clone(),
                k.name.clone(),
                output::rfc3339(k.created_at),
                k.revoked_at.map(output::rfc3339).unwrap_or_else(|| "-".to_owned()),
                if k.admin { "yes".to_owned() } else { "-".to_owned() },
            ]
        })
        .collect();
    table(&["ID", "NAME", "CREATED", "REVOKED", "ADMIN"], &rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_list_as_table_and_api_type() {
        let store = SqliteStore::open_in_memory().expect("store");
        let a = hutch_control::keys::generate("ci", false, false, 1_700_000_000_000).expect("key");
        let b = hutch_control::keys::generate("sdk", false, true, 1_700_000_060_000).expect("key");
        store.insert_key(&a.record).expect("insert");
        store.insert_key(&b.record).expect("insert");
        assert!(store.revoke_key(&a.record.id, 1_700_000_120_000).expect("revoke"));
        let keys = store.list_keys().expect("list");
        let t = keys_table(&keys);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "ID                NAME  CREATED               REVOKED               ADMIN");
        assert_eq!(lines[1], format!("{}  ci    2023-11-14T22:13:20Z  2023-11-14T22:15:20Z  -", a.record.id));
        assert_eq!(lines[2], format!("{}  sdk   2023-11-14T22:14:20Z  -                     -", b.record.id));
        let api = api_key(&keys[0]);
        assert_eq!(api.revoked_at.as_deref(), Some("2023-11-14T22:15:20Z"));
        assert_eq!(api.secret, None);
        let json = serde_json::to_string(&api).expect("json");
        assert!(!json.contains("secret") && !json.contains(&a.record.hash), "{json}");
    }

    #[test]
    fn open_refuses_to_create_a_database() {
        let d = std::env::temp_dir().join(format!("hutch-cli-keys-{}", std::process::id()));
        let e = open(&d).err().expect("no database");
        assert!(e.to_string().contains("hutch serve"), "{e}");
        assert!(!d.join("hutch.db").exists());
    }
}

//! The command line client of the hutch daemon: `sandbox`, `exec` and
//! `files` speak the HTTP API through [`client::Client`]; `key` works on the
//! daemon's database directly, on the host. This module holds what they
//! share: where the daemon is, which key to present, and how failures print.

pub mod client;
pub mod exec;
pub mod files;
pub mod image;
pub mod keys;
pub mod mcp;
pub mod node;
pub mod output;
pub mod sandbox;
pub mod snapshot;
pub mod template;
pub mod tty;
pub mod volume;

use clap::Args;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Where the daemon listens unless told otherwise.
pub const DEFAULT_URL: &str = "http://127.0.0.1:7700";
/// Where the daemon keeps its state unless told otherwise.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/hutch";

/// How to reach the daemon: shared by every subcommand that speaks HTTP.
#[derive(Args, Debug, Clone)]
pub struct ClientOpts {
    /// Base URL of the daemon's API (HUTCH_URL).
    #[arg(long, global = true, env = "HUTCH_URL", default_value = DEFAULT_URL)]
    pub url: String,
    /// API key (HUTCH_API_KEY); else the key in <state-dir>/admin.key.
    #[arg(long, global = true, env = "HUTCH_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The daemon's state directory, where admin.key lives (HUTCH_STATE_DIR).
    #[arg(long, global = true, env = "HUTCH_STATE_DIR", default_value = DEFAULT_STATE_DIR)]
    pub state_dir: PathBuf,
}

impl ClientOpts {
    /// A client for the configured daemon, or why there is none.
    pub fn client(&self) -> anyhow::Result<client::Client> {
        let key = resolve_key(self.api_key.as_deref(), &self.state_dir)?;
        Ok(client::Client::new(&self.url, &key))
    }
}

/// The API key to present: the one given, else the host's admin key file.
fn resolve_key(given: Option<&str>, state_dir: &Path) -> anyhow::Result<String> {
    if let Some(k) = given.map(str::trim).filter(|k| !k.is_empty()) {
        return Ok(k.to_owned());
    }
    let path = state_dir.join("admin.key");
    match std::fs::read_to_string(&path) {
        Ok(s) if !s.trim().is_empty() => Ok(s.trim().to_owned()),
        Ok(_) => anyhow::bail!("no API key: {} is empty; set HUTCH_API_KEY or pass --api-key", path.display()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => anyhow::bail!(
            "no API key: set HUTCH_API_KEY or pass --api-key (on the daemon's host, `hutch key create` makes one; \
             the daemon's admin key is in {})",
            path.display()
        ),
        Err(e) => anyhow::bail!("no API key: cannot read {}: {e}; set HUTCH_API_KEY or pass --api-key", path.display()),
    }
}

/// Prints a failure as `hutch: ...` and gives the exit code for it.
/// The resource flags of a sandbox or template.
#[derive(Args, Debug, Default)]
pub struct ResourceArgs {
    /// Memory limit: 512M, 1G, ...
    #[arg(long, value_parser = parse_mib, value_name = "SIZE")]
    pub memory: Option<u64>,
    /// CPUs worth of time (fractions allowed).
    #[arg(long)]
    pub vcpus: Option<f64>,
    /// Size of the writable layer: 2G, ...
    #[arg(long, value_parser = parse_mib, value_name = "SIZE")]
    pub disk: Option<u64>,
    /// Most processes and threads at once.
    #[arg(long)]
    pub pids: Option<u32>,
}

impl ResourceArgs {
    /// The API's `limits`, when any of its flags was given.
    pub fn limits(&self) -> Option<hutch_api::LimitsRequest> {
        (self.vcpus.is_some() || self.disk.is_some() || self.pids.is_some()).then_some(hutch_api::LimitsRequest {
            vcpus: self.vcpus,
            disk_mib: self.disk,
            pids: self.pids,
        })
    }
}

/// The egress flags of a sandbox or template: one policy, as the API's
/// `network` takes it.
#[derive(Args, Debug, Default)]
pub struct NetworkArgs {
    /// Egress policy: default (the internet, not the host), deny_all, private.
    #[arg(long, value_name = "EGRESS")]
    pub network: Option<String>,
    /// Only these are reachable: CIDR, address, name or *.name (repeatable).
    #[arg(long = "allow", value_name = "DEST")]
    pub allow: Vec<String>,
    /// Never reachable: CIDR, address, or name (repeatable).
    #[arg(long = "deny", value_name = "DEST")]
    pub deny: Vec<String>,
}

impl NetworkArgs {
    /// The policy the flags name; None when no flag was given.
    pub fn request(&self) -> anyhow::Result<Option<hutch_api::NetworkRequest>> {
        if self.network.is_none() && self.allow.is_empty() && self.deny.is_empty() {
            return Ok(None);
        }
        let egress = match self.network.as_deref().unwrap_or("default") {
            "default" => hutch_api::Egress::Default,
            "deny_all" | "none" => hutch_api::Egress::DenyAll,
            "private" => hutch_api::Egress::Private,
            other => anyhow::bail!("--network {other:?}: expected default, deny_all or private"),
        };
        Ok(Some(hutch_api::NetworkRequest { egress, allow: self.allow.clone(), deny: self.deny.clone() }))
    }
}

/// What a sandbox does at its expiry, for a sandbox or a template.
#[derive(Args, Debug, Default)]
pub struct LifecycleArgs {
    /// At expiry: delete (the default) or pause (to disk, files kept for
    /// --paused-ttl; a resume gives it its lifetime again).
    #[arg(long, value_name = "WHAT", value_parser = parse_on_expire)]
    pub on_expire: Option<hutch_api::OnExpire>,
    /// How long a sandbox paused at its expiry is kept: 1h, 7d, ... (7d
    /// when absent, at most 30d).
    #[arg(long, value_parser = parse_seconds, value_name = "DURATION")]
    pub paused_ttl: Option<u64>,
    /// Pause or end it (--on-idle) after this long with no API use and no
    /// command running: 10m, 1h, ...
    #[arg(long, value_parser = parse_seconds, value_name = "DURATION")]
    pub idle_timeout: Option<u64>,
    /// When idle: pause (the default) or delete.
    #[arg(long, value_name = "WHAT", value_parser = parse_on_idle)]
    pub on_idle: Option<hutch_api::OnIdle>,
}

fn parse_on_idle(s: &str) -> Result<hutch_api::OnIdle, String> {
    hutch_api::OnIdle::parse(s).ok_or_else(|| format!("{s:?}: expected pause or delete"))
}

fn parse_on_expire(s: &str) -> Result<hutch_api::OnExpire, String> {
    hutch_api::OnExpire::parse(s).ok_or_else(|| format!("{s:?}: expected delete or pause"))
}

/// `--storage`: where a sandbox's files live.
pub fn parse_storage(s: &str) -> Result<hutch_api::StorageKind, String> {
    hutch_api::StorageKind::parse(s).ok_or_else(|| format!("{s:?}: expected disk or memory"))
}

pub fn report(result: anyhow::Result<i32>, failure_code: i32) -> i32 {
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("hutch: {e:#}");
            failure_code
        }
    }
}

/// `K=V` pairs into a map; a later pair wins over an earlier one with the
/// same key.
pub fn parse_pairs(flag: &str, pairs: &[String]) -> anyhow::Result<BTreeMap<String, String>> {
    let mut map = BTreeMap::new();
    for p in pairs {
        match p.split_once('=') {
            Some((k, v)) if !k.is_empty() => {
                map.insert(k.to_owned(), v.to_owned());
            }
            _ => anyhow::bail!("{flag} {p:?}: expected KEY=VALUE"),
        }
    }
    Ok(map)
}

/// Whole seconds from a duration as `parse_duration` reads it, rounded up;
/// `0` is allowed here (it means "do not wait").
pub fn parse_seconds(s: &str) -> Result<u64, String> {
    if s.trim().trim_end_matches('s') == "0" {
        return Ok(0);
    }
    let d = crate::units::parse_duration(s)?;
    Ok(d.as_secs() + u64::from(d.subsec_nanos() > 0))
}

/// Whole MiB from a size as `parse_size` reads it, rounded up; sizes under
/// one MiB are refused because they are almost always a forgotten unit.
pub fn parse_mib(s: &str) -> Result<u64, String> {
    let bytes = crate::units::parse_size(s)?;
    if bytes < 1 << 20 {
        return Err(format!("{s:?} is {bytes} bytes; give a unit, as in {s}M or {s}G"));
    }
    Ok(bytes.div_ceil(1 << 20))
}

/// A fresh random UUID (version 4), for Idempotency-Key headers.
pub fn uuid_v4() -> std::io::Result<String> {
    let mut b = [0u8; 16];
    hutch_runtime::sys::random_bytes(&mut b)?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(format!("{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_parse_and_later_wins() {
        let m = parse_pairs("--env", &["A=1".into(), "B=x=y".into(), "A=2".into(), "C=".into()]).expect("pairs");
        assert_eq!(m.get("A").map(String::as_str), Some("2"));
        assert_eq!(m.get("B").map(String::as_str), Some("x=y"));
        assert_eq!(m.get("C").map(String::as_str), Some(""));
        assert!(parse_pairs("--env", &["NOEQUALS".into()]).is_err());
        assert!(parse_pairs("--meta", &["=v".into()]).is_err());
    }

    #[test]
    fn seconds_round_up_and_allow_zero() {
        assert_eq!(parse_seconds("10s"), Ok(10));
        assert_eq!(parse_seconds("1500ms"), Ok(2));
        assert_eq!(parse_seconds("2m"), Ok(120));
        assert_eq!(parse_seconds("0"), Ok(0));
        assert_eq!(parse_seconds("0s"), Ok(0));
        assert!(parse_seconds("soon").is_err());
    }

    #[test]
    fn mib_needs_a_unit() {
        assert_eq!(parse_mib("1G"), Ok(1024));
        assert_eq!(parse_mib("512M"), Ok(512));
        assert_eq!(parse_mib("1537k"), Ok(2));
        assert!(parse_mib("512").is_err());
    }

    #[test]
    fn uuids_are_version_4() {
        let u = uuid_v4().expect("uuid");
        assert_eq!(u.len(), 36);
        let parts: Vec<&str> = u.split('-').collect();
        assert_eq!(parts.iter().map(|p| p.len()).collect::<Vec<_>>(), [8, 4, 4, 4, 12]);
        assert!(parts[2].starts_with('4'));
        assert!(matches!(parts[3].chars().next(), Some('8' | '9' | 'a' | 'b')));
        assert_ne!(u, uuid_v4().expect("uuid"));
    }

    #[test]
    fn explicit_key_wins_and_missing_file_explains() {
        let dir = std::env::temp_dir().join(format!("hutch-cli-key-{}", std::process::id()));
        assert_eq!(resolve_key(Some(" k1 "), &dir).expect("key"), "k1");
        let err = resolve_key(None, &dir).expect_err("no key");
        assert!(format!("{err}").contains("HUTCH_API_KEY"));
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("admin.key"), "hutch_abc\n").expect("write");
        assert_eq!(resolve_key(None, &dir).expect("key"), "hutch_abc");
        assert_eq!(resolve_key(Some(""), &dir).expect("key"), "hutch_abc");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}

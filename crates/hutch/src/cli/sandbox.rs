//! `hutch sandbox ...`: create, list, inspect, extend, suspend, resume and
//! delete sandboxes of a running daemon.

use super::output::{self, table};
use super::{parse_pairs, parse_seconds, parse_storage, report, ClientOpts, LifecycleArgs, NetworkArgs, ResourceArgs};
use clap::{Args, Subcommand};
use hutch_api::{CreateSandbox, Extend, Sandbox};

#[derive(Args, Debug)]
pub struct SandboxArgs {
    #[command(flatten)]
    pub conn: ClientOpts,
    #[command(subcommand)]
    pub command: SandboxCommand,
}

#[derive(Subcommand, Debug)]
pub enum SandboxCommand {
    /// Create a sandbox and print it.
    Create(Box<CreateArgs>),
    /// List the sandboxes not yet terminated, newest first (every page,
    /// unless --limit or --cursor asks for one).
    #[command(visible_alias = "ls")]
    List {
        /// One page of this many sandboxes.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
        limit: Option<u32>,
        /// One page, after this cursor (from a previous page).
        #[arg(long)]
        cursor: Option<String>,
        /// Terminated sandboxes too.
        #[arg(long, short = 'a')]
        all: bool,
        /// Print JSON (a SandboxList).
        #[arg(long)]
        json: bool,
    },
    /// Show one sandbox.
    Get {
        id: String,
        /// Print JSON (a Sandbox).
        #[arg(long)]
        json: bool,
    },
    /// Delete sandboxes (their processes are killed and their files lost).
    #[command(visible_alias = "rm")]
    Delete {
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Push a sandbox's expiry later: `extend ID 10m` (as --by) or --until.
    Extend {
        id: String,
        /// Add this much to the current expiry: 10m, 1h, ... (as --by).
        #[arg(value_parser = parse_seconds, group = "how", value_name = "DURATION")]
        duration: Option<u64>,
        /// Add this much to the current expiry: 10m, 1h, ...
        #[arg(long, value_parser = parse_seconds, group = "how", value_name = "DURATION")]
        by: Option<u64>,
        /// Set the expiry to this time (RFC 3339, as 2030-01-02T15:04:05Z).
        #[arg(long, group = "how", value_name = "RFC3339")]
        until: Option<String>,
    },
    /// Freeze a sandbox's processes; its files and memory are kept.
    Suspend { id: String },
    /// Thaw a suspended sandbox.
    Resume { id: String },
    /// Give short-lived access to a TCP port of the sandbox: prints the url
    /// and the token to send in X-Hutch-Sandbox-Token.
    Access {
        id: String,
        /// The port inside the sandbox (1 to 65532).
        port: u32,
        /// How long the credential lives: 1s to 5m (the default).
        #[arg(long, value_parser = parse_seconds, value_name = "DURATION")]
        expires_in: Option<u64>,
        /// Print JSON (an AccessGrant).
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args, Debug)]
pub struct CreateArgs {
    /// Template name (the daemon's default, `base`, when absent).
    #[arg(long)]
    template: Option<String>,
    /// Lifetime from now: 10m, 1h, ... (the template's default when absent).
    #[arg(long, value_parser = parse_seconds, value_name = "DURATION")]
    ttl: Option<u64>,
    #[command(flatten)]
    res: ResourceArgs,
    /// Environment of every process in the sandbox (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V")]
    env: Vec<String>,
    /// A label returned as given (repeatable).
    #[arg(long = "meta", value_name = "K=V")]
    meta: Vec<String>,
    /// Wait up to this long for the sandbox to run (0 to 60s).
    #[arg(long, value_parser = parse_seconds, value_name = "DURATION")]
    wait: Option<u64>,
    #[command(flatten)]
    net: NetworkArgs,
    /// Where its files live: disk (the default where the host has disk
    /// storage) or memory (faster, counts toward --memory, gone with it).
    #[arg(long, value_name = "KIND", value_parser = parse_storage)]
    storage: Option<hutch_api::StorageKind>,
    /// Start from a snapshot (its id or name) instead of a template.
    #[arg(long, value_name = "SNAPSHOT", conflicts_with = "template")]
    snapshot: Option<String>,
    #[command(flatten)]
    life: LifecycleArgs,
    /// Mount a volume (its name or id) at a path under /workspace,
    /// /home/user, /mnt or /data; `:ro` mounts it read-only (repeatable).
    #[arg(long = "volume", short = 'v', value_name = "NAME:/PATH[:ro]", value_parser = super::volume::parse_mount)]
    volumes: Vec<hutch_api::VolumeMount>,
    /// Name one of your secrets (`hutch secret`, or POST /v1/secrets): the
    /// sandbox sees a placeholder in $NAME, the host injects the value into
    /// HTTPS requests to the secret's hosts (repeatable).
    #[arg(long = "secret", value_name = "NAME")]
    secrets: Vec<String>,
    /// Run it on this node of the fleet, whatever placement would pick
    /// (an admin key only).
    #[arg(long, value_name = "NAME")]
    node: Option<String>,
    /// Make the request safe to retry: the same key gives the same sandbox.
    #[arg(long)]
    idempotency_key: Option<String>,
    /// Print only the new sandbox's id.
    #[arg(long, short = 'q', conflicts_with = "json")]
    quiet: bool,
    /// Print JSON (a Sandbox).
    #[arg(long)]
    json: bool,
}

pub fn main(args: SandboxArgs) -> i32 {
    report(run(args), 1)
}

fn run(args: SandboxArgs) -> anyhow::Result<i32> {
    let client = args.conn.client()?;
    match args.command {
        SandboxCommand::Create(c) => {
            let req = create_request(&c)?;
            let sb = client.create_sandbox(&req, c.idempotency_key.as_deref())?;
            if c.quiet {
                println!("{}", sb.id);
            } else {
                show(&sb, c.json)?;
            }
            Ok(0)
        }
        SandboxCommand::List { limit, cursor, all, json } => {
            let live = !all;
            let mut page = client.list_sandboxes(limit, cursor.as_deref(), live)?;
            if limit.is_none() && cursor.is_none() {
                while let Some(next) = page.next_cursor.take() {
                    let more = client.list_sandboxes(limit, Some(&next), live)?;
                    page.sandboxes.extend(more.sandboxes);
                    page.next_cursor = more.next_cursor;
                }
            }
            if json {
                print!("{}", output::json(&page)?);
            } else {
                print!("{}", list_table(&page.sandboxes, output::now_ms()));
                if let Some(c) = &page.next_cursor {
                    eprintln!("(more sandboxes: --cursor {c})");
                }
            }
            Ok(0)
        }
        SandboxCommand::Get { id, json } => {
            show(&client.get_sandbox(&id)?, json)?;
            Ok(0)
        }
        SandboxCommand::Delete { ids } => {
            let mut code = 0;
            for id in &ids {
                match client.delete_sandbox(id) {
                    Ok(sb) => println!("{} {}", sb.id, sb.state.as_str()),
                    Err(e) => {
                        eprintln!("hutch: {id}: {e}");
                        code = 1;
                    }
                }
            }
            Ok(code)
        }
        SandboxCommand::Extend { id, duration, by, until } => {
            let req = extend_request(duration.or(by), until)?;
            let sb = client.extend_sandbox(&id, &req)?;
            println!("{} expires {} ({})", sb.id, sb.expires_at, output::expires(&sb.expires_at, output::now_ms()));
            Ok(0)
        }
        SandboxCommand::Suspend { id } => {
            let sb = client.suspend_sandbox(&id)?;
            println!("{} {}", sb.id, sb.state.as_str());
            Ok(0)
        }
        SandboxCommand::Resume { id } => {
            let sb = client.resume_sandbox(&id)?;
            println!("{} {}", sb.id, sb.state.as_str());
            Ok(0)
        }
        SandboxCommand::Access { id, port, expires_in, json } => {
            let req = hutch_api::CreateAccess {
                port: u16::try_from(port).ok().filter(|p| *p <= hutch_api::MAX_ACCESS_PORT).unwrap_or(0),
                expires_in_seconds: expires_in,
            };
            if req.port == 0 {
                anyhow::bail!(
                    "port must be 1 to {} (65533 and above are reserved), not {port}",
                    hutch_api::MAX_ACCESS_PORT
                );
            }
            let g = client.create_access(&id, &req)?;
            if json {
                print!("{}", output::json(&g)?);
            } else {
                println!("url         {}", g.url);
                println!("path_url    {}", g.path_url);
                println!("token       {}", g.token.as_deref().unwrap_or("-"));
                println!("expires_at  {} ({})", g.expires_at, output::expires(&g.expires_at, output::now_ms()));
                println!("(send the token as X-Hutch-Sandbox-Token, or POST it as the form field `token` to <url>_hutch/access)");
            }
            Ok(0)
        }
    }
}

/// The API request of `sandbox create`'s flags.
fn create_request(c: &CreateArgs) -> anyhow::Result<CreateSandbox> {
    let limits = c.res.limits();
    Ok(CreateSandbox {
        template: c.template.clone(),
        ttl_seconds: c.ttl,
        memory_mb: c.res.memory,
        limits,
        env: parse_pairs("--env", &c.env)?,
        metadata: parse_pairs("--meta", &c.meta)?,
        wait_seconds: c.wait,
        network: c.net.request()?,
        storage: c.storage,
        snapshot: c.snapshot.clone(),
        on_expire: c.life.on_expire,
        paused_ttl_seconds: c.life.paused_ttl,
        idle_timeout_seconds: c.life.idle_timeout,
        on_idle: c.life.on_idle,
        volumes: c.volumes.clone(),
        secrets: c.secrets.clone(),
        node: c.node.clone(),
    })
}

/// The API request of `sandbox extend`'s flags: exactly one of the two.
fn extend_request(by: Option<u64>, until: Option<String>) -> anyhow::Result<Extend> {
    match (by, until) {
        (Some(by), None) => Ok(Extend { by: Some(by), until: None }),
        (None, Some(until)) => {
            if output::parse_rfc3339(&until).is_none() {
                anyhow::bail!("--until {until:?}: expected an RFC 3339 time, as 2030-01-02T15:04:05Z");
            }
            Ok(Extend { by: None, until: Some(until) })
        }
        _ => anyhow::bail!("give --by DURATION or --until TIME"),
    }
}

fn show(sb: &Sandbox, json: bool) -> anyhow::Result<()> {
    if json {
        print!("{}", output::json(sb)?);
    } else {
        print!("{}", detail(sb, output::now_ms()));
    }
    Ok(())
}

/// Columns of `sandbox list`.
pub fn list_table(sbs: &[Sandbox], now_ms: i64) -> String {
    let rows: Vec<Vec<String>> = sbs
        .iter()
        .map(|s| {
            vec![
                s.id.clone(),
                s.state.as_str().to_owned(),
                s.template.clone(),
                crate::units::show_size(s.memory_mb << 20),
                format!("{}", s.limits.vcpus),
                crate::units::show_size(s.limits.disk_mib << 20),
                output::expires(&s.created_at, now_ms),
                if matches!(s.state, hutch_api::SandboxState::Terminated) {
                    "-".to_owned()
                } else {
                    output::expires(&s.expires_at, now_ms)
                },
            ]
        })
        .collect();
    table(&["ID", "STATE", "TEMPLATE", "MEMORY", "VCPUS", "DISK", "CREATED", "EXPIRES"], &rows)
}

/// Every field of one sandbox, one per line.
pub fn detail(sb: &Sandbox, now_ms: i64) -> String {
    let mut rows = vec![
        vec!["id".to_owned(), sb.id.clone()],
        vec!["state".to_owned(), sb.state.as_str().to_owned()],
        vec!["template".to_owned(), sb.template.clone()],
        vec!["created".to_owned(), format!("{} ({})", sb.created_at, output::expires(&sb.created_at, now_ms))],
        vec!["expires".to_owned(), format!("{} ({})", sb.expires_at, output::expires(&sb.expires_at, now_ms))],
        vec!["memory".to_owned(), crate::units::show_size(sb.memory_mb << 20)],
        vec!["vcpus".to_owned(), format!("{}", sb.limits.vcpus)],
        vec!["disk".to_owned(), crate::units::show_size(sb.limits.disk_mib << 20)],
        vec!["pids".to_owned(), sb.limits.pids.to_string()],
        vec!["limits".to_owned(), sb.limits.applied.clone()],
    ];
    if let Some(code) = &sb.last_error_code {
        rows.push(vec!["last error".to_owned(), code.clone()]);
    }
    for (k, v) in &sb.metadata {
        rows.push(vec![format!("meta {k}"), v.clone()]);
    }
    let t = table(&["", ""], &rows);
    // The header row of two empty cells is a blank line: drop it.
    t.split_once('\n').map(|(_, rest)| rest.to_owned()).unwrap_or(t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use hutch_api::{Limits, SandboxState};

    #[derive(Parser)]
    struct T {
        #[command(subcommand)]
        c: SandboxCommand,
    }

    fn sandbox(id: &str, state: SandboxState) -> Sandbox {
        Sandbox {
            id: id.into(),
            template: "base".into(),
            class: hutch_api::Class::Container,
            state,
            created_at: "2023-11-14T22:03:20Z".into(),
            expires_at: "2023-11-14T22:23:20Z".into(),
            memory_mb: 1024,
            limits: Limits { vcpus: 0.5, disk_mib: 2048, pids: 512, applied: "enforced".into() },
            metadata: [("team".to_owned(), "ci".to_owned())].into(),
            last_error_code: None,
            warm: false,
            template_id: None,
            template_version: None,
            network: Default::default(),
            owner: "key-000000000001".into(),
            storage: hutch_api::StorageKind::Disk,
            snapshot: None,
            on_expire: hutch_api::OnExpire::Delete,
            paused_ttl_seconds: 604_800,
            idle_timeout_seconds: None,
            on_idle: None,
            idle_since: None,
            volumes: Vec::new(),
            node: "local".into(),
            reason: None,
        }
    }

    #[test]
    fn create_flags_become_the_request() {
        let t = T::try_parse_from([
            "x",
            "create",
            "--template",
            "py",
            "--ttl",
            "10m",
            "--memory",
            "1G",
            "--disk",
            "2G",
            "--pids",
            "256",
            "--env",
            "A=1",
            "--meta",
            "team=ci",
            "--wait",
            "0",
            "--on-expire",
            "pause",
            "--paused-ttl",
            "2d",
        ])
        .expect("parse");
        let SandboxCommand::Create(c) = t.c else { panic!("not create") };
        let req = create_request(&c).expect("request");
        assert_eq!((req.on_expire, req.paused_ttl_seconds), (Some(hutch_api::OnExpire::Pause), Some(172_800)));
        assert!(T::try_parse_from(["x", "create", "--on-expire", "nap"]).is_err());
        assert_eq!(req.template.as_deref(), Some("py"));
        assert_eq!(req.ttl_seconds, Some(600));
        assert_eq!(req.memory_mb, Some(1024));
        assert_eq!(req.wait_seconds, Some(0));
        assert_eq!(req.limits, Some(hutch_api::LimitsRequest { vcpus: None, disk_mib: Some(2048), pids: Some(256) }));
        assert_eq!(req.env.get("A").map(String::as_str), Some("1"));
        assert_eq!(req.metadata.get("team").map(String::as_str), Some("ci"));
        let bare = T::try_parse_from(["x", "create"]).expect("parse");
        let SandboxCommand::Create(c) = bare.c else { panic!("not create") };
        assert_eq!(create_request(&c).expect("request"), CreateSandbox::default());
        assert!(T::try_parse_from(["x", "create", "--memory", "512"]).is_err());
        assert!(T::try_parse_from(["x", "create", "--env", "NOPE"])
            .map(|t| match t.c {
                SandboxCommand::Create(c) => create_request(&c).is_err(),
                _ => false,
            })
            .unwrap_or(false));
    }

    #[test]
    fn extend_takes_exactly_one_of_by_and_until() {
        assert!(T::try_parse_from(["x", "extend", "sb-1", "--by", "10m", "--until", "2030-01-01T00:00:00Z"]).is_err());
        let t = T::try_parse_from(["x", "extend", "sb-1", "--by", "10m"]).expect("parse");
        let SandboxCommand::Extend { by, until, .. } = t.c else { panic!("not extend") };
        assert_eq!(extend_request(by, until).expect("req"), Extend { by: Some(600), until: None });
        // The duration may come bare, as `hutch sandbox extend ID 5m`.
        let t = T::try_parse_from(["x", "extend", "sb-1", "5m"]).expect("parse");
        let SandboxCommand::Extend { duration, by, until, .. } = t.c else { panic!("not extend") };
        assert_eq!(extend_request(duration.or(by), until).expect("req"), Extend { by: Some(300), until: None });
        assert!(T::try_parse_from(["x", "extend", "sb-1", "5m", "--by", "1m"]).is_err());
        assert!(T::try_parse_from(["x", "extend", "sb-1", "soon"]).is_err());
        assert!(extend_request(None, Some("next week".into())).is_err());
        assert!(extend_request(None, None).is_err());
        let e = extend_request(None, Some("2030-01-01T00:00:00Z".into())).expect("req");
        assert_eq!(e.until.as_deref(), Some("2030-01-01T00:00:00Z"));
    }

    #[test]
    fn list_table_shows_one_aligned_row_per_sandbox() {
        let now = 1_700_000_000_000; // 2023-11-14T22:13:20Z
        let t = list_table(&[sandbox("sb-1", SandboxState::Running), sandbox("sb-22", SandboxState::Terminated)], now);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "ID     STATE       TEMPLATE  MEMORY  VCPUS  DISK  CREATED  EXPIRES");
        assert_eq!(lines[1], "sb-1   running     base      1G      0.5    2G    10m ago  in 10m");
        assert_eq!(lines[2], "sb-22  terminated  base      1G      0.5    2G    10m ago  -");
    }

    #[test]
    fn detail_lists_fields_and_metadata() {
        let d = detail(&sandbox("sb-1", SandboxState::Running), 1_700_000_000_000);
        assert!(d.starts_with("id         sb-1\nstate      running\n"), "{d}");
        assert!(d.contains("expires    2023-11-14T22:23:20Z (in 10m)\n"), "{d}");
        assert!(d.contains("meta team  ci\n"), "{d}");
    }
}

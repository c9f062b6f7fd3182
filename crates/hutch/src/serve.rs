//! `hutch serve`: the daemon. Opens (or creates) the state directory and
//! its database, makes an admin key on first start, takes charge of the
//! sandboxes an earlier run left, runs the reconciler, and serves the API
//! until SIGTERM or SIGINT. Sandboxes outlive it.

use anyhow::{Context, Result};
use clap::Args;
use hutch_control::Control;
use hutch_store::{PgStore, SqliteStore, Store};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// How long in-flight requests may run on after SIGTERM.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Default address of the API.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:7700";

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on (HUTCH_LISTEN).
    #[arg(long, env = "HUTCH_LISTEN", default_value = DEFAULT_LISTEN)]
    pub listen: String,
    /// Directory for the database, keys and root filesystems (HUTCH_STATE_DIR).
    #[arg(long, env = "HUTCH_STATE_DIR", default_value = "/var/lib/hutch")]
    pub state_dir: PathBuf,
    /// The database: a `postgres://` URL for PostgreSQL (which daemons may
    /// share), e.g. `postgres://hutch@%2Fvar%2Frun%2Fpostgresql/hutch` over
    /// a unix socket; without TLS, so over a socket, localhost or a
    /// trusted network. Default: SQLite in <state-dir>/hutch.db
    /// (HUTCH_DATABASE).
    #[arg(long, env = "HUTCH_DATABASE", value_name = "URL", hide_env_values = true)]
    pub database: Option<String>,
    /// This daemon's name among the nodes sharing the database: 1 to 63 of
    /// `a-z0-9-._`. It acts only on the sandboxes of its node. Default:
    /// the host name (HUTCH_NODE).
    #[arg(long, env = "HUTCH_NODE", value_name = "NAME")]
    pub node: Option<String>,
    /// The URL other nodes and clients reach this daemon's API at.
    /// Default: http://<--listen> (HUTCH_ADVERTISE).
    #[arg(long, env = "HUTCH_ADVERTISE", value_name = "URL")]
    pub advertise: Option<String>,
    /// Time between the node's heartbeats in the database (HUTCH_HEARTBEAT).
    #[arg(long, env = "HUTCH_HEARTBEAT", default_value = "5s", value_parser = crate::units::parse_duration)]
    pub heartbeat: Duration,
    /// A file holding the fleet's shared secret (32 or more visible ASCII
    /// characters, the same on every node): requests one node forwards to
    /// another are signed with it, so the owner node trusts the client
    /// address they vouch for. Without it forwarding still works, unsigned
    /// (HUTCH_FLEET_SECRET_FILE).
    #[arg(long, env = "HUTCH_FLEET_SECRET_FILE", value_name = "PATH")]
    pub fleet_secret_file: Option<std::path::PathBuf>,
    /// How long another node may stay silent (no heartbeat) before this
    /// one declares it lost: its running sandboxes become `lost`. At least
    /// twice --heartbeat (HUTCH_NODE_LOST_AFTER).
    #[arg(long, env = "HUTCH_NODE_LOST_AFTER", default_value = "30s", value_parser = crate::units::parse_duration)]
    pub node_lost_after: Duration,
    /// The fleet's OCI registry (any Distribution-compatible one), as
    /// `http[s]://host[:port][/prefix]`: snapshots and sandboxes paused to
    /// disk are pushed there, so that another node starts them. Plain HTTP
    /// to loopback only, unless --registry-insecure; anonymous or token
    /// access. Empty: none, as when not given (HUTCH_REGISTRY).
    #[arg(long, env = "HUTCH_REGISTRY", value_name = "URL")]
    pub registry: Option<String>,
    /// Allow plain HTTP to a --registry that is not on loopback (a trusted
    /// network only) (HUTCH_REGISTRY_INSECURE).
    #[arg(long, env = "HUTCH_REGISTRY_INSECURE")]
    pub registry_insecure: bool,
    /// The isolation class of the builtin templates (`base`, the code
    /// interpreter's) and of a template that names none: `container`,
    /// `gvisor` or `process`; the daemon refuses to start when this host
    /// does not run it. Templates that name a class keep theirs
    /// (HUTCH_DEFAULT_CLASS).
    #[arg(long, env = "HUTCH_DEFAULT_CLASS", default_value = "container", value_parser = parse_class)]
    pub default_class: hutch_api::Class,
    /// Which hutch network of this host to use, 0 to 31: its own subnet
    /// 100.(96+N).0.0/16, nftables table and links, for daemons side by
    /// side (HUTCH_NET_INSTANCE).
    #[arg(long, env = "HUTCH_NET_INSTANCE", default_value_t = 0)]
    pub net_instance: u8,
    /// Resolvers the sandboxes' queries go to, comma-separated (the
    /// host's /etc/resolv.conf when absent) (HUTCH_DNS_UPSTREAM).
    #[arg(long, env = "HUTCH_DNS_UPSTREAM", value_delimiter = ',')]
    pub dns_upstream: Vec<String>,
    /// IPv6 for sandboxes: on, off, or auto (on when the host has a
    /// default route) (HUTCH_NET_IPV6).
    #[arg(long, env = "HUTCH_NET_IPV6", default_value = "auto")]
    pub ipv6: String,
    /// Client connections at once; lowered to fit the open-file limit with
    /// a reserve for sandbox work (HUTCH_MAX_CONNECTIONS).
    #[arg(long, env = "HUTCH_MAX_CONNECTIONS", default_value_t = 16384,
          value_parser = clap::value_parser!(u32).range(2..))]
    pub max_connections: u32,
    /// Connections one client address (an IPv6 /64) may hold before any
    /// request on them authenticated; one more closes its oldest
    /// (HUTCH_MAX_CLIENT_CONNECTIONS).
    #[arg(long, env = "HUTCH_MAX_CLIENT_CONNECTIONS", default_value_t = 256,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_client_connections: u32,
    /// Time a client has to send a request's head, from the connection or
    /// from its first byte after an idle pause (HUTCH_HEADER_TIMEOUT).
    #[arg(long, env = "HUTCH_HEADER_TIMEOUT", default_value = "10s", value_parser = crate::units::parse_duration)]
    pub header_timeout: Duration,
    /// Time a connection may stay idle between requests; streams and
    /// WebSockets are never idle while their request runs (HUTCH_IDLE_TIMEOUT).
    /// Longer than clients keep idle connections in their pools (300 s in
    /// E2B's Python SDK, 90 s in Go and reqwest), so that a client never
    /// sends a request on a connection the daemon is closing at that moment.
    #[arg(long, env = "HUTCH_IDLE_TIMEOUT", default_value = "600s", value_parser = crate::units::parse_duration)]
    pub idle_timeout: Duration,
    /// Ended sandboxes' cgroups kept for the next sandboxes, at most
    /// (HUTCH_KEPT_CGROUPS; 0 keeps none). A new memory cgroup, and above
    /// all removing one, costs more the more file systems the host mounts;
    /// a kept one is renamed instead. Each holds what its sandbox's cgroup
    /// held in the kernel until it is used or, idle for 30 s, removed.
    /// cgroup v1 hosts only (v2 cannot rename a cgroup).
    #[arg(long, env = "HUTCH_KEPT_CGROUPS", default_value_t = 4096)]
    pub kept_cgroups: usize,
    /// How far the sandboxes' memory and disk limits may add up past the
    /// host's memory and the state directory's file system: 8 lets the
    /// limits of the sandboxes alive sum to 8 times the host's memory
    /// (HUTCH_OVERCOMMIT). One sandbox never gets more than the host has.
    #[arg(long, env = "HUTCH_OVERCOMMIT", default_value_t = hutch_control::control::DEFAULT_OVERCOMMIT)]
    pub overcommit: f64,
    /// Most sandboxes (not terminated, warm ones included) at once
    /// (HUTCH_MAX_SANDBOXES).
    #[arg(long, env = "HUTCH_MAX_SANDBOXES", default_value_t = hutch_control::control::DEFAULT_MAX_SANDBOXES)]
    pub max_sandboxes: u64,
    /// The domain of the E2B API's sandbox host names: a name whose
    /// subdomains all lead to this daemon (a wildcard DNS record), with a
    /// port when clients must name one, e.g. `sbx.example.com` or
    /// `e2b.localhost:7700`. The E2B API answers it as the sandboxes'
    /// `domain`, and `<port>-<sandbox>.<domain>` reaches a sandbox's port
    /// (HUTCH_E2B_DOMAIN). Without it, no port is served by E2B host name.
    #[arg(long, env = "HUTCH_E2B_DOMAIN")]
    pub e2b_domain: Option<String>,
    /// Registries (`host[:port]`, comma-separated; `docker.io` for Docker
    /// Hub) that E2B template builds may pull `from_image` from, as the
    /// daemon: each build's image is pulled for its key alone. None by
    /// default: a pull is a request from the host to where the key says
    /// (HUTCH_E2B_REGISTRIES).
    #[arg(long, env = "HUTCH_E2B_REGISTRIES", value_delimiter = ',')]
    pub e2b_registries: Vec<String>,
    /// A file holding a token (at least 16 characters) that reads
    /// `/metrics` and nothing else, as `Authorization: Bearer <token>`, for
    /// a scraper without an API key (HUTCH_METRICS_TOKEN_FILE).
    #[arg(long, env = "HUTCH_METRICS_TOKEN_FILE", value_name = "PATH")]
    pub metrics_token_file: Option<std::path::PathBuf>,
    /// Size of the storage image holding the sandboxes' disk layers, made
    /// under <state-dir>/storage when the state directory is not on btrfs
    /// (sparse: it takes host disk only as layers fill it); a larger size
    /// grows an existing image, a smaller one is ignored. Default: 64G, or
    /// the free space if less (HUTCH_STORAGE_SIZE).
    #[arg(long, env = "HUTCH_STORAGE_SIZE", value_parser = crate::units::parse_size)]
    pub storage_size: Option<u64>,
    /// The egress proxy's port on the sandboxes' gateway address, where the
    /// HTTPS of sandboxes that name secrets is redirected
    /// (HUTCH_EGRESS_PORT).
    #[arg(long, env = "HUTCH_EGRESS_PORT", default_value_t = hutch_runtime::net::EGRESS_PORT)]
    pub egress_port: u16,
    /// PEM files of CA certificates the egress proxy trusts upstream
    /// besides Mozilla's roots, comma-separated, e.g. a company's own CA
    /// (HUTCH_EGRESS_EXTRA_ROOTS).
    #[arg(long, env = "HUTCH_EGRESS_EXTRA_ROOTS", value_delimiter = ',')]
    pub egress_extra_roots: Vec<PathBuf>,
    /// How long the audit log keeps a call, e.g. `90d` or `12h`; older rows
    /// are pruned hourly (HUTCH_AUDIT_RETENTION).
    #[arg(long, env = "HUTCH_AUDIT_RETENTION", default_value = "90d", value_parser = crate::units::parse_duration)]
    pub audit_retention: Duration,
    /// How long events are kept, e.g. `7d`; older ones (and finished
    /// webhook deliveries) are pruned hourly (HUTCH_EVENT_RETENTION).
    #[arg(long, env = "HUTCH_EVENT_RETENTION", default_value = "7d", value_parser = crate::units::parse_duration)]
    pub event_retention: Duration,
    /// How long the record of an ended sandbox is kept (its state, reason
    /// and limits, for `GET /v1/sandboxes/{id}` and listings), e.g. `7d`;
    /// older ones are pruned hourly. Usage totals and events are kept
    /// apart (HUTCH_SANDBOX_RETENTION).
    #[arg(long, env = "HUTCH_SANDBOX_RETENTION", default_value = "7d", value_parser = crate::units::parse_duration)]
    pub sandbox_retention: Duration,
    /// How long before a sandbox's expiry `sandbox.expiring` is emitted
    /// (HUTCH_EXPIRING_NOTICE).
    #[arg(long, env = "HUTCH_EXPIRING_NOTICE", default_value = "60s", value_parser = crate::units::parse_duration)]
    pub expiring_notice: Duration,
    /// Address ranges (`CIDR,...`) webhooks may reach over plain http://
    /// (and loopback, this host's and private addresses, which are refused
    /// otherwise). Link-local and cloud metadata addresses and the sandbox
    /// networks are never reached (HUTCH_WEBHOOK_ALLOW_HTTP).
    #[arg(long, env = "HUTCH_WEBHOOK_ALLOW_HTTP", value_name = "CIDR,...", default_value = "",
          value_parser = parse_cidrs)]
    pub webhook_allow_http: CidrList,
    /// Most webhooks one key may have (HUTCH_WEBHOOK_MAX).
    #[arg(long, env = "HUTCH_WEBHOOK_MAX", default_value_t = 16)]
    pub webhook_max: u64,
    /// The first retry's wait of a failed webhook delivery; each next one
    /// doubles it, up to an hour, for a day (HUTCH_WEBHOOK_RETRY_BASE).
    #[arg(long, env = "HUTCH_WEBHOOK_RETRY_BASE", default_value = "10s", value_parser = crate::units::parse_duration)]
    pub webhook_retry_base: Duration,
    /// Keep idle CPUs polling instead of halting while API calls run and
    /// for this long after the last one, e.g. `20ms` (a PM QoS request,
    /// /dev/cpu_dma_latency): fewer slow wakeups on the way of a command,
    /// for CPU time spent polling. Off by default (HUTCH_WAKE_HOLD).
    #[arg(long, env = "HUTCH_WAKE_HOLD", value_parser = crate::units::parse_duration)]
    pub wake_hold: Option<Duration>,
    /// Emit no events (to measure what the event path costs).
    #[arg(long, hide = true)]
    pub no_events: bool,
}

/// An isolation class by its name.
fn parse_class(name: &str) -> std::result::Result<hutch_api::Class, String> {
    hutch_api::Class::parse(name).ok_or_else(|| {
        let names: Vec<&str> = hutch_api::Class::ALL.iter().map(|c| c.as_str()).collect();
        format!("must be one of {}", names.join(", "))
    })
}

/// The daemon's store, chosen by `--database`'s scheme: PostgreSQL for a
/// `postgres://` (or `postgresql://`) URL, else SQLite in the state
/// directory. The URL is never printed (it may hold a password).
pub fn open_store(database: Option<&str>, state_dir: &Path) -> Result<Arc<dyn Store>> {
    match database.filter(|d| !d.is_empty()) {
        None => {
            let db = state_dir.join("hutch.db");
            Ok(Arc::new(SqliteStore::open_checkpointing(&db).with_context(|| format!("open {}", db.display()))?))
        }
        Some(url) if is_postgres_url(url) => {
            let store = PgStore::open(url).context("open the PostgreSQL database of --database (HUTCH_DATABASE)")?;
            tracing::info!("state in PostgreSQL (--database)");
            Ok(Arc::new(store))
        }
        Some(_) => anyhow::bail!(
            "--database (HUTCH_DATABASE) must be a postgres:// or postgresql:// URL; leave it out for SQLite in the \
             state directory"
        ),
    }
}

/// `--node`, or the host name (lowercased): checked.
pub fn node_name(given: Option<&str>) -> Result<String> {
    let name = match given.filter(|n| !n.is_empty()) {
        Some(n) => n.to_owned(),
        None => std::fs::read_to_string("/proc/sys/kernel/hostname")
            .context("read the host name (or give --node)")?
            .trim()
            .to_ascii_lowercase(),
    };
    if !hutch_control::nodes::valid_name(&name) {
        anyhow::bail!("node name {name:?}: use 1 to 63 of a-z0-9-._, starting with a letter or digit (--node)");
    }
    Ok(name)
}

/// Whether `--database` names PostgreSQL.
pub fn is_postgres_url(url: &str) -> bool {
    ["postgres://", "postgresql://"].iter().any(|p| url.get(..p.len()).is_some_and(|s| s.eq_ignore_ascii_case(p)))
}

/// `--webhook-allow-http`'s ranges.
#[derive(Debug, Clone, Default)]
pub struct CidrList(pub Vec<hutch_control::webhooks::Cidr>);

fn parse_cidrs(s: &str) -> Result<CidrList, String> {
    hutch_control::webhooks::Cidr::parse_list(s).map(CidrList)
}

/// How often the audit log is pruned.
const AUDIT_PRUNE_EVERY: Duration = Duration::from_secs(3600);

/// Warm network namespaces kept ready.
const NET_POOL: usize = 8;

/// The egress proxy: its CA (made at first start, key 0600), the bundle
/// sandboxes that name secrets trust, and its listener on the gateway.
async fn start_egress(
    args: &ServeArgs,
    net: &hutch_runtime::net::Network,
) -> anyhow::Result<(Arc<hutch_server::egress::Egress>, tokio::net::TcpListener, PathBuf)> {
    use hutch_server::egress;
    let dir = args.state_dir.join("egress");
    let ca = egress::Ca::load_or_create(&dir).context("the egress proxy's CA")?;
    let bundle = egress::write_bundle(&dir, &ca).context("the sandboxes' CA bundle")?;
    let roots = egress::upstream_roots(&args.egress_extra_roots).context("--egress-extra-roots")?;
    let proxy = Arc::new(egress::Egress::new(ca, roots)?);
    let addr = std::net::SocketAddrV4::new(net.config().gateway4(), net.config().egress_port);
    // The gateway address lives on the host end of each veth: bind before
    // the first one exists.
    let listener = hutch_runtime::net::listen_tcp_freebind(addr)
        .and_then(tokio::net::TcpListener::from_std)
        .with_context(|| format!("listen on {addr}"))?;
    tracing::info!("egress proxy listening on {addr}");
    Ok((proxy, listener, bundle))
}

/// Prepares sandbox networking; on failure, says why (the daemon then runs
/// `deny_all` sandboxes only).
async fn setup_network(
    args: &ServeArgs,
    node: &str,
    run_dir: &std::path::Path,
    store: &Arc<dyn Store>,
    held: Arc<hutch_runtime::net::InstanceLock>,
) -> std::result::Result<Arc<hutch_runtime::net::Network>, String> {
    use hutch_runtime::net::{NetConfig, Network};
    let mut cfg = NetConfig::new(run_dir, args.net_instance);
    cfg.egress_port = args.egress_port;
    if !args.dns_upstream.is_empty() {
        let mut ups = Vec::new();
        for u in &args.dns_upstream {
            let addr = u
                .parse::<std::net::SocketAddr>()
                .or_else(|_| u.parse::<std::net::IpAddr>().map(|ip| std::net::SocketAddr::new(ip, 53)))
                .map_err(|_| format!("--dns-upstream {u:?} is not an address"))?;
            ups.push(addr);
        }
        cfg.upstream_dns = ups;
    }
    cfg.ipv6 = match args.ipv6.as_str() {
        "on" | "1" | "true" => Some(true),
        "off" | "0" | "false" => Some(false),
        _ => None,
    };
    // Links of sandboxes that outlived the last daemon stay (this node's:
    // others' are on their own hosts, or instances).
    let keep = store
        .sandboxes_on(Some(node), &hutch_control::lifecycle::HOLDING_STATES)
        .map_err(|e| e.to_string())?
        .iter()
        .filter_map(|r| {
            let n = hutch_control::network::NetRecord::parse(&r.network);
            n.host_if.map(|h| (h, n.index))
        })
        .collect();
    let net = tokio::task::spawn_blocking(move || Network::setup(cfg, &keep, &held))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    let net = Arc::new(net);
    // Networks the host joins later are special as soon as it is on them.
    net.follow_host(|r| match r {
        Ok(()) => tracing::info!("the host's networks changed; the sandboxes' rules follow"),
        Err(e) => tracing::warn!("cannot follow the host's networks: {e}"),
    })
    .map_err(|e| format!("follow the host's networks: {e}"))?;
    let learned_store = store.clone();
    let on_admit: hutch_control::dns::OnAdmit = Arc::new(move |id: &str, addrs: &[std::net::IpAddr]| {
        let json = serde_json::to_string(addrs).unwrap_or_else(|_| "[]".into());
        if let Err(e) = learned_store.set_net_learned(id, &json) {
            tracing::warn!("sandbox {id}: cannot store resolved addresses: {e}");
        }
    });
    hutch_control::dns::serve(net.clone(), on_admit.clone())
        .await
        .map_err(|e| format!("start the sandboxes' resolver: {e}"))?;
    let filler = net.clone();
    tokio::spawn(async move {
        let mut expired_at = std::time::Instant::now();
        loop {
            // Resolved addresses leave when their answers expire.
            if expired_at.elapsed() >= Duration::from_secs(1) {
                expired_at = std::time::Instant::now();
                let (f, on_admit) = (filler.clone(), on_admit.clone());
                let _ = tokio::task::spawn_blocking(move || {
                    for id in f.expire(std::time::Instant::now()) {
                        on_admit(&id, &f.learned(&id));
                    }
                })
                .await;
            }
            // The host's rules must stay loaded: put them back at once if
            // someone flushed them.
            let f = filler.clone();
            match tokio::task::spawn_blocking(move || f.heal()).await {
                Ok(Ok(false)) => tracing::warn!("the sandboxes' nftables table was gone; loaded it again"),
                Ok(Err(e)) => tracing::warn!("cannot load the sandboxes' nftables table again: {e}"),
                _ => {}
            }
            // Namespaces released beyond what creates took back go a few
            // at a time once the pool is idle (deleting links is slow with
            // many alive; see `Network::trim_pool`).
            let f = filler.clone();
            let _ = tokio::task::spawn_blocking(move || f.trim_pool(std::time::Instant::now())).await;
            if filler.pooled() < NET_POOL {
                let f = filler.clone();
                if let Ok(Err(e)) = tokio::task::spawn_blocking(move || f.fill_pool(NET_POOL)).await {
                    tracing::warn!("network pool: {e}");
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    Ok(net)
}

/// The key of the E2B API's sandbox access tokens: 32 random bytes in
/// `<state>/e2b.secret` (mode 0600), made on first start. Deleting it
/// revokes every token at the next start.
/// A token or secret read from the file a flag names: `min` or more
/// visible ASCII characters, surrounding white space dropped.
fn secret_file(flag: &str, path: Option<&std::path::Path>, min: usize) -> Result<Option<String>> {
    let Some(path) = path else { return Ok(None) };
    let text = std::fs::read_to_string(path).with_context(|| format!("read {flag} {}", path.display()))?;
    let token = text.trim();
    if token.len() < min || !token.bytes().all(|b| b.is_ascii_graphic()) {
        anyhow::bail!("{flag} {}: it must hold {min} or more visible ASCII characters", path.display());
    }
    Ok(Some(token.to_owned()))
}

fn e2b_secret(state_dir: &std::path::Path) -> Result<Vec<u8>> {
    let path = state_dir.join("e2b.secret");
    match std::fs::read_to_string(&path) {
        Ok(text) => return hex::decode(text.trim()).with_context(|| format!("{} is not hex", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("read {}", path.display())),
    }
    let mut raw = [0u8; 32];
    hutch_runtime::sys::random_bytes(&mut raw)?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("write {}", path.display()))?;
    writeln!(f, "{}", hex::encode(raw))?;
    Ok(raw.to_vec())
}

/// Logs go to stderr as JSON lines (`RUST_LOG` filters them; `info` by
/// default, but errors only from the MCP library, which logs every
/// session's handshake and notifications at `info`, and a client's probe
/// for a protocol revision we do not offer as a warning).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,rmcp=error"));
    let _ = tracing_subscriber::fmt()
        .json()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .flatten_event(true)
        .with_current_span(false)
        .try_init();
}

pub fn main(args: ServeArgs) -> i32 {
    init_logging();
    // Before any thread or sandbox: sandboxes get the limit we started with
    // back (hutch_runtime::sys::workload_nofile).
    let nofile = match hutch_runtime::sys::raise_nofile() {
        Ok((soft, _)) => soft,
        Err(e) => {
            tracing::warn!("cannot read or raise the open-file limit: {e}");
            1024
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("hutch serve: {e}");
            return 1;
        }
    };
    match rt.block_on(serve(args, nofile)) {
        Ok(()) => 0,
        Err(e) => {
            tracing::error!("{e:#}");
            1
        }
    }
}

/// The fleet's registry from `--registry`: none when not given or empty
/// (the deployments pass an empty `HUTCH_REGISTRY` for none).
fn registry_target(url: Option<&str>, insecure: bool) -> Result<Option<hutch_runtime::image::push::Target>> {
    url.map(str::trim)
        .filter(|u| !u.is_empty())
        .map(|u| hutch_runtime::image::push::Target::parse(u, insecure).map_err(|e| anyhow::anyhow!("--registry: {e}")))
        .transpose()
}

/// Makes the admin key of an empty database and writes its secret to
/// `admin.key` in the state directory (mode 0600). Of daemons starting
/// together on one empty database, one makes it (`insert_first_key`);
/// the others say whose it is.
fn make_admin_key(store: &dyn hutch_store::Store, state_dir: &std::path::Path) -> Result<()> {
    let key = hutch_control::keys::generate("admin", true, false, hutch_store::Quotas::default())?;
    if !store.insert_first_key(&key.record)? {
        let first = store.list_keys()?.into_iter().find(|k| k.admin && k.revoked_at.is_none());
        tracing::info!(
            "another node made the admin API key first ({}); its secret is in that node's admin.key",
            first.map_or_else(|| "it is no longer live".to_owned(), |k| format!("key {}", k.id))
        );
        return Ok(());
    }
    let path = state_dir.join("admin.key");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("write {}", path.display()))?;
    writeln!(f, "{}", key.secret)?;
    tracing::info!("created the admin API key; it is in {} (mode 0600)", path.display());
    Ok(())
}

/// Runs `prune` with `retention` at start and then every
/// `AUDIT_PRUNE_EVERY`, logging what it removed.
fn spawn_pruner<F, Fut>(what: &'static str, retention: Duration, prune: F)
where
    F: Fn(Duration) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = hutch_control::error::Result<u64>> + Send,
{
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(AUDIT_PRUNE_EVERY);
        loop {
            tick.tick().await;
            match prune(retention).await {
                Ok(0) => {}
                Ok(n) => tracing::info!("{what}: pruned {n} older than {retention:?}"),
                Err(e) => tracing::warn!("{what} prune: {e}"),
            }
        }
    });
}

async fn serve(args: ServeArgs, nofile: u64) -> Result<()> {
    // The network instance is this daemon's alone, for its whole life:
    // another live daemon holding it means this one must not start (it
    // would sweep the other's links and rules).
    if let Some(size) = args.storage_size.filter(|s| *s < hutch_runtime::storage::MIN_SIZE) {
        anyhow::bail!(
            "--storage-size {size} is below the storage image's minimum of {} MiB",
            hutch_runtime::storage::MIN_SIZE >> 20
        );
    }
    if args.net_instance >= hutch_runtime::net::MAX_INSTANCES {
        anyhow::bail!("--net-instance must be below {}", hutch_runtime::net::MAX_INSTANCES);
    }
    let instance = Arc::new(hutch_runtime::net::InstanceLock::acquire(args.net_instance)?);
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&args.state_dir)
        .with_context(|| format!("create state directory {}", args.state_dir.display()))?;
    let node = node_name(args.node.as_deref())?;
    hutch_control::fleet::check_lost_after(args.node_lost_after, args.heartbeat).map_err(anyhow::Error::msg)?;
    let advertise = args.advertise.clone().unwrap_or_else(|| format!("http://{}", args.listen));
    let store = open_store(args.database.as_deref(), &args.state_dir)?;
    if !args.database.as_deref().is_some_and(is_postgres_url) {
        // An SQLite database is this daemon's alone: every sandbox and
        // volume in it is this node's, whatever the node was called before.
        let moved = store.give_all_to(&node)?;
        if moved > 0 {
            tracing::info!("{moved} sandboxes and volumes of this database are now node {node:?}'s");
        }
    }
    if store.count_keys()? == 0 {
        make_admin_key(store.as_ref(), &args.state_dir)?;
    }
    let cfg = hutch_runtime::Config { state_dir: args.state_dir.clone(), ..hutch_runtime::Config::from_env() };
    let runtime = hutch_runtime::Runtime::new(cfg).context("start the container runtime")?;
    runtime
        .runs(args.default_class)
        .map_err(|why| anyhow::anyhow!("--default-class {}: this host cannot run it: {why}", args.default_class))?;
    let storage = open_storage(&args).await;
    let runtime = Arc::new(runtime.with_storage(storage.clone()).keep_cgroups(args.kept_cgroups));
    let network = setup_network(&args, &node, &runtime.config().run_dir, &store, instance.clone()).await;
    match &network {
        Ok(n) => {
            tracing::info!("sandbox network {}/16{} ready", n.config().subnet4, if n.ipv6() { " and IPv6" } else { "" })
        }
        Err(why) => tracing::warn!("no sandbox networking ({why}); only deny_all sandboxes can start"),
    }
    if !hutch_runtime::image::debian::mmdebstrap_found() {
        tracing::warn!(
            "mmdebstrap not found: presets (python, node, code-interpreter) and Debian image builds are off \
             (apt-get install mmdebstrap); base, imports and pulls work"
        );
    }
    if !(args.overcommit.is_finite() && args.overcommit > 0.0) {
        anyhow::bail!("--overcommit must be a positive number");
    }
    // Disk limits add up against the storage's file system (the image's
    // size), else the state directory's.
    let disk_fs = storage.as_ref().map_or(args.state_dir.clone(), |s| s.mount_point().to_path_buf());
    let capacity =
        hutch_control::Capacity::of_host(std::path::Path::new("/proc"), &disk_fs, args.overcommit, args.max_sandboxes);
    tracing::info!(
        "capacity: {} sandboxes, {} MiB of memory limits, {} MiB of disk limits",
        capacity.sandboxes,
        capacity.memory_mb,
        capacity.disk_mib
    );
    let e2b_secret = e2b_secret(&args.state_dir)?;
    let e2b_domain = match args.e2b_domain.as_deref() {
        None | Some("") => None,
        Some(d) => Some(
            hutch_control::e2b::domain(d)
                .ok_or_else(|| anyhow::anyhow!("--e2b-domain {d:?} is not a domain name (with an optional port)"))?,
        ),
    };
    let metrics_token = secret_file("--metrics-token-file", args.metrics_token_file.as_deref(), 16)?;
    let fleet_secret = secret_file("--fleet-secret-file", args.fleet_secret_file.as_deref(), 32)?;
    let registry = registry_target(args.registry.as_deref(), args.registry_insecure)?;
    let e2b_registries: Vec<String> =
        args.e2b_registries.iter().map(|r| r.trim().to_ascii_lowercase()).filter(|r| !r.is_empty()).collect();
    // The egress proxy that injects secrets, on the gateway address.
    let egress = match &network {
        Ok(net) => match start_egress(&args, net).await {
            Ok(e) => Some(e),
            Err(e) => {
                tracing::warn!("no egress proxy ({e:#}); sandboxes cannot name secrets");
                None
            }
        },
        Err(_) => None,
    };
    let config = hutch_control::Config {
        network: network.clone(),
        capacity,
        e2b_secret,
        e2b_domain,
        e2b_registries,
        metrics_token,
        events: hutch_control::events::Settings {
            enabled: !args.no_events,
            expiring_notice: args.expiring_notice,
            webhooks: hutch_control::webhooks::Policy {
                allow_http: args.webhook_allow_http.0.clone(),
                max_per_key: args.webhook_max,
                retry_base: args.webhook_retry_base,
            },
            // Other daemons may append to a shared database.
            follow_others: args
                .database
                .as_deref()
                .is_some_and(is_postgres_url)
                .then_some(hutch_control::events::FOLLOW_OTHERS),
        },
        egress_bundle: egress.as_ref().map(|(_, _, bundle)| bundle.clone()),
        node: hutch_control::nodes::NodeConfig {
            name: node.clone(),
            advertise,
            heartbeat: args.heartbeat,
            secret: fleet_secret.map(|s| std::sync::Arc::from(s.into_bytes())),
            lost_after: args.node_lost_after,
        },
        registry,
        default_class: args.default_class,
    };
    let control = Control::new(store.clone(), runtime.clone(), config);
    // The event sequence goes on from the store before anything emits.
    control.start_events().await?;
    if let Some((proxy, listener, _)) = egress {
        tokio::spawn(proxy.serve(control.clone(), listener));
    }
    control.register_node().await?;
    tracing::info!("node {node:?} registered");
    control.recover().await?;
    control.spawn_heartbeat();
    control.start_audit_writer();

    // Retention: the audit log, events and ended sandboxes' records are
    // pruned at start, then hourly.
    let c = control.clone();
    spawn_pruner("audit log", args.audit_retention, move |r| {
        let c = c.clone();
        async move { c.prune_audit(r).await }
    });
    let c = control.clone();
    spawn_pruner("events", args.event_retention, move |r| {
        let c = c.clone();
        async move { c.prune_events(r).await }
    });
    let c = control.clone();
    spawn_pruner("ended sandboxes", args.sandbox_retention, move |r| {
        let c = c.clone();
        async move { c.prune_sandboxes(r).await }
    });

    // Usage metering: what was counted (commands, egress) is written every
    // period, with the liveness clock a restart after a crash relies on.
    let meter = control.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(hutch_control::usage::FLUSH_EVERY);
        loop {
            tick.tick().await;
            meter.flush_usage().await;
        }
    });

    // The sandboxes' metric history (the E2B API's metrics).
    let sampler = control.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(hutch_control::history::SAMPLE_EVERY);
        loop {
            tick.tick().await;
            sampler.sample_metrics().await;
        }
    });

    let reconciler = control.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tick.tick().await;
            if let Err(e) = reconciler.reconcile().await {
                tracing::warn!("reconciler: {e}");
            }
        }
    });

    let listener =
        tokio::net::TcpListener::bind(&args.listen).await.with_context(|| format!("listen on {}", args.listen))?;
    let limits = hutch_server::listener::Limits {
        max_connections: args.max_connections as usize,
        max_client_connections: args.max_client_connections as usize,
        header_timeout: args.header_timeout,
        idle_timeout: args.idle_timeout,
        ..hutch_server::listener::Limits::default()
    }
    .fit(nofile);
    tracing::info!(
        "hutch serve listening on http://{} (at most {} connections with {} open files allowed, {} of them unauthenticated, {} per client)",
        listener.local_addr()?,
        limits.max_connections,
        nofile,
        limits.max_unauthenticated(),
        limits.max_client_connections
    );
    let mut app = hutch_server::App::new(control.clone());
    if let Some(hold) = args.wake_hold {
        app.wake = Some(
            hutch_server::wake::WakeHold::new(hold)
                .context("--wake-hold: cannot make a PM QoS request (/dev/cpu_dma_latency)")?,
        );
        tracing::info!("idle CPUs poll while API calls run and for {hold:?} after (--wake-hold)");
    }
    let app = Arc::new(app);
    let stopping = Arc::new(tokio::sync::Notify::new());
    let notify = stopping.clone();
    let shutdown = async move {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => return,
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        tracing::info!("shutting down; sandboxes keep running");
        notify.notify_one();
    };
    // In-flight requests get a grace period; a long command stream must not
    // hold the daemon up forever (the command itself goes on in its sandbox).
    let grace = async {
        stopping.notified().await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
        tracing::warn!("requests still open after {SHUTDOWN_GRACE:?}; exiting anyway");
    };
    tokio::select! {
        served = hutch_server::serve(listener, app, limits, shutdown) => served?,
        () = grace => {}
    }
    control.shut_down();
    // What the audit writer holds is written before the daemon exits, and
    // what usage was counted.
    control.finish_audit().await;
    control.finish_events().await;
    control.flush_usage().await;
    // Kept cgroups are no sandbox's, and no create follows now.
    if let Some(spares) = runtime.spares().cloned() {
        tokio::task::spawn_blocking(move || spares.clear()).await?;
    }
    let _held = instance;
    // With no sandbox left, nothing of the network needs to stay.
    if let Ok(net) = network {
        let running = store.sandboxes_on(Some(&node), &hutch_control::lifecycle::HOLDING_STATES)?;
        if running.is_empty() {
            tokio::task::spawn_blocking(move || net.teardown()).await?;
        }
    }
    // Nor of the storage image's mount: the next start mounts it again.
    if let Some(storage) = storage {
        if store.sandboxes_on(Some(&node), &hutch_control::lifecycle::HOLDING_STATES)?.is_empty() {
            if let Err(e) = storage.detach() {
                tracing::warn!("storage: {e}");
            }
        }
    }
    Ok(())
}

/// Opens (making and mounting it the first time) the disk storage of the
/// sandboxes' writable layers; on failure, says why and the daemon runs
/// memory layers only.
async fn open_storage(args: &ServeArgs) -> Option<Arc<hutch_runtime::storage::Storage>> {
    use hutch_runtime::storage::{Storage, StorageConfig};
    let cfg = StorageConfig::new(&args.state_dir, args.storage_size);
    match tokio::task::spawn_blocking(move || Storage::open(&cfg)).await {
        Ok(Ok(s)) => {
            tracing::info!("disk storage: {}", s.status());
            Some(Arc::new(s))
        }
        Ok(Err(e)) => {
            tracing::warn!("no disk storage ({e}); sandboxes get memory layers only (see `hutch doctor`)");
            None
        }
        Err(e) => {
            tracing::warn!("no disk storage ({e})");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_registry_is_none_and_a_given_one_is_checked() {
        assert!(registry_target(None, false).expect("none").is_none());
        assert!(registry_target(Some(""), false).expect("empty is none").is_none());
        assert!(registry_target(Some("http://127.0.0.1:5000"), false).expect("loopback").is_some());
        assert!(registry_target(Some("http://registry.example.com"), false).is_err(), "plain HTTP off loopback");
    }

    #[test]
    fn the_database_url_picks_the_backend() {
        assert!(is_postgres_url("postgres://hutch@%2Frun%2Fpostgresql/hutch"));
        assert!(is_postgres_url("PostgreSQL://db.internal/hutch"));
        assert!(!is_postgres_url("sqlite:///var/lib/hutch/hutch.db"));
        assert!(!is_postgres_url("postgres:"));
        let dir = std::env::temp_dir().join(format!("hutch-serve-db-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let e = open_store(Some("mysql://x/y"), &dir).err().expect("refused");
        assert!(e.to_string().contains("postgres://"), "{e}");
        assert!(!dir.join("hutch.db").exists(), "a refused URL makes no SQLite file");
        // An empty value is the default: SQLite in the state directory.
        open_store(Some(""), &dir).expect("sqlite");
        assert!(dir.join("hutch.db").exists());
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}

//! `hutch serve`: the daemon. Opens (or creates) the state directory and
//! its database, makes an admin key on first start, takes charge of the
//! sandboxes an earlier run left, runs the reconciler, and serves the API
//! until SIGTERM or SIGINT. Sandboxes outlive it.

use anyhow::{Context, Result};
use clap::Args;
use hutch_control::control::{log_info, log_warn};
use hutch_control::Control;
use hutch_store::{SqliteStore, Store};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::PathBuf;
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
}

/// The key of the E2B API's sandbox access tokens: 32 random bytes in
/// `<state>/e2b.secret` (mode 0600), made on first start. Deleting it
/// revokes every token at the next start.
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

pub fn main(args: ServeArgs) -> i32 {
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("hutch serve: {e}");
            return 1;
        }
    };
    match rt.block_on(serve(args)) {
        Ok(()) => 0,
        Err(e) => {
            hutch_control::control::log("error", &format!("{e:#}"));
            1
        }
    }
}

async fn serve(args: ServeArgs) -> Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&args.state_dir)
        .with_context(|| format!("create state directory {}", args.state_dir.display()))?;
    let db = args.state_dir.join("hutch.db");
    let store: Arc<dyn Store> = Arc::new(SqliteStore::open(&db).with_context(|| format!("open {}", db.display()))?);
    if store.count_keys()? == 0 {
        let key = hutch_control::keys::generate("admin", true, false, hutch_control::keys::now_ms())?;
        store.insert_key(&key.record)?;
        let path = args.state_dir.join("admin.key");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)
            .with_context(|| format!("write {}", path.display()))?;
        writeln!(f, "{}", key.secret)?;
        log_info(&format!("created the admin API key; it is in {} (mode 0600)", path.display()));
    }
    let cfg = hutch_runtime::Config { state_dir: args.state_dir.clone(), ..hutch_runtime::Config::from_env() };
    let runtime = Arc::new(hutch_runtime::Runtime::new(cfg).context("start the container runtime")?);
    let control = Control::new(store, runtime);
    control.recover().await?;

    let reconciler = control.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tick.tick().await;
            if let Err(e) = reconciler.reconcile().await {
                log_warn(&format!("reconciler: {e}"));
            }
        }
    });

    let listener =
        tokio::net::TcpListener::bind(&args.listen).await.with_context(|| format!("listen on {}", args.listen))?;
    log_info(&format!("hutch serve listening on http://{}", listener.local_addr()?));
    let e2b_secret = e2b_secret(&args.state_dir)?;
    let app = Arc::new(hutch_server::App { control: control.clone(), e2b_secret });
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
        log_info("shutting down; sandboxes keep running");
        notify.notify_one();
    };
    // In-flight requests get a grace period; a long command stream must not
    // hold the daemon up forever (the command itself goes on in its sandbox).
    let grace = async {
        stopping.notified().await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
        log_warn(&format!("requests still open after {SHUTDOWN_GRACE:?}; exiting anyway"));
    };
    tokio::select! {
        served = hutch_server::serve(listener, app, shutdown) => served?,
        () = grace => {}
    }
    control.shut_down();
    Ok(())
}

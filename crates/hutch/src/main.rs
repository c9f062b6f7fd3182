//! The `hutch` binary: the daemon (`serve`), its command line client, one-shot
//! runs without a daemon (`run`), and host checks (`doctor`). Thin: the work
//! is in the library crates.

mod cli;
mod run;
mod serve;
mod units;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "hutch", version, about = "A sandbox host for code you do not trust")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run one command in a fresh sandbox, without a daemon.
    Run(run::RunArgs),
    /// Run the daemon: the HTTP API on --listen, state in --state-dir.
    Serve(Box<serve::ServeArgs>),
    /// Create, list and manage sandboxes of a running daemon.
    Sandbox(cli::sandbox::SandboxArgs),
    /// Run a command in a sandbox of a running daemon.
    Exec(cli::exec::ExecArgs),
    /// Copy files into and out of a sandbox of a running daemon.
    Files(cli::files::FilesArgs),
    /// Take, list and delete snapshots of a running daemon's sandboxes; fork.
    Snapshot(cli::snapshot::SnapshotArgs),
    /// Create, list, grow and delete volumes of a running daemon.
    Volume(cli::volume::VolumeArgs),
    /// Create, list, build and delete templates of a running daemon.
    Template(Box<cli::template::TemplateArgs>),
    /// Manage API keys in the daemon's database (on its host, no HTTP).
    Key(cli::keys::KeyArgs),
    /// List the nodes (daemons) sharing a daemon's database (admin keys).
    Node(cli::node::NodeArgs),
    /// Import, pull, list and remove images through the API; build Debian images on the host.
    Image(cli::image::ImageArgs),
    /// An MCP server on stdin/stdout, for MCP clients: a bridge to a
    /// running daemon's /mcp (HUTCH_URL, HUTCH_API_KEY).
    Mcp(cli::mcp::McpArgs),
    /// Report what this host offers for sandboxes and what it lacks; with
    /// --fleet, the health of the nodes sharing a daemon's database.
    Doctor {
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
        /// The daemon's state directory, whose disk storage it reports
        /// (HUTCH_STATE_DIR).
        #[arg(long, env = "HUTCH_STATE_DIR", default_value = "/var/lib/hutch")]
        state_dir: std::path::PathBuf,
        /// Check the fleet instead (through --url, an admin key): every
        /// node's state, heartbeat age, capacity and classes; exit 1 when a
        /// node is lost or stale.
        #[arg(long)]
        fleet: bool,
        /// With --fleet: the daemon's API (HUTCH_URL).
        #[arg(long, env = "HUTCH_URL", default_value = cli::DEFAULT_URL)]
        url: String,
        /// With --fleet: an admin key (HUTCH_API_KEY); else the one in
        /// <state-dir>/admin.key.
        #[arg(long, env = "HUTCH_API_KEY", hide_env_values = true)]
        api_key: Option<String>,
        /// With --fleet: a node not lost but without a heartbeat for this
        /// long is stale.
        #[arg(long, default_value = "15s", value_parser = units::parse_duration)]
        stale_after: std::time::Duration,
    },
}

fn main() {
    // Rust ignores SIGPIPE, so a print to a closed pipe (`hutch doctor --json
    // | head`) would panic. Commands that print for a person or a pipe take
    // the default (help and usage errors included) and end quietly, as Unix
    // tools do; the daemon, `run` (which must remove its sandbox) and `mcp`
    // (which must close its session) ignore it again and see EPIPE.
    // SAFETY: no other thread exists yet; both are valid dispositions.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let cli = Cli::parse();
    if matches!(cli.command, Command::Serve(_) | Command::Run(_) | Command::Mcp(_)) {
        // SAFETY: as above.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) };
    }
    let code = match cli.command {
        Command::Run(args) => run::main(args),
        Command::Serve(args) => serve::main(*args),
        Command::Sandbox(args) => cli::sandbox::main(args),
        Command::Exec(args) => cli::exec::main(args),
        Command::Files(args) => cli::files::main(args),
        Command::Snapshot(args) => cli::snapshot::main(args),
        Command::Volume(args) => cli::volume::main(args),
        Command::Template(args) => cli::template::main(*args),
        Command::Key(args) => cli::keys::main(args),
        Command::Node(args) => cli::node::main(args),
        Command::Image(args) => cli::image::main(args),
        Command::Mcp(args) => cli::mcp::main(args),
        Command::Doctor { json, state_dir, fleet: true, url, api_key, stale_after } => {
            cli::node::doctor_fleet(&cli::ClientOpts { url, api_key, state_dir }, stale_after, json)
        }
        Command::Doctor { json, state_dir, fleet: false, .. } => doctor(json, state_dir),
    };
    std::process::exit(code);
}

fn doctor(json: bool, state_dir: std::path::PathBuf) -> i32 {
    let report =
        hutch_runtime::doctor::check(&hutch_runtime::Config { state_dir, ..hutch_runtime::Config::from_env() });
    if json {
        println!("{}", serde_json::to_string_pretty(&report).unwrap_or_default());
    } else {
        print!("{}", report.render());
    }
    if report.default_class_ok() {
        0
    } else {
        1
    }
}

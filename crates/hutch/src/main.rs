//! The `hutch` binary: one-shot runs and host checks today; the daemon and
//! its command line client build on the same runtime.

mod run;
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
    /// Report what this host offers for sandboxes and what it lacks.
    Doctor {
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.command {
        Command::Run(args) => run::main(args),
        Command::Doctor { json } => doctor(json),
    };
    std::process::exit(code);
}

fn doctor(json: bool) -> i32 {
    let report = hutch_runtime::doctor::check(&hutch_runtime::Config::from_env());
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

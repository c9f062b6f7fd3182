//! `hutch node ...`: the nodes (daemons) sharing a daemon's database,
//! through its API (`GET /v1/nodes`, admin keys only).

use super::output::{self, table};
use super::{report, ClientOpts};
use clap::{Args, Subcommand};

#[derive(Args, Debug)]
pub struct NodeArgs {
    #[command(flatten)]
    pub conn: ClientOpts,
    #[command(subcommand)]
    pub command: NodeCommand,
}

#[derive(Subcommand, Debug)]
pub enum NodeCommand {
    /// List the nodes: state, time since the last heartbeat, capacity and
    /// sandboxes.
    #[command(visible_alias = "ls")]
    List {
        /// Print JSON (a NodeList).
        #[arg(long)]
        json: bool,
    },
}

pub fn main(args: NodeArgs) -> i32 {
    report(run(args), 1)
}

fn run(args: NodeArgs) -> anyhow::Result<i32> {
    let client = args.conn.client()?;
    match args.command {
        NodeCommand::List { json } => {
            let list = client.list_nodes()?;
            if json {
                print!("{}", output::json(&list)?);
            } else {
                let rows: Vec<Vec<String>> = list
                    .nodes
                    .iter()
                    .map(|n| {
                        vec![
                            n.name.clone(),
                            n.state.clone(),
                            format!("{} ago", output::span(n.heartbeat_age_ms as i64)),
                            format!("{}/{}", n.sandboxes, n.capacity.sandboxes),
                            crate::units::show_size(n.capacity.memory_mib << 20),
                            crate::units::show_size(n.capacity.disk_mib << 20),
                            n.capacity.classes.join(","),
                            n.advertise.clone(),
                        ]
                    })
                    .collect();
                print!(
                    "{}",
                    table(
                        &["NAME", "STATE", "HEARTBEAT", "SANDBOXES", "MEMORY", "DISK", "CLASSES", "ADVERTISE"],
                        &rows
                    )
                );
            }
        }
    }
    Ok(0)
}

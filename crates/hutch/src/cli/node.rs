//! `hutch node ...`: the nodes (daemons) sharing a daemon's database,
//! through its API (`GET /v1/nodes`, `POST /v1/nodes/{name}/drain` and
//! `/undrain`, admin keys only); and `hutch doctor --fleet`.

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
    /// Stop placing sandboxes on a node: it refuses creates and keeps no
    /// warm pool; `node list` shows when it holds none (DRAINED).
    Drain {
        name: String,
        /// Print the node as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Make a draining node take sandboxes again.
    Undrain {
        name: String,
        /// Print the node as JSON.
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
                            match n.drained {
                                Some(true) => format!("{} (drained)", n.state),
                                _ => n.state.clone(),
                            },
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
        NodeCommand::Drain { name, json } => drained(&client.drain_node(&name, false)?, json)?,
        NodeCommand::Undrain { name, json } => drained(&client.drain_node(&name, true)?, json)?,
    }
    Ok(0)
}

/// What a drain or an undrain answered.
fn drained(n: &hutch_api::Node, json: bool) -> anyhow::Result<()> {
    if json {
        print!("{}", output::json(n)?);
    } else {
        let empty = match n.drained {
            Some(true) => ": it holds no sandboxes",
            Some(false) => ": it still holds sandboxes (see hutch node list)",
            None => "",
        };
        println!("node {} is {}{empty}", n.name, n.state);
    }
    Ok(())
}

/// `hutch doctor --fleet`: each node's state, heartbeat age, capacity and
/// classes, from `GET /v1/nodes`. A node `lost`, or not lost but silent
/// for longer than `stale_after`, is a problem (exit 1); a draining one is
/// shown as such. Exit 2 when the daemon cannot be asked.
pub fn doctor_fleet(conn: &ClientOpts, stale_after: std::time::Duration, json: bool) -> i32 {
    let list = match conn.client().and_then(|c| Ok(c.list_nodes()?)) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("hutch doctor --fleet: {e:#}");
            return 2;
        }
    };
    let stale_ms = stale_after.as_millis().min(u64::MAX as u128) as u64;
    let verdicts: Vec<(&hutch_api::Node, &str, bool)> = list
        .nodes
        .iter()
        .map(|n| match n.state.as_str() {
            "lost" => (n, "lost", false),
            _ if n.heartbeat_age_ms > stale_ms => (n, "stale", false),
            "draining" if n.drained == Some(true) => (n, "drained", true),
            "draining" => (n, "draining", true),
            "active" => (n, "ok", true),
            _ => (n, "unknown", false),
        })
        .collect();
    let bad = verdicts.iter().filter(|(_, _, ok)| !ok).count();
    if json {
        let nodes: Vec<serde_json::Value> = verdicts
            .iter()
            .map(|(n, verdict, ok)| serde_json::json!({"node": n, "verdict": verdict, "ok": ok}))
            .collect();
        println!("{}", serde_json::json!({ "nodes": nodes, "problems": bad }));
    } else {
        for (n, verdict, ok) in &verdicts {
            println!(
                "{} {:<16} {:<9} heartbeat {} ago, {} sandboxes of {}, {} memory, {} disk, classes {}",
                if *ok { "ok  " } else { "FAIL" },
                n.name,
                verdict,
                output::span(n.heartbeat_age_ms as i64),
                n.sandboxes,
                n.capacity.sandboxes,
                crate::units::show_size(n.capacity.memory_mib << 20),
                crate::units::show_size(n.capacity.disk_mib << 20),
                if n.capacity.classes.is_empty() { "none".to_owned() } else { n.capacity.classes.join(",") },
            );
        }
        if list.nodes.is_empty() {
            println!("no nodes registered");
        }
        match bad {
            0 => println!("\n{} nodes, none lost or stale", list.nodes.len()),
            _ => println!(
                "\n{bad} of {} nodes lost or stale (stale: no heartbeat for {stale_after:?})",
                list.nodes.len()
            ),
        }
    }
    i32::from(bad > 0)
}

//! The host side of sandbox networks, without a daemon: a policy the host
//! cannot enforce is refused (fail closed), `heal` puts flushed rules back,
//! and `teardown` leaves nothing. Runs as root (CI does), on network
//! instance 30 so it never meets a daemon's.

use hutch_runtime::net::{Egress, InstanceLock, NetConfig, Network, Policy};
use std::collections::BTreeMap;
use std::process::Command;

const INSTANCE: u8 = 30;

fn table_exists() -> bool {
    Command::new("nft").args(["list", "table", "inet", "hutch30"]).output().map(|o| o.status.success()).unwrap_or(false)
}

fn links() -> Vec<String> {
    std::fs::read_dir("/sys/class/net")
        .expect("/sys/class/net")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("h1es"))
        .collect()
}

/// Tears the network down even when the test fails.
struct Guard(Option<Network>);

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(n) = self.0.take() {
            n.teardown();
        }
    }
}

fn policy(egress: Egress) -> Policy {
    Policy { egress, allow: vec![], deny: vec![], group: "test/base".into(), inject: false }
}

#[test]
fn unenforceable_policies_are_refused_and_flushed_rules_come_back() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "makes real network namespaces and nftables tables: run as root");
    let run = std::env::temp_dir().join(format!("hutch-net-test-{}", std::process::id()));
    std::fs::create_dir_all(&run).expect("mkdir");
    let mut cfg = NetConfig::new(&run, INSTANCE);
    cfg.ipv6 = Some(false);
    // A daemon (or another test) on this instance makes this fail, never
    // share: the instance's lock is exclusive host-wide.
    let held = InstanceLock::acquire(INSTANCE).expect("network instance 30 is free");
    let guard = Guard(Some(Network::setup(cfg, &BTreeMap::new(), &held).expect("set up the network")));
    let net = guard.0.as_ref().expect("network");
    assert!(table_exists());

    let a = net.attach("sb-a", &policy(Egress::Default)).expect("attach");
    assert!(a.netns.is_some() && a.addr4.is_some());
    net.release("sb-a");

    // The host's rules vanish: nothing can be admitted, so no network is
    // handed out.
    assert!(Command::new("nft").args(["delete", "table", "inet", "hutch30"]).status().expect("nft").success());
    let refused = net.attach("sb-b", &policy(Egress::Default));
    assert!(refused.is_err(), "a network without its policy was handed out: {refused:?}");
    assert!(net.attach("sb-p", &policy(Egress::Private)).is_err());
    // deny_all needs no rule at all.
    let d = net.attach("sb-d", &policy(Egress::DenyAll)).expect("deny_all");
    assert!(d.netns.is_none());

    assert!(!net.heal().expect("heal"), "heal must notice the missing table");
    assert!(net.heal().expect("heal"), "and find it in place after loading it");
    net.attach("sb-e", &policy(Egress::Default)).expect("attach after heal");
    for id in ["sb-d", "sb-e"] {
        net.release(id);
    }

    drop(guard);
    // Held, the instance refuses a second holder.
    let second = InstanceLock::acquire_in(std::path::Path::new(hutch_runtime::net::INSTANCE_LOCK_DIR), INSTANCE);
    assert!(matches!(&second, Err(e) if e.to_string().contains(&format!("pid {}", std::process::id()))), "{second:?}");
    drop(held);
    assert!(!table_exists(), "teardown leaves no table");
    assert_eq!(links(), Vec::<String>::new(), "teardown leaves no link");
    let _ = std::fs::remove_dir_all(&run);
}

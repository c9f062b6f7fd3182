//! The ruleset hutch loads over netlink (net::nftables) is the one
//! policy/network.nft describes: both are loaded into scratch tables, one
//! with `nft -f` and one with our encoder, and `nft list table` must print
//! them alike. Runs as root (CI does) with nftables installed (only this
//! test needs it). The scratch tables hook the host's chains but match only
//! links named `hfrp*`, which nothing makes; they are deleted even when the
//! test fails.

use hutch_runtime::net::netlink::Netlink;
use hutch_runtime::net::{nftables, ruleset_text, ruleset_values, NetConfig};
use std::io::Write;
use std::net::IpAddr;
use std::process::{Command, Stdio};
use std::time::Instant;

/// Deletes the scratch tables on every exit.
struct Tables(Vec<String>);

impl Drop for Tables {
    fn drop(&mut self) {
        if let Ok(mut nl) = Netlink::netfilter() {
            for t in &self.0 {
                let _ = nftables::delete_table(&mut nl, t);
            }
        }
    }
}

fn list(table: &str) -> String {
    let out = Command::new("nft").args(["list", "table", "inet", table]).output().expect("run nft (install nftables)");
    assert!(out.status.success(), "nft list table {table}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8").replace(table, "TABLE")
}

fn nft_load(text: &str) {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run nft (install nftables)");
    child.stdin.take().expect("stdin").write_all(text.as_bytes()).expect("write ruleset");
    let out = child.wait_with_output().expect("wait for nft");
    assert!(out.status.success(), "nft -f refused the ruleset: {}", String::from_utf8_lossy(&out.stderr));
}

fn check(host: &[(IpAddr, u8)], tag: &str) {
    let pid = std::process::id();
    let (by_nft, by_netlink) = (format!("hfrp{pid}{tag}t"), format!("hfrp{pid}{tag}n"));
    let _cleanup = Tables(vec![by_nft.clone(), by_netlink.clone()]);
    let cfg = NetConfig::new(std::path::Path::new("/run/hutch"), 7);
    let mut v = ruleset_values(&cfg, host);
    v.prefix = "hfrp".into();

    v.table = by_nft.clone();
    let t = Instant::now();
    nft_load(&ruleset_text(&v));
    let nft_time = t.elapsed();

    v.table = by_netlink.clone();
    let mut nl = Netlink::netfilter().expect("nfnetlink");
    let t = Instant::now();
    nftables::load(&mut nl, &nftables::ruleset(&v)).expect("load over netlink");
    let netlink_time = t.elapsed();
    // Loading again replaces the table in place.
    nftables::load(&mut nl, &nftables::ruleset(&v)).expect("load over netlink again");
    eprintln!("ruleset load ({tag}): nft -f {nft_time:?}, netlink {netlink_time:?}");

    let (a, b) = (list(&by_nft), list(&by_netlink));
    if a != b {
        let diff: Vec<String> = a
            .lines()
            .zip(b.lines())
            .filter(|(x, y)| x != y)
            .map(|(x, y)| format!("nft:     {x}\nnetlink: {y}"))
            .collect();
        panic!("the tables differ:\n{}\n--- nft -f:\n{a}\n--- netlink:\n{b}", diff.join("\n"));
    }
    assert!(a.contains("chain from_sandbox") && a.contains("masquerade"), "{a}");
}

#[test]
fn netlink_ruleset_lists_like_the_nft_text() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "loads nftables tables: run as root");
    let n = |s: &str, l: u8| (s.parse::<IpAddr>().expect("ip"), l);
    // This host's networks, and ones that exercise merging: an address
    // inside its network, adjacent and overlapping ranges, IPv6, a range
    // reaching the top of the space.
    let mut rtnl = Netlink::route().expect("rtnetlink");
    let host = hutch_runtime::net::host_networks(&mut rtnl).expect("host networks");
    check(&host, "h");
    check(&[], "e");
    check(
        &[
            n("192.0.2.7", 24),
            n("198.51.100.0", 25),
            n("198.51.100.128", 25),
            n("203.0.113.9", 32),
            n("2001:db8::5", 64),
            n("2001:db8:0:1::", 64),
            n("fd00::1", 8),
            n("ffff:ffff::", 32),
        ],
        "x",
    );
}

//! What only PostgreSQL has to get right: daemons that share the database.
//! Each test opens two stores on one database, each with its own pool (its
//! own connections, as two daemons), and races them from two threads: for
//! every transition, claim and admission, exactly one wins.
//! They run when `HUTCH_TEST_POSTGRES` is set (scripts/test.sh sets it).

use super::backend::PgTestDb;
use super::*;
use std::collections::BTreeSet;
use std::sync::{Arc, Barrier};

/// Runs `f(store, 0)` and `f(other store, 1)` at once, from a barrier;
/// their results.
fn race<T: Send + 'static>(db: &PgTestDb, f: impl Fn(&dyn Store, usize) -> T + Send + Sync + 'static) -> [T; 2] {
    let f = Arc::new(f);
    let start = Arc::new(Barrier::new(2));
    let threads: Vec<_> = (0..2)
        .map(|i| {
            let (f, start, store) = (f.clone(), start.clone(), db.open());
            std::thread::spawn(move || {
                start.wait();
                f(&store, i)
            })
        })
        .collect();
    let mut out = threads.into_iter().map(|t| t.join().expect("racer"));
    [out.next().expect("first"), out.next().expect("second")]
}

fn db() -> Option<PgTestDb> {
    let mut db = PgTestDb::create()?;
    db.store = Some(db.open());
    Some(db)
}

fn ids(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("sb-{i:03}")).collect()
}

#[test]
fn two_daemons_never_both_win_one_transition() {
    let Some(db) = db() else { return };
    let s = db.store.as_ref().expect("open");
    for id in ids(40) {
        s.insert_sandbox_free(&sandbox(&id, 1)).expect("insert");
    }
    let [a, b] = race(&db, |s, _| {
        let kill = Changes { last_error_code: Some("sandbox_killed"), ..Changes::default() };
        ids(40)
            .into_iter()
            .filter(|id| {
                s.transition(id, &[SandboxState::Running], SandboxState::Terminating, &kill)
                    .expect("transition")
                    .is_some()
            })
            .collect::<BTreeSet<_>>()
    });
    assert!(a.is_disjoint(&b), "both won {:?}", a.intersection(&b).collect::<Vec<_>>());
    assert_eq!(a.len() + b.len(), 40, "every transition had one winner");
}

#[test]
fn two_nodes_never_both_declare_a_node_lost() {
    let Some(db) = db() else { return };
    let s = db.store.as_ref().expect("open");
    for name in ["a", "b", "c"] {
        s.register_node(&node(name, 1)).expect("register");
    }
    for id in ids(20) {
        s.insert_sandbox_free(&SandboxRecord { node: "c".into(), ..sandbox(&id, 1) }).expect("insert");
    }
    for _ in 0..5 {
        let [a, b] = race(&db, |s, _| {
            let from = [SandboxState::Running];
            let loss = NodeLoss {
                name: "c",
                silent_before: 2,
                from: &from,
                code: "node_lost",
                reason: "gone",
                paused_reason: "gone",
            };
            s.mark_node_lost(&loss).expect("declare").map(|v| v.len())
        });
        assert_eq!([a, b].iter().filter(|w| w.is_some()).count(), 1, "one winner: {a:?} {b:?}");
        assert_eq!(a.or(b), Some(20), "the winner lost every sandbox");
        s.register_node(&node("c", 1)).expect("back");
        for id in ids(20) {
            s.raw_execute_for_tests(&format!("UPDATE sandboxes SET state = 'running' WHERE id = '{id}'"))
                .expect("reset");
        }
    }
}

#[test]
fn two_daemons_never_claim_one_warm_sandbox_twice() {
    let Some(db) = db() else { return };
    let s = db.store.as_ref().expect("open");
    s.insert_template(&template("tpl-1", 1)).expect("template");
    for (i, id) in ids(30).iter().enumerate() {
        s.insert_sandbox_free(&pooled(id, i as i64, 1)).expect("insert");
    }
    let [a, b] = race(&db, |s, _| {
        let mut got = BTreeSet::new();
        while let Some(r) = s.claim_warm(&claim(100)).expect("claim") {
            assert!(!r.pooled);
            got.insert(r.id);
        }
        got
    });
    assert!(a.is_disjoint(&b), "claimed twice: {:?}", a.intersection(&b).collect::<Vec<_>>());
    assert_eq!(a.len() + b.len(), 30, "every pooled sandbox was claimed once");
    assert!(s.pooled_sandboxes(None).expect("pooled").iter().all(|r| !r.pooled));
}

#[test]
fn two_daemons_admit_exactly_up_to_a_cap() {
    let Some(db) = db() else { return };
    let owner = Quotas { sandboxes: Some(10), ..Quotas::default() };
    let adm = Admission { owner, host: Quotas::default() };
    let [a, b] = race(&db, move |s, i| {
        (0..20)
            .filter(|n| {
                let r = SandboxRecord { idempotency_key: None, ..sandbox(&format!("sb-{i}-{n}"), 1) };
                s.insert_sandbox(&r, &adm).expect("insert") == Admitted::Inserted
            })
            .count()
    });
    assert_eq!(a + b, 10, "admitted {a} + {b}");
    let s = db.store.as_ref().expect("open");
    assert_eq!(s.usage(Some("k1")).expect("usage").sandboxes, 10);
}

#[test]
fn two_daemons_never_both_claim_a_volume_read_write() {
    let Some(db) = db() else { return };
    let s = db.store.as_ref().expect("open");
    s.insert_volume(&volume("v1", "k1", "data", 64), &Admission::default()).expect("volume");
    let [a, b] = race(&db, |s, i| {
        (0..10)
            .filter(|n| {
                let id = format!("sb-{i}-{n}");
                let r = SandboxRecord { idempotency_key: None, ..sandbox(&id, 1) };
                let got = s.insert_sandbox_claiming(&r, &Admission::default(), &[vclaim("v1", &id, false)], None);
                got.expect("insert") == Admitted::Inserted
            })
            .count()
    });
    assert_eq!(a + b, 1, "one writer: {a} + {b}");
    assert_eq!(s.volume_holders("v1").expect("holders").len(), 1);
}

#[test]
fn two_daemons_keep_the_snapshot_and_build_caps() {
    let Some(db) = db() else { return };
    let [a, b] = race(&db, |s, i| {
        let snaps = (0..10)
            .filter(|n| {
                let snap = SnapshotRecord {
                    id: format!("snap-{i}-{n}"),
                    owner: "k1".into(),
                    name: None,
                    sandbox_id: "sb".into(),
                    created_at: 1,
                    size_bytes: 1,
                    recipe: "{}".into(),
                };
                s.insert_snapshot(&snap, Some(5)).expect("snapshot")
            })
            .count();
        let builds = (0..10)
            .filter(|n| {
                let b = BuildRecord {
                    id: format!("bld-{i}-{n}"),
                    template_id: "tpl-1".into(),
                    owner: "k1".into(),
                    state: BuildState::Queued,
                    created_at: 1,
                    finished_at: None,
                    error: None,
                    parent: "base".into(),
                    image: None,
                    version: None,
                    node: "a".into(),
                };
                s.insert_build(&b, Some(3)).expect("build")
            })
            .count();
        (snaps, builds)
    });
    assert_eq!((a.0 + b.0, a.1 + b.1), (5, 3));
}

#[test]
fn two_daemons_appending_events_give_each_id_once_and_a_follower_misses_none() {
    let Some(db) = db() else { return };
    // A follower reads as a stream does, after the last id it saw, while
    // two daemons append batches: an id that committed before a lower one
    // would make it skip the lower one for good.
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let follower = {
        let (store, done) = (db.open(), done.clone());
        std::thread::spawn(move || {
            let (mut seen, mut last) = (Vec::new(), 0);
            loop {
                let finished = done.load(std::sync::atomic::Ordering::SeqCst);
                let q = EventQuery { after: Some(last), limit: 1000, ..EventQuery::default() };
                let page = store.list_events(&q).expect("list");
                seen.extend(page.iter().map(|e| e.id));
                last = page.last().map_or(last, |e| e.id);
                if finished && page.is_empty() {
                    return seen;
                }
            }
        })
    };
    let [a, b] = race(&db, |s, i| {
        let mut given = Vec::new();
        for _ in 0..100 {
            let mut rows: Vec<EventRecord> =
                (0..5).map(|_| event(0, ["k1", "k2"][i], "sandbox.created", None)).collect();
            s.append_events(&mut rows).expect("append");
            given.extend(rows.iter().map(|r| r.id));
        }
        given
    });
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let seen = follower.join().expect("follower");
    assert!(a.windows(2).all(|w| w[0] < w[1]) && b.windows(2).all(|w| w[0] < w[1]), "each daemon's ids increase");
    let mut all: Vec<i64> = a.iter().chain(&b).copied().collect();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), 1000, "no id was given twice");
    assert_eq!(seen, all, "the follower saw every event once, in id order");
}

#[test]
fn two_daemons_never_claim_one_webhook_delivery_both() {
    let Some(db) = db() else { return };
    let s = db.store.as_ref().expect("open");
    s.insert_webhook(&webhook("wh-1", "k1", &["*"]), 10).expect("webhook");
    let mut rows: Vec<EventRecord> = (0..60).map(|_| event(0, "k1", "sandbox.created", None)).collect();
    assert_eq!(s.append_events(&mut rows).expect("append"), 60);
    let [a, b] = race(&db, |s, i| {
        let node = ["a", "b"][i];
        let mut got = BTreeSet::new();
        loop {
            let claimed = s.claim_deliveries(node, 10_000, 20_000, 3).expect("claim");
            if claimed.is_empty() {
                return got;
            }
            got.extend(claimed.into_iter().map(|(d, _)| d.id));
        }
    });
    assert!(a.is_disjoint(&b), "claimed by both: {:?}", a.intersection(&b).collect::<Vec<_>>());
    assert_eq!(a.len() + b.len(), 60, "every delivery was claimed once");
}

#[test]
fn two_daemons_starting_on_an_empty_database_make_one_admin_key() {
    let Some(db) = db() else { return };
    let s = db.store.as_ref().expect("open");
    for round in 0..5 {
        let [a, b] = race(&db, move |s, i| {
            let k = KeyRecord {
                id: format!("key-{round}-{i}"),
                name: "admin".into(),
                hash: format!("hash-{round}-{i}"),
                admin: true,
                created_at: 1,
                revoked_at: None,
                quotas: Quotas::default(),
            };
            s.insert_first_key(&k).expect("first key")
        });
        assert!(a != b, "one winner: {a} {b}");
        assert_eq!(s.count_keys().expect("count"), 1);
        s.raw_execute_for_tests("DELETE FROM api_keys").expect("empty again");
    }
}

#[test]
fn daemons_starting_together_migrate_once_and_a_reopen_keeps_rows() {
    let Some(mut db) = PgTestDb::create() else { return };
    // Two daemons open the empty database at once: one migrates, the
    // other waits for it and finds the schema made.
    let [a, b] = std::thread::scope(|sc| {
        let one = sc.spawn(|| db.open());
        let two = sc.spawn(|| db.open());
        [one.join().expect("first"), two.join().expect("second")]
    });
    a.insert_sandbox_free(&sandbox("a", 1)).expect("insert");
    assert_eq!(b.get_sandbox("a").expect("get").map(|r| r.id), Some("a".into()));
    drop((a, b));
    db.store = Some(db.open());
    let s = db.store.as_ref().expect("open");
    assert_eq!(s.get_sandbox("a").expect("get").map(|r| r.id), Some("a".into()));
}

#[test]
fn a_bad_url_is_an_error_not_a_panic() {
    assert!(crate::PgStore::open("postgres://%zz").is_err());
    assert!(crate::PgStore::open("host=/nonexistent/hutch-test connect_timeout=1").is_err());
}

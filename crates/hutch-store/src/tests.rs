//! The store's tests, each run on both backends: on an in-memory SQLite
//! database always, and on a PostgreSQL database of its own when
//! `HUTCH_TEST_POSTGRES` names a server (see `tests_backend.rs`); then the
//! races between daemons that only PostgreSQL can have.

use super::*;
use crate::sqlite::SqliteStore;
use backend::Backend;

#[path = "tests_backend.rs"]
mod backend;
#[path = "tests_pg.rs"]
mod pg;

/// Inserts with no caps.
trait InsertFree {
    fn insert_sandbox_free(&self, sb: &SandboxRecord) -> Result<()>;
}

impl<T: Store + ?Sized> InsertFree for T {
    fn insert_sandbox_free(&self, sb: &SandboxRecord) -> Result<()> {
        assert_eq!(self.insert_sandbox(sb, &Admission::default())?, Admitted::Inserted);
        Ok(())
    }
}

fn sandbox(id: &str, created_at: i64) -> SandboxRecord {
    SandboxRecord {
        id: id.into(),
        owner: "k1".into(),
        template: "base".into(),
        state: SandboxState::Running,
        created_at,
        expires_at: created_at + 1000,
        max_expires_at: created_at + 5000,
        memory_mb: 512,
        vcpus: 1.0,
        disk_mib: 1024,
        pids: 512,
        env: "{}".into(),
        metadata: "{}".into(),
        limits_applied: "enforced".into(),
        last_error_code: None,
        host_pid: None,
        idempotency_key: Some(format!("key-{id}")),
        request_hash: Some("h".into()),
        template_id: None,
        template_version: None,
        warm: false,
        pooled: false,
        network: "{}".into(),
        storage: StorageKind::Disk,
        origin: None,
        on_expire: OnExpire::Delete,
        ttl_s: Some(1),
        paused_ttl_s: None,
        class: Class::Container,
        node: "local".into(),
        reason: None,
    }
}

fn learned_addresses_survive_other_updates(s: &Backend) {
    let r = sandbox("a", 1);
    s.insert_sandbox_free(&r).expect("insert");
    s.set_net_learned("a", "[\"198.51.100.3\"]").expect("learn");
    s.transition("a", &[SandboxState::Running], SandboxState::Suspended, &Changes::default()).expect("update");
    assert_eq!(s.net_learned("a").expect("read"), "[\"198.51.100.3\"]");
    assert_eq!(s.net_learned("missing").expect("read"), "[]");
}

/// A directory of one test's store files, removed when the test ends,
/// passed or failed.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("hutch-store-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("mkdir");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn migrations_apply_once_and_reopen_keeps_rows() {
    let dir = Scratch::new("reopen");
    let path = dir.0.join("hutch.db");
    {
        let s = SqliteStore::open(&path).expect("open");
        s.insert_sandbox_free(&sandbox("a", 1)).expect("insert");
    }
    let s = SqliteStore::open(&path).expect("reopen");
    assert_eq!(s.get_sandbox("a").expect("get").map(|r| r.id), Some("a".into()));
}

fn listing_pages_newest_first(s: &Backend) {
    for (i, id) in ["a", "b", "c", "d", "e"].iter().enumerate() {
        s.insert_sandbox_free(&sandbox(id, i as i64)).expect("insert");
    }
    let page1 = s.list_sandboxes(Some("k1"), None, 2, false).expect("list");
    assert_eq!(page1.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(), ["e", "d"]);
    let last = &page1[1];
    let page2 = s.list_sandboxes(Some("k1"), Some((last.created_at, &last.id)), 2, false).expect("list");
    assert_eq!(page2.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(), ["c", "b"]);
    assert!(s.list_sandboxes(Some("other"), None, 10, false).expect("list").is_empty());
    // `live` leaves the terminated out, on every page.
    s.transition("d", &[SandboxState::Running], SandboxState::Terminated, &Changes::default()).expect("end");
    let live = s.list_sandboxes(Some("k1"), None, 3, true).expect("list");
    assert_eq!(live.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(), ["e", "c", "b"]);
    assert_eq!(s.list_sandboxes(Some("k1"), None, 10, false).expect("list").len(), 5);
}

fn idempotency_keys_are_unique_per_owner(s: &Backend) {
    s.insert_sandbox_free(&sandbox("a", 1)).expect("insert");
    let mut dup = sandbox("b", 2);
    dup.idempotency_key = Some("key-a".into());
    assert!(matches!(s.insert_sandbox_free(&dup), Err(StoreError::Conflict)));
    assert_eq!(s.sandbox_by_key("k1", "key-a").expect("get").map(|r| r.id), Some("a".into()));
}

fn exec_journal_begins_once_finishes_and_loses_running_on_restart(s: &Backend) {
    assert_eq!(s.begin_exec("sb", "k", "h1", 1, "a").expect("begin"), Begin::Started);
    match s.begin_exec("sb", "k", "h1", 2, "a").expect("begin") {
        Begin::Existing(e) => assert_eq!(e.state, ExecState::Running),
        other => panic!("{other:?}"),
    }
    s.finish_exec("sb", "k", "{\"exit_code\":0}").expect("finish");
    match s.begin_exec("sb", "k", "h1", 3, "a").expect("begin") {
        Begin::Existing(e) => {
            assert_eq!((e.state, e.result.as_deref()), (ExecState::Done, Some("{\"exit_code\":0}")))
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(s.begin_exec("sb", "k2", "h", 4, "a").expect("begin"), Begin::Started);
    // Another node's command runs on through this node's restart; one of
    // no known node (journaled before commands named theirs) is lost.
    assert_eq!(s.begin_exec("sb-b", "k", "h", 4, "b").expect("begin"), Begin::Started);
    s.raw_execute(
        "INSERT INTO executions (scope, key, request_hash, state, result, created_at) \
         VALUES ('sb-old', 'k', 'h', 'running', NULL, 1)",
    )
    .expect("a row of an earlier version");
    assert_eq!(s.mark_running_execs_lost("a").expect("lost"), 2);
    match s.begin_exec("sb-b", "k", "h", 5, "b").expect("begin") {
        Begin::Existing(e) => assert_eq!(e.state, ExecState::Running, "b's command is b's to lose"),
        other => panic!("{other:?}"),
    }
    assert_eq!(s.mark_running_execs_lost("b").expect("lost"), 1);
    s.release_exec("sb", "k2").expect("release only frees running keys");
    match s.begin_exec("sb", "k2", "h", 5, "a").expect("begin") {
        Begin::Existing(e) => assert_eq!(e.state, ExecState::Lost),
        other => panic!("{other:?}"),
    }
    assert_eq!(s.begin_exec("sb", "k3", "h", 6, "a").expect("begin"), Begin::Started);
    s.release_exec("sb", "k3").expect("release");
    assert_eq!(s.begin_exec("sb", "k3", "h", 7, "a").expect("begin"), Begin::Started);
}

fn template(id: &str, version: i64) -> TemplateRecord {
    TemplateRecord {
        id: id.into(),
        owner: "k1".into(),
        name: "py".into(),
        version,
        image: "base".into(),
        class: "container".into(),
        memory_mb: 512,
        vcpus: 1.0,
        disk_mib: 1024,
        pids: 512,
        env: "{}".into(),
        default_ttl_s: 600,
        max_ttl_s: 3600,
        warm_min: 2,
        warm_max: 2,
        created_at: 1,
        updated_at: 1,
        deleted_at: None,
        startup: None,
        readiness: None,
        network: "{}".into(),
        storage: None,
        on_expire: None,
        paused_ttl_s: None,
        idle_timeout_s: None,
        on_idle: None,
        secrets: "[]".into(),
    }
}

fn pooled(id: &str, created_at: i64, version: i64) -> SandboxRecord {
    SandboxRecord {
        template_id: Some("tpl-1".into()),
        template_version: Some(version),
        warm: true,
        pooled: true,
        idempotency_key: None,
        ..sandbox(id, created_at)
    }
}

fn claim(now: i64) -> Claim<'static> {
    Claim {
        template_id: "tpl-1",
        owner: "k1",
        now,
        expires_at: now + 60,
        max_expires_at: now + 3600,
        metadata: "{\"a\":\"b\"}",
        idempotency_key: None,
        request_hash: "h",
        storage: StorageKind::Disk,
        on_expire: OnExpire::Pause,
        ttl_s: Some(60),
        paused_ttl_s: Some(120),
        node: "local",
    }
}

fn warm_claims_take_the_oldest_of_the_current_version_only(s: &Backend) {
    s.insert_template(&template("tpl-1", 1)).expect("insert");
    s.insert_sandbox_free(&pooled("old", 1, 1)).expect("insert");
    s.insert_sandbox_free(&pooled("new", 2, 1)).expect("insert");
    // Pooled sandboxes are nobody's yet.
    assert!(s.list_sandboxes(Some("k1"), None, 10, false).expect("list").is_empty());
    let got = s.claim_warm(&claim(100)).expect("claim").expect("one ready");
    assert_eq!((got.id.as_str(), got.pooled, got.warm, got.created_at), ("old", false, true, 100));
    assert_eq!(got.metadata, "{\"a\":\"b\"}");
    // The claim's lifecycle replaces the pooled one's.
    assert_eq!((got.on_expire, got.ttl_s, got.paused_ttl_s), (OnExpire::Pause, Some(60), Some(120)));
    assert_eq!(s.list_sandboxes(Some("k1"), None, 10, false).expect("list").len(), 1);
    // A new version: the remaining v1 sandbox can no longer be claimed.
    let mut t = template("tpl-1", 2);
    assert!(s.update_template(&t, 1).expect("update"));
    assert_eq!(s.claim_warm(&claim(101)).expect("claim"), None);
    // A drained one cannot be claimed either, and a deleted template has no pool.
    s.insert_sandbox_free(&pooled("v2", 3, 2)).expect("insert");
    assert!(s.drain_pooled("v2").expect("drain"));
    assert_eq!(s.claim_warm(&claim(102)).expect("claim"), None);
    s.insert_sandbox_free(&pooled("v2b", 4, 2)).expect("insert");
    t.deleted_at = Some(5);
    assert!(s.update_template(&t, 1).expect("delete"));
    assert_eq!(s.claim_warm(&claim(103)).expect("claim"), None);
    assert!(s.template_by_name("k1", "py").expect("get").is_none());
    assert_eq!(s.pooled_sandboxes(None).expect("pooled").len(), 3);
}

fn a_template_update_writes_every_column_an_insert_does(s: &Backend) {
    s.insert_template(&template("tpl-1", 1)).expect("insert");
    let t = TemplateRecord {
        version: 2,
        image: "python".into(),
        env: "{\"A\":\"1\"}".into(),
        startup: Some("{}".into()),
        storage: Some(StorageKind::Memory),
        on_expire: Some(OnExpire::Pause),
        paused_ttl_s: Some(3600),
        idle_timeout_s: Some(600),
        on_idle: Some(hutch_api::OnIdle::Delete),
        secrets: "[\"TOKEN\"]".into(),
        updated_at: 2,
        ..template("tpl-1", 1)
    };
    assert!(s.update_template(&t, 1).expect("update"));
    assert_eq!(s.get_template("tpl-1").expect("get"), Some(t.clone()));
    // Only over the version that was read.
    assert!(!s.update_template(&t, 1).expect("stale update"));
    let mut r = sandbox("a", 1);
    r.on_expire = OnExpire::Pause;
    r.paused_ttl_s = Some(7);
    s.insert_sandbox_free(&r).expect("insert");
    assert_eq!(s.get_sandbox("a").expect("get"), Some(r));
}

fn template_names_are_unique_among_live_templates(s: &Backend) {
    s.insert_template(&template("tpl-1", 1)).expect("insert");
    assert!(matches!(s.insert_template(&template("tpl-2", 1)), Err(StoreError::Conflict)));
    let mut t = template("tpl-1", 1);
    t.deleted_at = Some(2);
    assert!(s.update_template(&t, 1).expect("delete"));
    s.insert_template(&template("tpl-2", 1)).expect("the name is free again");
    assert_eq!(s.list_templates(Some("k1")).expect("list").len(), 1);
}

fn builds_are_listed_newest_first_and_unfinished_ones_fail_on_restart(s: &Backend) {
    let mut t = template("tpl-1", 1);
    t.startup = Some(r#"{"command":"serve"}"#.into());
    s.insert_template(&t).expect("template");
    assert_eq!(
        s.get_template("tpl-1").expect("get").and_then(|t| t.startup).as_deref(),
        Some(r#"{"command":"serve"}"#)
    );
    for (i, state) in [BuildState::Succeeded, BuildState::Building, BuildState::Queued].into_iter().enumerate() {
        let b = BuildRecord {
            id: format!("bld-{i}"),
            template_id: "tpl-1".into(),
            owner: "k1".into(),
            state,
            created_at: i as i64,
            finished_at: None,
            error: None,
            parent: "base".into(),
            image: None,
            version: None,
            node: "a".into(),
        };
        assert!(s.insert_build(&b, None).expect("insert"));
    }
    // Another node's build, and one of no known node (an earlier version).
    let other = BuildRecord {
        id: "bld-b".into(),
        node: "b".into(),
        created_at: -1,
        ..s.get_build("bld-1").expect("get").expect("some")
    };
    assert!(s.insert_build(&other, None).expect("insert"));
    let old = BuildRecord { id: "bld-old".into(), created_at: -2, ..other.clone() };
    assert!(s.insert_build(&old, None).expect("insert"));
    s.raw_execute("UPDATE builds SET node = NULL WHERE id = 'bld-old'").expect("a row of an earlier version");
    assert_eq!(s.get_build("bld-old").expect("get").expect("some").node, "");
    let ids: Vec<String> = s.list_builds("tpl-1").expect("list").into_iter().map(|b| b.id).collect();
    assert_eq!(ids, ["bld-2", "bld-1", "bld-0", "bld-b", "bld-old"]);
    // A build's image pushed to the fleet's registry: the reference is kept.
    assert_eq!(s.pushed(Pushed::Build, "bld-0").expect("read"), None);
    assert!(s.set_pushed(Pushed::Build, "bld-0", Some("r/build-bld-0@sha256:22")).expect("set"));
    assert_eq!(s.pushed(Pushed::Build, "bld-0").expect("read").as_deref(), Some("r/build-bld-0@sha256:22"));
    assert_eq!(s.fail_unfinished_builds("a", 9, "interrupted").expect("fail"), 3);
    let b = s.get_build("bld-1").expect("get").expect("some");
    assert_eq!((b.state, b.finished_at, b.error.as_deref()), (BuildState::Failed, Some(9), Some("interrupted")));
    assert_eq!(b.node, "a");
    assert_eq!(s.get_build("bld-0").expect("get").expect("some").state, BuildState::Succeeded);
    assert_eq!(s.get_build("bld-old").expect("get").expect("some").state, BuildState::Failed);
    assert_eq!(s.get_build("bld-b").expect("get").expect("some").state, BuildState::Building, "b's to fail");
    assert_eq!(s.fail_unfinished_builds("b", 10, "interrupted").expect("fail"), 1);
}

/// A file store's quick reads run on a connection of their own: they must
/// see each commit made before them, by the store itself or by another
/// connection to the file (`hutch key revoke` is another process), and
/// must not write.
#[test]
fn quick_reads_see_every_commit_made_before_them() {
    let dir = Scratch::new("quick");
    let path = dir.0.join("hutch.db");
    let s = SqliteStore::open(&path).expect("open");
    let quick = s.quick_reads().expect("a file store has quick reads");
    let k = KeyRecord {
        id: "k1".into(),
        name: "user".into(),
        hash: "abc".into(),
        admin: false,
        created_at: 1,
        revoked_at: None,
        quotas: Quotas::default(),
    };
    assert_eq!(quick.key_by_hash("abc").expect("read"), None);
    s.insert_key(&k).expect("insert");
    assert_eq!(quick.key_by_hash("abc").expect("read"), Some(k.clone()));
    // Revoked through another connection, as the command line does.
    let other = SqliteStore::open(&path).expect("open again");
    assert!(other.revoke_key("k1", 5).expect("revoke"));
    assert_eq!(quick.key_by_hash("abc").expect("read").and_then(|k| k.revoked_at), Some(5));

    s.insert_sandbox_free(&sandbox("a", 1)).expect("insert");
    s.transition("a", &[SandboxState::Running], SandboxState::Paused, &Changes::default()).expect("pause");
    assert_eq!(quick.get_sandbox("a").expect("read").map(|r| r.state), Some(SandboxState::Paused));
    let mut t = template("t1", 1);
    s.insert_template(&t).expect("template");
    assert_eq!(quick.template_by_name("k1", "py").expect("read").map(|t| t.id), Some("t1".into()));
    t.deleted_at = Some(9);
    assert!(s.update_template(&t, t.updated_at).expect("delete"));
    assert_eq!(quick.template_by_name("k1", "py").expect("read"), None);

    let written = s.reader_for_tests().expect("reader").execute("DELETE FROM api_keys", []);
    assert!(written.is_err(), "the reader's connection writes nothing");
    assert_eq!(s.count_keys().expect("count"), 1);
    assert!(SqliteStore::open_in_memory().expect("open").quick_reads().is_none());
    drop((s, other));
}

/// A daemon's store checkpoints its WAL on a thread of its own: a commit
/// reaches the database file itself (read with the WAL ignored) although
/// no commit took the WAL past the pages that checkpoint it inline.
#[test]
fn a_background_checkpoint_brings_a_commit_into_the_database_file() {
    let dir = Scratch::new("ckpt");
    let path = dir.0.join("hutch.db");
    // Open for the whole test: closing the last connection checkpoints.
    let plain = SqliteStore::open(&path).expect("open");
    // The database file alone, as it would be found after a power loss
    // that took the unsynced WAL with it.
    let in_file = |id: &str| -> bool {
        let c = rusqlite::Connection::open_with_flags(
            format!("file:{}?immutable=1", path.display()),
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_URI,
        )
        .expect("open the file alone");
        // Before any checkpoint even the schema is only in the WAL.
        c.query_row("SELECT COUNT(*) FROM api_keys WHERE id = ?1", [id], |r| r.get::<_, i64>(0)).unwrap_or(0) == 1
    };
    let key = |id: &str| KeyRecord {
        id: id.into(),
        name: id.into(),
        hash: format!("hash-{id}"),
        admin: false,
        created_at: 1,
        revoked_at: None,
        quotas: Quotas::default(),
    };
    plain.insert_key(&key("k1")).expect("insert");
    assert!(!in_file("k1"), "a commit stays in the WAL until a checkpoint");
    // A daemon's store on the same file.
    let s = SqliteStore::open_checkpointing(&path).expect("open checkpointing");
    s.insert_key(&key("k2")).expect("insert");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !(in_file("k1") && in_file("k2")) {
        assert!(std::time::Instant::now() < deadline, "no checkpoint within 20 s");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // Stopped and joined with the store, before its directory goes.
    drop((s, plain));
}

fn keys_are_found_by_hash_and_revoked(s: &Backend) {
    let k = KeyRecord {
        id: "k1".into(),
        name: "admin".into(),
        hash: "abc".into(),
        admin: true,
        created_at: 1,
        revoked_at: None,
        quotas: Quotas::default(),
    };
    s.insert_key(&k).expect("insert");
    assert_eq!(s.key_by_hash("abc").expect("get"), Some(k));
    assert!(s.revoke_key("k1", 5).expect("revoke"));
    assert!(!s.revoke_key("k1", 6).expect("revoke twice"));
    assert_eq!(s.key_by_hash("abc").expect("get").and_then(|k| k.revoked_at), Some(5));
    assert_eq!(s.count_keys().expect("count"), 1);
}

fn the_first_key_is_made_only_on_a_store_without_keys(s: &Backend) {
    let admin = |id: &str| KeyRecord {
        id: id.into(),
        name: "admin".into(),
        hash: format!("hash-{id}"),
        admin: true,
        created_at: 1,
        revoked_at: None,
        quotas: Quotas::default(),
    };
    assert!(s.insert_first_key(&admin("k1")).expect("first"));
    assert!(!s.insert_first_key(&admin("k2")).expect("second"), "a key exists");
    assert_eq!(s.list_keys().expect("keys").iter().map(|k| k.id.as_str()).collect::<Vec<_>>(), ["k1"]);
}

fn transitions_are_conditional_on_the_state_they_leave(s: &Backend) {
    let mut r = sandbox("a", 1);
    r.state = SandboxState::Starting;
    s.insert_sandbox_free(&r).expect("insert");
    // With raise_max the latest expiry follows (a pause at expiry keeps a
    // sandbox past it); without, it stays.
    let kept = s.set_expiry("a", 50_000, true, &[SandboxState::Starting]).expect("keep").expect("row");
    assert_eq!((kept.expires_at, kept.max_expires_at), (50_000, 50_000));
    let kept = s.set_expiry("a", 40_000, true, &[SandboxState::Starting]).expect("keep").expect("row");
    assert_eq!((kept.expires_at, kept.max_expires_at), (40_000, 50_000));
    // An extension made while it boots is kept by the boot's transition.
    let extended = s.set_expiry("a", 99_000, false, &[SandboxState::Starting, SandboxState::Running]).expect("extend");
    assert_eq!(extended.map(|r| r.expires_at), Some(99_000));
    let ready = Changes { host_pid: Some(42), limits_applied: Some("enforced"), ..Changes::default() };
    let got = s.transition("a", &[SandboxState::Starting], SandboxState::Running, &ready).expect("ready");
    let got = got.expect("it was starting");
    assert_eq!((got.state, got.expires_at, got.host_pid), (SandboxState::Running, 99_000, Some(42)));
    // Two writers: only the first wins; the second sees None.
    let kill = Changes { last_error_code: Some("sandbox_expired"), ..Changes::default() };
    let from = [SandboxState::Running, SandboxState::Suspended];
    assert!(s.transition("a", &from, SandboxState::Terminating, &kill).expect("first").is_some());
    assert!(s.transition("a", &from, SandboxState::Terminating, &Changes::default()).expect("second").is_none());
    // A resume cannot revert it; nor can an extension touch it now.
    assert!(s
        .transition("a", &[SandboxState::Suspended], SandboxState::Running, &Changes::default())
        .expect("resume")
        .is_none());
    assert!(s.set_expiry("a", 1, false, &[SandboxState::Running]).expect("extend").is_none());
    let now = s.get_sandbox("a").expect("get").expect("row");
    assert_eq!((now.state, now.last_error_code.as_deref()), (SandboxState::Terminating, Some("sandbox_expired")));
    assert!(s
        .transition("missing", &[SandboxState::Running], SandboxState::Terminated, &Changes::default())
        .expect("unknown")
        .is_none());
}

fn admission_counts_what_live_sandboxes_hold(s: &Backend) {
    let owner = Quotas { sandboxes: Some(2), memory_mb: Some(1024), ..Quotas::default() };
    let host = Quotas { memory_mb: Some(1500), ..Quotas::default() };
    let adm = Admission { owner, host };
    assert_eq!(s.insert_sandbox(&sandbox("a", 1), &adm).expect("a"), Admitted::Inserted);
    // 512 + 512 fits the owner's 1024.
    assert_eq!(s.insert_sandbox(&sandbox("b", 2), &adm).expect("b"), Admitted::Inserted);
    let small = SandboxRecord { memory_mb: 64, ..sandbox("c", 3) };
    match s.insert_sandbox(&small, &adm).expect("c") {
        Admitted::Refused(e) => {
            assert_eq!((e.scope, e.resource, e.limit, e.used), (Scope::Owner, Resource::Sandboxes, 2, 2))
        }
        other => panic!("{other:?}"),
    }
    assert!(s.get_sandbox("c").expect("get").is_none(), "a refused sandbox leaves no row");
    // Another owner fits its own quota but not the host's memory.
    let mut other = sandbox("d", 4);
    other.owner = "k2".into();
    other.idempotency_key = None;
    match s.insert_sandbox(&other, &adm).expect("d") {
        Admitted::Refused(e) => {
            assert_eq!((e.scope, e.resource, e.used, e.asked), (Scope::Host, Resource::MemoryMb, 1024, 512))
        }
        other => panic!("{other:?}"),
    }
    // A terminated sandbox holds nothing.
    s.transition("a", &[SandboxState::Running], SandboxState::Terminated, &Changes::default()).expect("end");
    assert_eq!(s.insert_sandbox(&other, &adm).expect("d again"), Admitted::Inserted);
    assert_eq!(s.usage(Some("k1")).expect("usage"), Usage { sandboxes: 1, memory_mb: 512, disk_mib: 1024 });
    assert_eq!(s.usage(None).expect("usage").sandboxes, 2);
}

fn builds_at_once_are_capped_per_owner(s: &Backend) {
    let b = |id: &str, owner: &str| BuildRecord {
        id: id.into(),
        template_id: "tpl-1".into(),
        owner: owner.into(),
        state: BuildState::Queued,
        created_at: 1,
        finished_at: None,
        error: None,
        parent: "base".into(),
        image: None,
        version: None,
        node: "a".into(),
    };
    assert!(s.insert_build(&b("b1", "k1"), Some(1)).expect("first"));
    assert!(!s.insert_build(&b("b2", "k1"), Some(1)).expect("second"));
    assert!(s.insert_build(&b("b3", "k2"), Some(1)).expect("other owner"));
    let done = BuildRecord { state: BuildState::Succeeded, finished_at: Some(2), ..b("b1", "k1") };
    assert!(s.update_build(&done, &[BuildState::Queued, BuildState::Building]).expect("finish"));
    assert!(!s.update_build(&done, &[BuildState::Queued, BuildState::Building]).expect("only once"));
    assert!(s.insert_build(&b("b2", "k1"), Some(1)).expect("room again"));
    assert_eq!(s.count_running_builds(None).expect("count"), 2);
}

fn quotas_are_kept_with_the_key(s: &Backend) {
    let k = KeyRecord {
        id: "k1".into(),
        name: "ci".into(),
        hash: "h".into(),
        admin: false,
        created_at: 1,
        revoked_at: None,
        quotas: Quotas { sandboxes: Some(3), ..Quotas::default() },
    };
    s.insert_key(&k).expect("insert");
    let q = Quotas { memory_mb: Some(2048), ttl_seconds: Some(60), builds: Some(1), ..Quotas::default() };
    assert!(s.set_quotas("k1", &q).expect("set"));
    assert_eq!(s.get_key("k1").expect("get").map(|k| k.quotas), Some(q));
    s.revoke_key("k1", 2).expect("revoke");
    assert!(!s.set_quotas("k1", &Quotas::default()).expect("revoked keys keep theirs"));
}

fn storage_is_kept_and_a_claim_takes_only_a_warm_sandbox_of_the_asked_storage(s: &Backend) {
    s.insert_template(&template("tpl-1", 1)).expect("template");
    assert_eq!(s.get_template("tpl-1").expect("get").expect("some").storage, None);
    let mut t = template("tpl-1", 2);
    t.storage = Some(StorageKind::Memory);
    assert!(s.update_template(&t, 1).expect("update"));
    assert_eq!(s.get_template("tpl-1").expect("get").expect("some").storage, Some(StorageKind::Memory));
    let on_disk = SandboxRecord { template_version: Some(2), ..pooled("d", 1, 2) };
    s.insert_sandbox_free(&on_disk).expect("insert");
    assert_eq!(s.get_sandbox("d").expect("get").expect("some").storage, StorageKind::Disk);
    assert_eq!(s.claim_warm(&Claim { storage: StorageKind::Memory, ..claim(10) }).expect("claim"), None);
    let in_memory = SandboxRecord { storage: StorageKind::Memory, ..pooled("m", 2, 2) };
    s.insert_sandbox_free(&in_memory).expect("insert");
    let got = s.claim_warm(&Claim { storage: StorageKind::Memory, ..claim(10) }).expect("claim").expect("one");
    assert_eq!((got.id.as_str(), got.storage), ("m", StorageKind::Memory));
}

fn snapshots_are_owned_named_once_per_owner_and_counted(s: &Backend) {
    let snap = |id: &str, owner: &str, name: Option<&str>| SnapshotRecord {
        id: id.into(),
        owner: owner.into(),
        name: name.map(str::to_owned),
        sandbox_id: "sb-1".into(),
        created_at: 1,
        size_bytes: 10,
        recipe: "{}".into(),
    };
    assert!(s.insert_snapshot(&snap("snap-1", "k1", Some("a")), Some(2)).expect("insert"));
    assert!(matches!(s.insert_snapshot(&snap("snap-2", "k1", Some("a")), None), Err(StoreError::Conflict)));
    // Another owner may use the name.
    assert!(s.insert_snapshot(&snap("snap-3", "k2", Some("a")), Some(1)).expect("insert"));
    assert!(s.insert_snapshot(&snap("snap-4", "k1", None), Some(2)).expect("insert"));
    assert!(!s.insert_snapshot(&snap("snap-5", "k1", None), Some(2)).expect("over quota"));
    assert_eq!(s.snapshot_by_name("k1", "a").expect("by name").map(|r| r.id), Some("snap-1".into()));
    assert_eq!(s.snapshot_by_name("k2", "a").expect("by name").map(|r| r.id), Some("snap-3".into()));
    assert_eq!(s.list_snapshots(Some("k1")).expect("list").len(), 2);
    assert_eq!(s.list_snapshots(None).expect("list").len(), 3);
    assert!(s.delete_snapshot("snap-1").expect("delete"));
    assert!(!s.delete_snapshot("snap-1").expect("again"));
    assert_eq!(s.get_snapshot("snap-1").expect("get"), None);
}

fn volume(id: &str, owner: &str, name: &str, size_mib: u64) -> VolumeRecord {
    VolumeRecord { id: id.into(), owner: owner.into(), name: name.into(), size_mib, created_at: 1, node: "n1".into() }
}

fn vclaim(volume_id: &str, sandbox_id: &str, read_only: bool) -> VolumeClaim {
    VolumeClaim { volume_id: volume_id.into(), sandbox_id: sandbox_id.into(), path: "/data".into(), read_only }
}

fn volume_claims_are_one_writer_or_many_readers_and_end_with_their_sandbox(s: &Backend) {
    let free = Admission::default();
    assert_eq!(s.insert_volume(&volume("v1", "k1", "data", 64), &free).expect("insert"), VolumeAdmitted::Written);
    assert!(matches!(s.insert_volume(&volume("v2", "k1", "data", 64), &free), Err(StoreError::Conflict)));
    // Another owner's name space is its own.
    assert_eq!(s.insert_volume(&volume("v3", "k2", "data", 64), &free).expect("insert"), VolumeAdmitted::Written);
    // Its node is kept: its routes are answered there.
    assert_eq!(s.volume_by_name("k2", "data").expect("get").map(|v| v.node).as_deref(), Some("n1"));
    let claiming =
        |id: &str, ro: bool| s.insert_sandbox_claiming(&sandbox(id, 1), &free, &[vclaim("v1", id, ro)], None);
    assert_eq!(claiming("w1", false).expect("w1"), Admitted::Inserted);
    // A second writer, or a reader beside the writer: refused, not inserted.
    assert_eq!(claiming("w2", false).expect("w2"), Admitted::VolumeInUse("v1".into()));
    assert_eq!(claiming("r1", true).expect("r1"), Admitted::VolumeInUse("v1".into()));
    assert!(s.get_sandbox("w2").expect("get").is_none() && s.get_sandbox("r1").expect("get").is_none());
    assert_eq!(s.delete_volume("v1").expect("delete"), VolumeDeleted::InUse("w1".into()));
    // The writer's end releases its claim; readers share.
    s.transition("w1", &[SandboxState::Running], SandboxState::Terminated, &Changes::default()).expect("end");
    assert_eq!(claiming("r1", true).expect("r1"), Admitted::Inserted);
    assert_eq!(claiming("r2", true).expect("r2"), Admitted::Inserted);
    assert_eq!(claiming("w3", false).expect("w3"), Admitted::VolumeInUse("v1".into()));
    let holders: Vec<String> = s.volume_holders("v1").expect("holders").into_iter().map(|c| c.sandbox_id).collect();
    assert_eq!(holders, ["r1", "r2"]);
    assert_eq!(s.volume_claims("r1").expect("claims"), [vclaim("v1", "r1", true)]);
    // A paused sandbox holds its claim.
    s.transition("r1", &[SandboxState::Running], SandboxState::Paused, &Changes::default()).expect("pause");
    s.transition("r2", &[SandboxState::Running], SandboxState::Terminated, &Changes::default()).expect("end");
    assert_eq!(s.delete_volume("v1").expect("delete"), VolumeDeleted::InUse("r1".into()));
    s.transition("r1", &[SandboxState::Paused], SandboxState::Terminated, &Changes::default()).expect("end");
    assert_eq!(s.delete_volume("v1").expect("delete"), VolumeDeleted::Deleted);
    assert_eq!(s.delete_volume("v1").expect("delete"), VolumeDeleted::NotFound);
    assert!(s.volume_claims("r1").expect("claims").is_empty());
    // A claim of a volume deleted meanwhile inserts nothing.
    assert_eq!(claiming("r3", true).expect("r3"), Admitted::VolumeGone("v1".into()));
    assert!(s.get_sandbox("r3").expect("get").is_none());
}

fn volumes_count_toward_disk_and_grow_under_the_caps(s: &Backend) {
    let caps = Admission { owner: Quotas { disk_mib: Some(1000), ..Quotas::default() }, host: Quotas::default() };
    assert_eq!(s.insert_volume(&volume("v1", "k1", "a", 600), &caps).expect("insert"), VolumeAdmitted::Written);
    assert!(matches!(
        s.insert_volume(&volume("v2", "k1", "b", 600), &caps).expect("insert"),
        VolumeAdmitted::Refused(_)
    ));
    assert!(s.get_volume("v2").expect("get").is_none());
    assert_eq!(s.usage(Some("k1")).expect("usage").disk_mib, 600);
    assert_eq!(s.volume_usage(Some("k1")).expect("usage"), (1, 600));
    assert!(matches!(s.resize_volume("v1", 1001, &caps).expect("resize"), Some(VolumeAdmitted::Refused(_))));
    assert_eq!(s.resize_volume("v1", 1000, &caps).expect("resize"), Some(VolumeAdmitted::Written));
    assert_eq!(s.get_volume("v1").expect("get").expect("v1").size_mib, 1000);
    assert_eq!(s.resize_volume("nope", 1, &caps).expect("resize"), None);
    // A sandbox's disk counts beside it.
    let sb = SandboxRecord { disk_mib: 100, ..sandbox("s1", 1) };
    assert!(matches!(s.insert_sandbox(&sb, &caps).expect("insert"), Admitted::Refused(_)));
}

fn audit_row(at: i64, key: &str, route: &str, status: u16) -> AuditRecord {
    AuditRecord {
        seq: 0,
        at,
        key_id: key.into(),
        key_name: String::new(),
        method: "POST".into(),
        route: route.into(),
        targets: "{}".into(),
        client: "127.0.0.1".into(),
        status,
        error_code: (status >= 400).then(|| "not_found".to_owned()),
    }
}

fn audit_rows_append_list_newest_first_and_prune(s: &Backend) {
    let k = KeyRecord {
        id: "k1".into(),
        name: "ci".into(),
        hash: "h".into(),
        admin: false,
        created_at: 1,
        revoked_at: None,
        quotas: Quotas::default(),
    };
    s.insert_key(&k).expect("insert");
    let rows: Vec<_> = (0..5)
        .map(|i| audit_row(100 + i, if i % 2 == 0 { "k1" } else { "k2" }, "/v1/sandboxes", 201))
        .chain([audit_row(200, "k1", "/v1/sandboxes/{id}", 404)])
        .collect();
    s.append_audit(&rows).expect("append");

    let all = s.list_audit(&AuditQuery { limit: 100, ..AuditQuery::default() }).expect("list");
    assert_eq!(all.iter().map(|r| r.at).collect::<Vec<_>>(), [200, 104, 103, 102, 101, 100]);
    // The key's name is copied at append time; an unknown key's is empty.
    assert_eq!((all[0].key_name.as_str(), all[1].key_name.as_str()), ("ci", "ci"));
    assert_eq!(all[2].key_name, "");
    assert_eq!((all[0].status, all[0].error_code.as_deref()), (404, Some("not_found")));
    assert_eq!(all[1].error_code, None);

    // Filters and pages.
    let mine = s.list_audit(&AuditQuery { key: Some("k1".into()), limit: 2, ..AuditQuery::default() }).expect("list");
    assert_eq!(mine.iter().map(|r| r.at).collect::<Vec<_>>(), [200, 104]);
    let next = AuditQuery { key: Some("k1".into()), before: Some(mine[1].seq), limit: 2, ..AuditQuery::default() };
    assert_eq!(s.list_audit(&next).expect("list").iter().map(|r| r.at).collect::<Vec<_>>(), [102, 100]);
    let window = AuditQuery { from: Some(101), to: Some(103), limit: 10, ..AuditQuery::default() };
    assert_eq!(s.list_audit(&window).expect("list").iter().map(|r| r.at).collect::<Vec<_>>(), [103, 102, 101]);

    // Rows are never rewritten, even by SQL that bypasses the trait.
    let err = s.raw_execute("UPDATE audit SET status = 200").expect_err("update refused");
    assert!(err.contains("append-only"), "{err}");

    assert_eq!(s.prune_audit(103).expect("prune"), 3);
    let left = s.list_audit(&AuditQuery { limit: 100, ..AuditQuery::default() }).expect("list");
    assert_eq!(left.iter().map(|r| r.at).collect::<Vec<_>>(), [200, 104, 103]);
    // Pruning does not reuse sequence numbers: cursors stay valid.
    s.append_audit(&[audit_row(300, "k1", "/v1/keys", 201)]).expect("append");
    let top = s.list_audit(&AuditQuery { limit: 1, ..AuditQuery::default() }).expect("list");
    assert!(top[0].seq > all[0].seq);
}

fn event(id: i64, owner: &str, kind: &str, sandbox: Option<&str>) -> EventRecord {
    EventRecord {
        id,
        at: 100 + id,
        owner: owner.into(),
        kind: kind.into(),
        sandbox_id: sandbox.map(str::to_owned),
        body: format!("{{\"id\":{id},\"type\":\"{kind}\"}}"),
    }
}

fn webhook(id: &str, owner: &str, events: &[&str]) -> WebhookRecord {
    WebhookRecord {
        id: id.into(),
        owner: owner.into(),
        url: "https://example.com/hook".into(),
        events: events.iter().map(|e| (*e).to_owned()).collect(),
        secret: "s".into(),
        created_at: 1,
        format: "native".into(),
        name: String::new(),
        enabled: true,
    }
}

fn events_list_oldest_first_filtered_and_pruned(s: &Backend) {
    assert_eq!(s.last_event_id().expect("last"), 0);
    // The ids the rows come with are not the store's: it gives its own.
    let mut rows = [
        event(1, "k1", "sandbox.created", Some("sb-1")),
        event(2, "k2", "sandbox.created", Some("sb-2")),
        event(3, "k1", "sandbox.ready", Some("sb-1")),
        event(4, "k1", "key.revoked", None),
    ];
    for r in &mut rows {
        r.id = 77;
    }
    assert_eq!(s.append_events(&mut rows).expect("append"), 0, "no webhooks, no deliveries");
    assert_eq!(rows.map(|r| r.id), [1, 2, 3, 4]);
    assert_eq!(s.last_event_id().expect("last"), 4);
    let ids = |q: EventQuery| s.list_events(&q).expect("list").iter().map(|e| e.id).collect::<Vec<_>>();
    assert_eq!(ids(EventQuery { limit: 10, ..EventQuery::default() }), [1, 2, 3, 4]);
    assert_eq!(ids(EventQuery { owner: Some("k1".into()), limit: 10, ..EventQuery::default() }), [1, 3, 4]);
    assert_eq!(ids(EventQuery { owner: Some("k1".into()), after: Some(1), limit: 1, ..EventQuery::default() }), [3]);
    assert_eq!(ids(EventQuery { kinds: vec!["sandbox.created".into()], limit: 10, ..EventQuery::default() }), [1, 2]);
    assert_eq!(ids(EventQuery { sandbox_id: Some("sb-1".into()), limit: 10, ..EventQuery::default() }), [1, 3]);
    assert_eq!(ids(EventQuery { from: Some(102), to: Some(103), limit: 10, ..EventQuery::default() }), [2, 3]);
    assert_eq!(s.prune_events(103).expect("prune"), 2);
    assert_eq!(ids(EventQuery { limit: 10, ..EventQuery::default() }), [3, 4]);
    // An id is given once, even when the newest were pruned: a cursor
    // never points past events still to come.
    assert_eq!(s.prune_events(i64::MAX).expect("prune"), 2);
    let mut more = [event(0, "k1", "sandbox.created", Some("sb-3")), event(0, "k1", "sandbox.ready", Some("sb-3"))];
    s.append_events(&mut more).expect("append");
    assert_eq!(more.map(|r| r.id), [5, 6]);
    assert_eq!(ids(EventQuery { after: Some(4), limit: 10, ..EventQuery::default() }), [5, 6]);
}

fn deliveries_are_made_with_their_events_for_matching_webhooks(s: &Backend) {
    assert!(s.insert_webhook(&webhook("wh-1", "k1", &["*"]), 2).expect("insert"));
    assert!(s.insert_webhook(&webhook("wh-2", "k1", &["sandbox.ready"]), 2).expect("insert"));
    assert!(!s.insert_webhook(&webhook("wh-3", "k1", &["*"]), 2).expect("insert"), "over the owner's limit");
    assert!(s.insert_webhook(&webhook("wh-4", "k2", &["sandbox.created"]), 2).expect("insert"));
    assert_eq!(s.get_webhook("wh-2").expect("get").expect("found").events, ["sandbox.ready"]);
    assert_eq!(s.list_webhooks(Some("k1")).expect("list").len(), 2);
    assert_eq!(s.list_webhooks(None).expect("list").len(), 3);

    let mut rows = [event(1, "k1", "sandbox.created", Some("sb-1")), event(2, "k1", "sandbox.ready", Some("sb-1"))];
    // created → wh-1; ready → wh-1 and wh-2; k2's webhook sees none of k1's.
    assert_eq!(s.append_events(&mut rows).expect("append"), 3);
    assert_eq!(s.list_deliveries("wh-4", None, 10).expect("list").len(), 0);
    let d1 = s.list_deliveries("wh-1", None, 10).expect("list");
    assert_eq!(d1.iter().map(|d| d.event_id).collect::<Vec<_>>(), [2, 1], "newest first");
    assert_eq!(d1[0].status, DeliveryStatus::Pending);
    assert_eq!(d1[0].payload, rows[1].body);

    assert_eq!(s.next_delivery_at().expect("next"), Some(101));
    assert_eq!(s.claim_deliveries("a", 101, 200, 1).expect("due").len(), 1);
    // What "a" holds is not "b"'s to take until the claim runs out (200).
    assert_eq!(s.claim_deliveries("b", 150, 250, 10).expect("due").len(), 2, "the two a did not claim");
    assert_eq!(s.next_delivery_at().expect("next"), Some(200), "a claim counts until it runs out");
    let due = s.claim_deliveries("a", 1000, 2000, 10).expect("due");
    assert_eq!(due.len(), 3, "claims that ran out are taken again");
    let (d, w) = &due[0];
    assert_eq!((d.event_id, w.id.as_str()), (1, "wh-1"));
    let retry = Attempt {
        at: 1000,
        status: DeliveryStatus::Pending,
        next_at: Some(5000),
        http_status: Some(500),
        error: Some("HTTP 500".into()),
    };
    assert!(!s.record_attempt(d.id, "b", &retry).expect("attempt"), "b's claim ran out, a has it");
    assert!(s.record_attempt(d.id, "a", &retry).expect("attempt"));
    assert_eq!(s.claim_deliveries("b", 2000, 3000, 10).expect("due").len(), 2, "a's other claims ran out");
    assert!(s.claim_deliveries("b", 2500, 3000, 10).expect("due").is_empty(), "b holds them");
    // A restart of b frees what b held (its sends were cut short): a takes
    // them at once, not when the claims run out.
    assert_eq!(s.release_deliveries("b").expect("release"), 2);
    assert_eq!(s.claim_deliveries("a", 2600, 3000, 10).expect("due").len(), 2);
    assert_eq!(s.release_deliveries("b").expect("release"), 0, "a's claims are a's");
    let d = d.id;
    let again = s.claim_deliveries("a", 5000, 6000, 10).expect("due");
    assert!(again.iter().any(|(x, _)| x.id == d), "its retry is due");
    let ok =
        Attempt { at: 5000, status: DeliveryStatus::Delivered, next_at: None, http_status: Some(200), error: None };
    assert!(s.record_attempt(d, "a", &ok).expect("attempt"));
    let d = s.list_deliveries("wh-1", None, 10).expect("list").pop().expect("one");
    assert_eq!((d.status, d.attempts, d.last_status), (DeliveryStatus::Delivered, 2, Some(200)));

    // A prune keeps pending deliveries; a delete takes a webhook's all.
    s.prune_events(10_000).expect("prune");
    assert_eq!(s.list_deliveries("wh-1", None, 10).expect("list").len(), 1);
    assert!(s.delete_webhook("wh-1").expect("delete"));
    assert!(!s.delete_webhook("wh-1").expect("delete"));
    assert_eq!(s.list_deliveries("wh-1", None, 10).expect("list").len(), 0);
}

fn report(s: &Backend, owner: Option<&str>, from: i64, to: i64, now: i64, group: UsageGroup) -> Vec<UsageRow> {
    s.usage_report(&UsageQuery { owner: owner.map(str::to_owned), from, to, now, group }).expect("report")
}

/// A sandbox's ledger follows its transitions: running time bills memory
/// and vCPUs, paused time is paused, every state but terminated bills its
/// layer; an open interval ends at `now`; a mark that changes nothing
/// writes nothing.
fn usage_follows_transitions_and_open_intervals_end_now(s: &Backend) {
    let mut r = sandbox("a", 0);
    r.state = SandboxState::Starting;
    r.disk_mib = 1024;
    s.insert_sandbox_free(&r).expect("insert");
    s.usage_mark(&r, 0).expect("mark");
    r.state = SandboxState::Running;
    s.usage_mark(&r, 1_000).expect("mark");
    s.usage_mark(&r, 5_000).expect("the same: nothing");
    r.state = SandboxState::Paused;
    s.usage_mark(&r, 11_000).expect("mark");
    let rows = report(s, Some("k1"), 0, 100_000, 13_000, UsageGroup::Key);
    assert_eq!(rows.len(), 1);
    let row = &rows[0];
    assert_eq!(row.key, "k1");
    assert_eq!(row.memory_mib_seconds, 512.0 * 10.0);
    assert_eq!(row.vcpu_seconds, 10.0);
    // Paused from 11 s to now (13 s).
    assert_eq!(row.paused_seconds, 2.0);
    // 1 GiB for 13 s.
    assert!((row.disk_gib_hours - 13.0 / 3600.0).abs() < 1e-12, "{}", row.disk_gib_hours);
    // Ended: nothing grows after.
    r.state = SandboxState::Terminated;
    s.usage_mark(&r, 13_000).expect("end");
    assert_eq!(report(s, None, 0, 100_000, 99_000, UsageGroup::Key), rows);
    assert!(s.usage_open_subjects().expect("open").is_empty());
    // Another owner's report sees none of it.
    assert!(report(s, Some("k2"), 0, 100_000, 99_000, UsageGroup::Key).is_empty());
    // A window clips: from 5 s to 8 s, running only.
    let w = report(s, None, 5_000, 8_000, 99_000, UsageGroup::Sandbox);
    assert_eq!(w[0].group.as_deref(), Some("a"));
    assert_eq!(w[0].memory_mib_seconds, 512.0 * 3.0);
    assert_eq!(w[0].paused_seconds, 0.0);
}

/// An insert, a claim and a transition asked to (`usage_at`) move the
/// ledger in their own transaction: what a separate `usage_mark` at the
/// same time would have written; without it they leave the ledger alone.
fn a_state_change_marks_its_usage_in_its_own_transaction(s: &Backend) {
    let open = |s: &Backend| {
        let mut v = s.usage_open_subjects().expect("open");
        v.sort_by(|a, b| a.1.cmp(&b.1));
        v
    };
    let starting = SandboxRecord { state: SandboxState::Starting, ..sandbox("a", 0) };
    assert_eq!(
        s.insert_sandbox_claiming(&starting, &Admission::default(), &[], Some(1_000)).expect("insert"),
        Admitted::Inserted
    );
    assert_eq!(open(s), [(UsageKind::Held, "a".to_owned())]);
    // Without usage_at nothing moves.
    let run = |at| Changes { usage_at: at, ..Changes::default() };
    s.insert_sandbox_free(&SandboxRecord { state: SandboxState::Starting, ..sandbox("b", 0) }).expect("insert");
    assert!(s.transition("b", &[SandboxState::Starting], SandboxState::Running, &run(None)).expect("t").is_some());
    assert_eq!(open(s), [(UsageKind::Held, "a".to_owned())]);
    // Running from 3 s to 13 s: 10 s of 512 MiB and one vCPU.
    let r = s.transition("a", &[SandboxState::Starting], SandboxState::Running, &run(Some(3_000))).expect("t");
    assert_eq!(r.map(|r| r.state), Some(SandboxState::Running));
    assert_eq!(open(s), [(UsageKind::Running, "a".to_owned())]);
    // A transition that does not happen writes nothing.
    assert!(s.transition("a", &[SandboxState::Paused], SandboxState::Running, &run(Some(5_000))).expect("t").is_none());
    assert!(s
        .transition("a", &[SandboxState::Running], SandboxState::Terminated, &run(Some(13_000)))
        .expect("t")
        .is_some());
    assert!(open(s).is_empty());
    let rows = report(s, Some("k1"), 0, 100_000, 99_000, UsageGroup::Sandbox);
    let a = rows.iter().find(|r| r.group.as_deref() == Some("a")).expect("a's row");
    assert_eq!((a.memory_mib_seconds, a.vcpu_seconds), (512.0 * 10.0, 10.0));
    // A claim makes a pooled sandbox's usage its claimer's from the claim on.
    s.insert_template(&template("tpl-1", 1)).expect("insert");
    s.insert_sandbox_free(&pooled("warm", 1, 1)).expect("insert");
    let got = s.claim_warm(&claim(20_000)).expect("claim").expect("one ready");
    assert_eq!(got.id, "warm");
    assert_eq!(open(s), [(UsageKind::Running, "warm".to_owned())]);
    let rows = report(s, Some("k1"), 0, 100_000, 21_000, UsageGroup::Sandbox);
    let w = rows.iter().find(|r| r.group.as_deref() == Some("warm")).expect("warm's row");
    assert_eq!(w.vcpu_seconds, 1.0);
    // A ledger row the store cannot read fails the mark, not the state
    // change: the mark alone is undone, the transition is kept.
    s.raw_execute("UPDATE usage_intervals SET kind = 'bogus' WHERE subject = 'warm' AND end_ms IS NULL")
        .expect("corrupt the open interval");
    let ended = s.transition("warm", &[SandboxState::Running], SandboxState::Terminated, &run(Some(30_000)));
    assert_eq!(ended.expect("a transition despite the ledger").map(|r| r.state), Some(SandboxState::Terminated));
    assert_eq!(s.get_sandbox("warm").expect("get").map(|r| r.state), Some(SandboxState::Terminated));
}

fn usage_by_day_splits_at_utc_midnight(s: &Backend) {
    assert_eq!(split_days(10, 20), vec![(10, 20)]);
    let day = 86_400_000;
    assert_eq!(split_days(day - 5, 2 * day + 5), vec![(day - 5, day), (day, 2 * day), (2 * day, 2 * day + 5)]);
    assert!(split_days(5, 5).is_empty());
    let mut r = sandbox("a", 0);
    s.insert_sandbox_free(&r).expect("insert");
    // Running from an hour before midnight (1970-01-01/02) to two after.
    s.usage_mark(&r, day - 3_600_000).expect("mark");
    r.state = SandboxState::Terminated;
    s.usage_mark(&r, day + 7_200_000).expect("end");
    let rows = report(s, None, 0, 10 * day, 20 * day, UsageGroup::Day);
    let got: Vec<(Option<&str>, f64)> = rows.iter().map(|r| (r.group.as_deref(), r.vcpu_seconds)).collect();
    assert_eq!(got, [(Some("1970-01-01"), 3600.0), (Some("1970-01-02"), 7200.0)]);
}

fn usage_counts_objects_and_a_lost_sandbox(s: &Backend) {
    let snap = UsageInterval {
        owner: "k1".into(),
        kind: UsageKind::Snapshot,
        subject: "snap-1".into(),
        sandbox_id: Some("a".into()),
        template: Some("base".into()),
        memory_mb: 0,
        vcpus: 0.0,
        size_bytes: 2 << 30,
        start: 0,
        end: None,
    };
    s.usage_mark_object(Some(&snap), "snap-1", 0).expect("open");
    s.usage_mark_object(None, "snap-1", 3_600_000).expect("close");
    let vol = UsageInterval { kind: UsageKind::Volume, subject: "vol-1".into(), sandbox_id: None, ..snap.clone() };
    s.usage_mark_object(Some(&vol), "vol-1", 0).expect("open");
    // Resized to 4 GiB after half an hour.
    let bigger = UsageInterval { size_bytes: 4 << 30, ..vol.clone() };
    s.usage_mark_object(Some(&bigger), "vol-1", 1_800_000).expect("resize");
    s.usage_flush(
        &[UsageCount {
            owner: "k1".into(),
            sandbox_id: "a".into(),
            template: "base".into(),
            at: 10,
            commands: 3,
            egress_bytes: 1000,
        }],
        "a",
        50,
    )
    .expect("flush");
    assert_eq!(s.usage_alive_at("a").expect("clock"), Some(50));
    s.usage_flush(&[], "a", 40).expect("an older clock never goes back");
    assert_eq!(s.usage_alive_at("a").expect("clock"), Some(50));
    // Each node's own: another node's later flush is not this one's.
    s.usage_flush(&[], "b", 90).expect("flush");
    assert_eq!((s.usage_alive_at("a").expect("a"), s.usage_alive_at("b").expect("b")), (Some(50), Some(90)));
    assert_eq!(s.usage_alive_at("c").expect("never flushed"), None);
    // The one clock kept before clocks were per node, for a node with none.
    s.raw_execute("INSERT INTO usage_clock (id, alive_at) VALUES (1, 70)").expect("an earlier version's clock");
    assert_eq!(s.usage_alive_at("c").expect("c"), Some(70));
    assert_eq!(s.usage_alive_at("a").expect("a"), Some(50));
    let rows = report(s, None, 0, 3_600_000, 3_600_000, UsageGroup::Key);
    assert_eq!(rows[0].snapshot_gib_hours, 2.0);
    assert_eq!(rows[0].volume_gib_hours, 1.0 + 2.0);
    assert_eq!((rows[0].commands, rows[0].egress_bytes), (3, 1000));
    // By sandbox, the volume is no sandbox's.
    let by_sb = report(s, None, 0, 3_600_000, 3_600_000, UsageGroup::Sandbox);
    assert_eq!(by_sb.iter().map(|r| r.group.as_deref()).collect::<Vec<_>>(), [None, Some("a")]);

    // A sandbox that died with the daemon: running until the last flush,
    // then only its layer.
    let r = sandbox("b", 0);
    s.insert_sandbox_free(&r).expect("insert");
    s.usage_mark(&r, 0).expect("mark");
    s.usage_lost("b", 4_000).expect("lost");
    s.usage_lost("b", 9_000).expect("again: nothing");
    let rows = report(s, Some("k1"), 0, 10_000, 10_000, UsageGroup::Sandbox);
    let b = rows.iter().find(|r| r.group.as_deref() == Some("b")).expect("b");
    assert_eq!(b.vcpu_seconds, 4.0);
    assert!((b.disk_gib_hours - 10.0 / 3600.0).abs() < 1e-12);
}

fn secret(owner: &str, name: &str) -> SecretRecord {
    SecretRecord {
        id: format!("sec-{owner}-{name}"),
        owner: owner.into(),
        name: name.into(),
        hosts: "[\"api.example.com\"]".into(),
        header: Some("Authorization".into()),
        format: Some("Bearer {value}".into()),
        metadata: "{}".into(),
        version: 1,
        sealed: vec![1, 2, 3],
        created_at: 1,
        updated_at: 1,
    }
}

fn secrets_are_owned_by_name_updated_in_place_and_deleted(s: &Backend) {
    s.insert_secret(&secret("k1", "TOKEN")).expect("insert");
    s.insert_secret(&secret("k2", "TOKEN")).expect("another owner, same name");
    assert!(matches!(s.insert_secret(&secret("k1", "TOKEN")), Err(StoreError::Conflict)));
    assert_eq!(s.secret_by_name("k1", "TOKEN").expect("get"), Some(secret("k1", "TOKEN")));
    assert_eq!(s.secret_by_name("k1", "OTHER").expect("get"), None);
    assert_eq!(s.list_secrets(Some("k2")).expect("list").len(), 1);
    assert_eq!(s.list_secrets(None).expect("list").len(), 2);
    let changed = SecretRecord {
        hosts: "[]".into(),
        header: None,
        format: None,
        metadata: "{\"a\":\"b\"}".into(),
        version: 2,
        sealed: vec![9],
        updated_at: 5,
        ..secret("k1", "TOKEN")
    };
    assert!(s.update_secret(&changed).expect("update"));
    assert_eq!(s.secret_by_name("k1", "TOKEN").expect("get"), Some(changed));
    assert!(!s.update_secret(&secret("k3", "NONE")).expect("update of none"));
    assert!(s.delete_secret("k1", "TOKEN").expect("delete"));
    assert!(!s.delete_secret("k1", "TOKEN").expect("delete again"));
    assert_eq!(s.list_secrets(None).expect("list"), vec![secret("k2", "TOKEN")]);
}

fn webhooks_keep_their_format_and_a_disabled_one_gets_no_deliveries(s: &Backend) {
    assert!(s.insert_webhook(&webhook("wh-n", "k1", &["*"]), 4).expect("insert"));
    let mut e = WebhookRecord { format: "e2b".into(), name: "mine".into(), ..webhook("wh-e", "k1", &["*"]) };
    assert!(s.insert_webhook(&e, 4).expect("insert"));
    let got = s.get_webhook("wh-e").expect("get").expect("found");
    assert_eq!((got.format.as_str(), got.name.as_str(), got.enabled), ("e2b", "mine", true));
    assert_eq!(s.get_webhook("wh-n").expect("get").expect("found").format, "native");
    assert_eq!(s.append_events(&mut [event(1, "k1", "sandbox.created", Some("sb-1"))]).expect("append"), 2);
    e.enabled = false;
    e.url = "https://example.org/other".into();
    e.events = vec!["sandbox.deleted".into()];
    assert!(s.update_webhook(&e).expect("update"));
    let got = s.get_webhook("wh-e").expect("get").expect("found");
    assert_eq!(
        (got.enabled, got.url.as_str(), got.events.as_slice()),
        (false, "https://example.org/other", &["sandbox.deleted".to_owned()][..])
    );
    assert_eq!(
        s.append_events(&mut [event(2, "k1", "sandbox.deleted", Some("sb-1"))]).expect("append"),
        1,
        "only the native one"
    );
    let due = s.claim_deliveries("a", 1000, 2000, 10).expect("due");
    assert!(due.iter().any(|(_, w)| w.format == "e2b" && !w.enabled), "a pending one is still sent");
    assert!(!s.update_webhook(&webhook("wh-none", "k1", &["*"])).expect("update"));
}

#[test]
fn webhooks_made_before_the_format_column_are_native_and_enabled() {
    {
        let c = rusqlite::Connection::open_in_memory().expect("open");
        c.execute_batch(include_str!("../migrations/0012_webhooks.sql")).expect("0012");
        c.execute("INSERT INTO webhooks (id, owner, url, events, secret, created_at) VALUES ('wh-old', 'k1', 'https://x/', '[\"*\"]', 's', 1)", []).expect("row");
        c.execute_batch(include_str!("../migrations/0017_webhook_format.sql")).expect("0017");
        let (f, en): (String, bool) = c
            .query_row("SELECT format, enabled FROM webhooks WHERE id = 'wh-old'", [], |r| Ok((r.get(0)?, r.get(1)?)))
            .expect("q");
        assert_eq!((f.as_str(), en), ("native", true));
    }
}

fn a_sandbox_keeps_its_class(s: &Backend) {
    s.insert_sandbox_free(&SandboxRecord { class: Class::Gvisor, ..sandbox("g", 1) }).expect("insert");
    s.insert_sandbox_free(&sandbox("c", 2)).expect("insert");
    assert_eq!(s.get_sandbox("g").expect("get").expect("some").class, Class::Gvisor);
    assert_eq!(s.get_sandbox("c").expect("get").expect("some").class, Class::Container);
}

fn node(name: &str, at: i64) -> NodeRecord {
    NodeRecord {
        name: name.into(),
        advertise: format!("http://{name}:8080"),
        memory_mib: 4096,
        disk_mib: 10240,
        sandboxes: 100,
        classes: vec!["container".into(), "gvisor".into()],
        state: NodeState::Active,
        started_at: at,
        heartbeat_at: at,
    }
}

fn nodes_register_heartbeat_and_are_lost_once(s: &Backend) {
    assert!(s.list_nodes().expect("list").is_empty());
    s.register_node(&node("b", 10)).expect("register");
    s.register_node(&node("a", 10)).expect("register");
    assert_eq!(s.heartbeat_node("a", 20).expect("beat"), Some(NodeState::Active));
    assert_eq!(s.heartbeat_node("nobody", 20).expect("beat"), None);
    let nodes = s.list_nodes().expect("list");
    assert_eq!(nodes.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), ["a", "b"]);
    assert_eq!(nodes[0], NodeRecord { heartbeat_at: 20, ..node("a", 10) });
    // Only a node silent since before `silent_before` is declared lost.
    assert_eq!(s.mark_node_lost(&loss("a", 20)).expect("beat since"), None);
    assert_eq!(s.mark_node_lost(&loss("b", 11)).expect("lost"), Some(vec![]));
    assert_eq!(s.mark_node_lost(&loss("b", 11)).expect("lost twice"), None);
    assert_eq!(s.mark_node_lost(&loss("nobody", 11)).expect("unknown"), None);
    assert_eq!(s.list_nodes().expect("list")[1].state, NodeState::Lost);
    // A lost node's beat is not recorded: it is told it is lost.
    assert_eq!(s.heartbeat_node("b", 40).expect("beat"), Some(NodeState::Lost));
    assert_eq!(s.list_nodes().expect("list")[1].heartbeat_at, 10);
    // A node that starts again is active again, with its new capacity.
    s.register_node(&NodeRecord { sandboxes: 7, classes: vec![], ..node("b", 30) }).expect("again");
    let b = s.list_nodes().expect("list").pop().expect("b");
    assert_eq!(b, NodeRecord { sandboxes: 7, classes: vec![], ..node("b", 30) });
}

fn loss(name: &str, silent_before: i64) -> NodeLoss<'_> {
    NodeLoss {
        name,
        silent_before,
        from: &[SandboxState::Starting, SandboxState::Running, SandboxState::Suspended, SandboxState::Terminating],
        code: "node_lost",
        reason: "node stopped heartbeating",
        paused_reason: "node lost; kept paused",
    }
}

fn a_lost_node_loses_its_live_sandboxes_and_notes_its_paused_ones(s: &Backend) {
    s.insert_template(&template("tpl-1", 1)).expect("insert");
    s.register_node(&node("a", 10)).expect("register");
    s.register_node(&node("c", 10)).expect("register");
    let on_c = |r: SandboxRecord| SandboxRecord { node: "c".into(), ..r };
    s.insert_sandbox_free(&on_c(sandbox("c-run", 1))).expect("insert");
    s.insert_sandbox_free(&on_c(SandboxRecord { state: SandboxState::Suspended, ..sandbox("c-susp", 2) }))
        .expect("insert");
    s.insert_sandbox_free(&on_c(SandboxRecord { state: SandboxState::Paused, ..sandbox("c-paused", 3) }))
        .expect("insert");
    s.insert_sandbox_free(&on_c(SandboxRecord { state: SandboxState::Terminated, ..sandbox("c-gone", 4) }))
        .expect("insert");
    s.insert_sandbox_free(&on_c(pooled("c-warm", 5, 1))).expect("insert");
    s.insert_sandbox_free(&SandboxRecord { node: "a".into(), ..sandbox("a-run", 6) }).expect("insert");
    let quota = Admission { owner: Quotas { sandboxes: Some(5), ..Quotas::default() }, ..Admission::default() };
    let extra = SandboxRecord { node: "a".into(), ..sandbox("a-extra", 7) };
    // c-run, c-susp, c-paused, a-run (k1's) and the pooled one hold: k1 is at 5.
    assert!(matches!(s.insert_sandbox(&extra, &quota).expect("insert"), Admitted::Refused(_)));
    for id in ["c-run", "c-susp", "c-warm"] {
        s.usage_mark(&s.get_sandbox(id).expect("get").expect("row"), 5).expect("usage");
    }

    let mut lost = s.mark_node_lost(&loss("c", 11)).expect("lost").expect("declared");
    lost.sort_by(|a, b| a.id.cmp(&b.id));
    assert_eq!(lost.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(), ["c-run", "c-susp", "c-warm"]);
    for r in &lost {
        assert_eq!(r.state, SandboxState::Lost);
        assert_eq!(r.last_error_code.as_deref(), Some("node_lost"));
        assert_eq!(r.reason.as_deref(), Some("node stopped heartbeating"));
        s.usage_mark(r, 10).expect("usage ends");
    }
    // A disk-paused sandbox keeps its state (its files may move) with a note.
    let paused = s.get_sandbox("c-paused").expect("get").expect("row");
    assert_eq!((paused.state, paused.reason.as_deref()), (SandboxState::Paused, Some("node lost; kept paused")));
    assert_eq!(s.get_sandbox("c-gone").expect("get").expect("row").state, SandboxState::Terminated);
    assert_eq!(s.get_sandbox("a-run").expect("get").expect("row").state, SandboxState::Running);
    // Lost sandboxes hold nothing: the owner's quota has room again, the
    // node counts only its paused one, its pool is empty, nothing is open.
    assert_eq!(s.insert_sandbox(&extra, &quota).expect("insert"), Admitted::Inserted);
    assert_eq!(s.count_by_node().expect("count"), [("a".to_owned(), 2), ("c".to_owned(), 1)]);
    assert!(s.pooled_sandboxes(Some("c")).expect("pooled").is_empty());
    assert!(s.claim_warm(&Claim { node: "c", ..claim(20) }).expect("claim").is_none());
    let open = s.usage_open_subjects().expect("open");
    assert!(open.iter().all(|(_, id)| !lost.iter().any(|r| &r.id == id)), "{open:?}");
    // A lost sandbox leaves no state but by a transition naming `lost`.
    assert!(s
        .transition("c-run", &[SandboxState::Running], SandboxState::Terminating, &Changes::default())
        .expect("transition")
        .is_none());
    // The node that comes back finds what it must end: its lost rows.
    let ended = s.sandboxes_on(Some("c"), &[SandboxState::Lost]).expect("lost rows");
    assert_eq!(ended.len(), 3);
    s.register_node(&node("c", 30)).expect("back");
    assert_eq!(s.heartbeat_node("c", 31).expect("beat"), Some(NodeState::Active));
    assert_eq!(s.get_sandbox("c-run").expect("get").expect("row").state, SandboxState::Lost);
}

fn a_drained_node_stays_draining_across_a_restart(s: &Backend) {
    s.register_node(&node("a", 10)).expect("register");
    let (active, draining) = ([NodeState::Active], [NodeState::Draining]);
    assert!(s.set_node_state("a", &active, NodeState::Draining).expect("drain"));
    assert!(!s.set_node_state("a", &active, NodeState::Draining).expect("drain twice"));
    assert!(!s.set_node_state("nobody", &active, NodeState::Draining).expect("unknown"));
    assert_eq!(s.heartbeat_node("a", 20).expect("beat"), Some(NodeState::Draining));
    s.register_node(&node("a", 30)).expect("restart");
    assert_eq!(s.list_nodes().expect("list")[0].state, NodeState::Draining);
    assert!(s.set_node_state("a", &draining, NodeState::Active).expect("undrain"));
    assert_eq!(s.list_nodes().expect("list")[0].state, NodeState::Active);
    // A lost node is not drained or undrained: it comes back by registering.
    assert!(s.mark_node_lost(&loss("a", 31)).expect("lost").is_some());
    assert!(!s.set_node_state("a", &active, NodeState::Draining).expect("drain lost"));
    assert!(!s.set_node_state("a", &draining, NodeState::Active).expect("undrain lost"));
}

/// A node that drains (or is lost) takes no sandbox: its insert reads the
/// node's state in its own transaction, and a claim of its pool takes
/// nothing. A node the store does not know (one daemon, no fleet) is open.
fn a_closed_node_takes_no_sandbox_in_the_inserts_transaction(s: &Backend) {
    let on = |node: &str, id: &str| SandboxRecord { node: node.into(), ..sandbox(id, 1) };
    assert_eq!(s.insert_sandbox(&on("solo", "s1"), &Admission::default()).expect("insert"), Admitted::Inserted);
    s.register_node(&node("a", 10)).expect("register");
    s.insert_template(&template("tpl-1", 1)).expect("insert");
    s.insert_sandbox_free(&SandboxRecord { node: "a".into(), ..pooled("ap", 2, 1) }).expect("insert");
    assert!(s.set_node_state("a", &[NodeState::Active], NodeState::Draining).expect("drain"));
    assert_eq!(
        s.insert_sandbox(&on("a", "a1"), &Admission::default()).expect("insert"),
        Admitted::NodeClosed(NodeState::Draining)
    );
    assert!(s.get_sandbox("a1").expect("get").is_none(), "nothing of a refused insert is kept");
    assert_eq!(s.claim_warm(&Claim { node: "a", ..claim(20) }).expect("claim"), None);
    assert!(s.set_node_state("a", &[NodeState::Draining], NodeState::Active).expect("undrain"));
    assert_eq!(s.claim_warm(&Claim { node: "a", ..claim(21) }).expect("claim").map(|r| r.id), Some("ap".into()));
    assert_eq!(s.insert_sandbox(&on("a", "a2"), &Admission::default()).expect("insert"), Admitted::Inserted);
    assert!(s.mark_node_lost(&loss("a", 31)).expect("lost").is_some());
    assert_eq!(
        s.insert_sandbox(&on("a", "a3"), &Admission::default()).expect("insert"),
        Admitted::NodeClosed(NodeState::Lost)
    );
}

fn a_node_sees_only_its_own_sandboxes_where_it_acts(s: &Backend) {
    s.insert_template(&template("tpl-1", 1)).expect("insert");
    s.insert_sandbox_free(&SandboxRecord { node: "a".into(), ..sandbox("a1", 1) }).expect("insert");
    s.insert_sandbox_free(&SandboxRecord { node: "b".into(), ..sandbox("b1", 2) }).expect("insert");
    s.insert_sandbox_free(&SandboxRecord { node: "b".into(), ..pooled("bp", 3, 1) }).expect("insert");
    assert_eq!(s.get_sandbox("a1").expect("get").expect("a1").node, "a");
    let running = [SandboxState::Running];
    let ids = |rows: Vec<SandboxRecord>| rows.into_iter().map(|r| r.id).collect::<Vec<_>>();
    assert_eq!(ids(s.sandboxes_in(&running).expect("all")), ["a1", "b1", "bp"]);
    assert_eq!(ids(s.sandboxes_on(Some("a"), &running).expect("a")), ["a1"]);
    assert_eq!(ids(s.sandboxes_on(Some("b"), &running).expect("b")), ["b1", "bp"]);
    // The brief of each is the record's fields, for the same rows in the
    // same order.
    let brief = |r: SandboxRecord| SandboxBrief {
        id: r.id,
        owner: r.owner,
        state: r.state,
        created_at: r.created_at,
        expires_at: r.expires_at,
        memory_mb: r.memory_mb,
        vcpus: r.vcpus,
        disk_mib: r.disk_mib,
        pooled: r.pooled,
        on_expire: r.on_expire,
    };
    for node in [None, Some("a"), Some("b"), Some("c")] {
        let whole: Vec<SandboxBrief> =
            s.sandboxes_on(node, &running).expect("records").into_iter().map(brief).collect();
        assert_eq!(s.briefs_on(node, &running).expect("briefs"), whole, "{node:?}");
    }
    assert!(s.briefs_on(Some("b"), &[SandboxState::Running]).expect("briefs").iter().any(|b| b.pooled));
    assert_eq!(ids(s.pooled_sandboxes(Some("a")).expect("a")), Vec::<String>::new());
    assert_eq!(ids(s.pooled_sandboxes(Some("b")).expect("b")), ["bp"]);
    // Reads still show every node's.
    assert_eq!(s.list_sandboxes(None, None, 10, true).expect("list").len(), 2);
    // A warm sandbox is claimed only by its own node.
    assert_eq!(s.claim_warm(&Claim { node: "a", ..claim(10) }).expect("claim"), None);
    assert_eq!(s.claim_warm(&Claim { node: "b", ..claim(10) }).expect("claim").expect("bp").id, "bp");
    s.set_sandbox_idle("a1", 60, "pause").expect("idle");
    s.set_sandbox_idle("b1", 60, "pause").expect("idle");
    assert_eq!(s.sandbox_idle_all(Some("a")).expect("idle").len(), 1);
    assert_eq!(s.sandbox_idle_all(None).expect("idle").len(), 2);
    assert_eq!(s.count_by_node().expect("count"), [("a".to_owned(), 1), ("b".to_owned(), 2)]);
    // A host's caps count its own node's sandboxes only (an owner's, all).
    let host = Admission { host: Quotas { sandboxes: Some(1), ..Quotas::default() }, ..Admission::default() };
    let c1 = SandboxRecord { node: "c".into(), ..sandbox("c1", 4) };
    assert_eq!(s.insert_sandbox(&c1, &host).expect("insert"), Admitted::Inserted);
    let c2 = SandboxRecord { node: "c".into(), ..sandbox("c2", 5) };
    assert!(matches!(s.insert_sandbox(&c2, &host).expect("insert"), Admitted::Refused(_)));
    s.transition("c1", &[SandboxState::Running], SandboxState::Terminated, &Changes::default()).expect("end");
    let free = Admission::default();
    assert_eq!(s.insert_volume(&volume("v1", "k1", "data", 64), &free).expect("volume"), VolumeAdmitted::Written);
    assert_eq!(s.give_all_to("a").expect("give"), 4);
    assert_eq!(s.count_by_node().expect("count"), [("a".to_owned(), 3)]);
    assert_eq!(s.get_volume("v1").expect("get").map(|v| v.node).as_deref(), Some("a"));
}

fn pushes_are_kept_and_a_paused_sandbox_moves_to_one_node_only(s: &Backend) {
    s.insert_sandbox_free(&SandboxRecord { node: "c".into(), state: SandboxState::Paused, ..sandbox("p1", 1) })
        .expect("insert");
    s.insert_sandbox_free(&SandboxRecord { node: "c".into(), ..sandbox("r1", 2) }).expect("insert");
    let snap = SnapshotRecord {
        id: "snap-1".into(),
        owner: "k1".into(),
        name: None,
        sandbox_id: "r1".into(),
        created_at: 1,
        size_bytes: 10,
        recipe: "{}".into(),
    };
    assert!(s.insert_snapshot(&snap, None).expect("insert"));
    assert_eq!(s.pushed(Pushed::Sandbox, "p1").expect("read"), None);
    assert_eq!(s.pushed(Pushed::Snapshot, "nobody").expect("read"), None);
    // Not pushed: it cannot move.
    assert!(!s.move_paused("p1", "c", "a").expect("move"));
    let r = "127.0.0.1:5000/fleet/sb-p1@sha256:00";
    assert!(s.set_pushed(Pushed::Sandbox, "p1", Some(r)).expect("set"));
    assert!(s.set_pushed(Pushed::Sandbox, "r1", Some(r)).expect("set"));
    assert!(s.set_pushed(Pushed::Snapshot, "snap-1", Some("x@sha256:11")).expect("set"));
    assert!(!s.set_pushed(Pushed::Snapshot, "snap-nobody", Some("x")).expect("set"));
    assert_eq!(s.pushed(Pushed::Sandbox, "p1").expect("read").as_deref(), Some(r));
    assert_eq!(s.pushed(Pushed::Snapshot, "snap-1").expect("read").as_deref(), Some("x@sha256:11"));
    // Other writes keep it.
    s.transition("r1", &[SandboxState::Running], SandboxState::Suspended, &Changes::default()).expect("suspend");
    assert_eq!(s.pushed(Pushed::Sandbox, "r1").expect("read").as_deref(), Some(r));
    // Only a paused sandbox moves, only from the node it is on, once.
    assert!(!s.move_paused("r1", "c", "a").expect("not paused"));
    assert!(!s.move_paused("p1", "b", "a").expect("not on b"));
    assert!(s.move_paused("p1", "c", "a").expect("move"));
    assert!(!s.move_paused("p1", "c", "b").expect("the second loses"));
    assert_eq!(s.get_sandbox("p1").expect("get").expect("p1").node, "a");
    // The node it left cannot start it any more; the node it is on can.
    let wake = |node| Changes { on_node: Some(node), ..Changes::default() };
    assert!(s.transition("p1", &[SandboxState::Paused], SandboxState::Starting, &wake("c")).expect("c").is_none());
    let woke = s.transition("p1", &[SandboxState::Paused], SandboxState::Starting, &wake("a")).expect("a");
    assert_eq!(woke.map(|r| (r.state, r.node)), Some((SandboxState::Starting, "a".to_owned())));
    assert!(s.set_pushed(Pushed::Sandbox, "p1", None).expect("forget"));
    assert_eq!(s.pushed(Pushed::Sandbox, "p1").expect("read"), None);
}

/// Whether two figures agree but for the order they were summed in.
fn close_to(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

fn same_totals(got: &[UsageRow], want: &[UsageRow]) {
    assert_eq!(got.iter().map(|r| &r.key).collect::<Vec<_>>(), want.iter().map(|r| &r.key).collect::<Vec<_>>());
    for (g, w) in got.iter().zip(want) {
        let figures = |r: &UsageRow| {
            [
                r.memory_mib_seconds,
                r.vcpu_seconds,
                r.paused_seconds,
                r.disk_gib_hours,
                r.snapshot_gib_hours,
                r.volume_gib_hours,
            ]
        };
        let pairs = figures(g).into_iter().zip(figures(w));
        assert!(pairs.clone().all(|(a, b)| close_to(a, b)), "{g:?}\n vs the ledger's {w:?}");
        assert_eq!((g.commands, g.egress_bytes), (w.commands, w.egress_bytes), "{}", g.key);
    }
}

/// `/metrics` reads the running totals and the open intervals, not the
/// ledger: they must say what a report over the whole ledger says, as
/// kept interval by interval and as the migration backfills them from a
/// store's history.
fn usage_totals_say_what_the_whole_ledger_says(s: &Backend) {
    let mut at = 1_000;
    for (n, owner) in ["k1", "k2", "k1", "k3"].into_iter().enumerate() {
        let mut r = sandbox(&format!("sb-{n}"), 0);
        r.owner = owner.into();
        r.disk_mib = 512 * (n as u64 + 1);
        r.vcpus = 0.5 * (n as f64 + 1.0);
        s.insert_sandbox_free(&r).expect("insert");
        for state in [SandboxState::Starting, SandboxState::Running, SandboxState::Paused, SandboxState::Running] {
            r.state = state;
            s.usage_mark(&r, at).expect("mark");
            at += 1_234 * (n as i64 + 1);
        }
        if n != 3 {
            r.state = SandboxState::Terminated;
            s.usage_mark(&r, at).expect("end");
        }
    }
    s.usage_mark(&sandbox("lost", 0), 2_000).expect("mark");
    s.usage_lost("lost", 9_000).expect("lost");
    let snap = UsageInterval {
        owner: "k2".into(),
        kind: UsageKind::Snapshot,
        subject: "snap-1".into(),
        sandbox_id: Some("sb-1".into()),
        template: Some("base".into()),
        memory_mb: 0,
        vcpus: 0.0,
        size_bytes: 3 << 30,
        start: 0,
        end: None,
    };
    s.usage_mark_object(Some(&snap), "snap-1", 5_000).expect("open");
    s.usage_mark_object(None, "snap-1", 77_000).expect("close");
    s.usage_mark_object(
        Some(&UsageInterval { subject: "vol-1".into(), kind: UsageKind::Volume, ..snap }),
        "vol-1",
        6_000,
    )
    .expect("a volume, still kept");
    let count = |owner: &str, commands, egress_bytes| UsageCount {
        owner: owner.into(),
        sandbox_id: "sb-0".into(),
        template: "base".into(),
        at: 3_000,
        commands,
        egress_bytes,
    };
    s.usage_flush(&[count("k1", 3, 100), count("k2", 0, 0), count("k1", 2, 5)], "a", 3_000).expect("flush");
    s.usage_flush(&[count("k3", 7, 1 << 40)], "a", 4_000).expect("flush");

    // After every event (the snapshot's close at 77 s included).
    let now = at.max(77_000) + 10_000;
    let ledger = |owner: Option<&str>| report(s, owner, 0, now + 1, now, UsageGroup::Key);
    assert_eq!(ledger(None).len(), 3);
    same_totals(&s.usage_totals(None, now).expect("totals"), &ledger(None));
    same_totals(&s.usage_totals(Some("k2"), now).expect("k2's"), &ledger(Some("k2")));
    assert!(s.usage_totals(Some("nobody"), now).expect("none").is_empty());
    // The migration's backfill, run again over this history.
    let migration = match s {
        Backend::Sqlite(_) => include_str!("../migrations/0029_running_totals.sql"),
        Backend::Postgres(_) => include_str!("../migrations/postgres/0012_running_totals.sql"),
    };
    s.raw_execute("DELETE FROM usage_totals").expect("forget the totals");
    assert_ne!(s.usage_totals(None, now).expect("open intervals only")[0].commands, 5);
    s.raw_execute(migration).expect("backfill");
    same_totals(&s.usage_totals(None, now).expect("backfilled"), &ledger(None));
}

/// Ended sandboxes are counted as they end, by triggers, so that the count
/// reads no ended row; every way in and out of a final state counts.
fn ended_sandboxes_are_counted_as_they_end(s: &Backend) {
    let count = |st: SandboxState| {
        s.count_by_state().expect("count").into_iter().filter(|(x, _)| *x == st).map(|(_, n)| n).sum::<u64>()
    };
    for id in ["a", "b", "c", "d"] {
        let mut r = sandbox(id, 0);
        r.state = SandboxState::Starting;
        s.insert_sandbox_free(&r).expect("insert");
    }
    let mut ended = sandbox("e", 0);
    ended.state = SandboxState::Terminated;
    s.insert_sandbox_free(&ended).expect("an ended row, inserted");
    assert_eq!((count(SandboxState::Starting), count(SandboxState::Terminated)), (4, 1));
    let go = |id: &str, from: SandboxState, to: SandboxState| {
        s.transition(id, &[from], to, &Changes::default()).expect("transition").expect("it was in `from`");
    };
    go("a", SandboxState::Starting, SandboxState::Running);
    go("a", SandboxState::Running, SandboxState::Terminating);
    go("a", SandboxState::Terminating, SandboxState::Terminated);
    go("b", SandboxState::Starting, SandboxState::Running);
    go("b", SandboxState::Running, SandboxState::Lost);
    go("c", SandboxState::Starting, SandboxState::Paused);
    assert_eq!(count(SandboxState::Terminated), 2);
    assert_eq!(count(SandboxState::Lost), 1);
    assert_eq!((count(SandboxState::Paused), count(SandboxState::Starting), count(SandboxState::Running)), (1, 1, 0));
    // From one final state to the other, and a row removed.
    go("b", SandboxState::Lost, SandboxState::Terminated);
    assert_eq!((count(SandboxState::Terminated), count(SandboxState::Lost)), (3, 0));
    s.raw_execute("DELETE FROM sandboxes WHERE id = 'e'").expect("remove an ended row");
    assert_eq!(count(SandboxState::Terminated), 2);
    // Whatever the path, the counts are those of the rows.
    let total: u64 = s.count_by_state().expect("count").iter().map(|(_, n)| n).sum();
    assert_eq!(total, 4);
}

/// Ended sandboxes go after their retention, by the time they ended (set
/// by triggers however they ended), a batch at a time; live and paused
/// ones stay, and the counts follow.
fn ended_sandboxes_are_pruned_after_their_retention(s: &Backend) {
    for (id, state) in [("live", SandboxState::Running), ("paused", SandboxState::Paused), ("b", SandboxState::Running)]
    {
        let mut r = sandbox(id, 0);
        r.state = state;
        s.insert_sandbox_free(&r).expect("insert");
    }
    let mut ended = sandbox("c", 0);
    ended.state = SandboxState::Terminated;
    s.insert_sandbox_free(&ended).expect("inserted ended");
    let go = |id: &str, to: SandboxState| {
        s.transition(id, &[SandboxState::Running], to, &Changes::default()).expect("transition").expect("running");
    };
    go("b", SandboxState::Terminated);
    let mut lost = sandbox("d", 0);
    lost.state = SandboxState::Running;
    s.insert_sandbox_free(&lost).expect("insert");
    go("d", SandboxState::Lost);
    // The journal of idempotent commands goes with its sandbox.
    for scope in ["b", "live"] {
        assert!(matches!(s.begin_exec(scope, "k", "h", 1, "a").expect("begin"), Begin::Started));
        s.finish_exec(scope, "k", "{}").expect("finish");
    }
    // Ended now: nothing ended before the epoch.
    assert_eq!(s.prune_sandboxes(0, 10).expect("prune"), 0);
    let later = i64::MAX;
    assert_eq!(s.prune_sandboxes(later, 2).expect("a batch"), 2);
    assert_eq!(s.prune_sandboxes(later, 2).expect("the rest"), 1);
    assert_eq!(s.prune_sandboxes(later, 2).expect("none left"), 0);
    for id in ["b", "c", "d"] {
        assert!(s.get_sandbox(id).expect("get").is_none(), "{id} was kept");
    }
    for id in ["live", "paused"] {
        assert!(s.get_sandbox(id).expect("get").is_some(), "{id} was pruned");
    }
    assert!(matches!(s.begin_exec("b", "k", "h", 2, "a").expect("begin"), Begin::Started), "b's journal went");
    assert!(matches!(s.begin_exec("live", "k", "h", 2, "a").expect("begin"), Begin::Existing(_)), "live's stays");
    let counts = s.count_by_state().expect("count");
    let n = |st: SandboxState| counts.iter().filter(|(x, _)| *x == st).map(|(_, n)| *n).sum::<u64>();
    assert_eq!((n(SandboxState::Terminated), n(SandboxState::Lost), n(SandboxState::Running)), (0, 0, 1));
}

/// Each test of both backends: `sqlite::name` always, `postgres::name`
/// when `HUTCH_TEST_POSTGRES` is set (scripts/test.sh sets it).
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(#[test] fn $name() { super::$name(&super::Backend::sqlite()) })*
        }
        mod postgres {
            $(#[test] fn $name() { if let Some(b) = super::Backend::postgres() { super::$name(&b) } })*
        }
    };
}

on_both_backends!(
    learned_addresses_survive_other_updates,
    listing_pages_newest_first,
    idempotency_keys_are_unique_per_owner,
    exec_journal_begins_once_finishes_and_loses_running_on_restart,
    warm_claims_take_the_oldest_of_the_current_version_only,
    a_template_update_writes_every_column_an_insert_does,
    template_names_are_unique_among_live_templates,
    builds_are_listed_newest_first_and_unfinished_ones_fail_on_restart,
    keys_are_found_by_hash_and_revoked,
    the_first_key_is_made_only_on_a_store_without_keys,
    transitions_are_conditional_on_the_state_they_leave,
    admission_counts_what_live_sandboxes_hold,
    builds_at_once_are_capped_per_owner,
    quotas_are_kept_with_the_key,
    storage_is_kept_and_a_claim_takes_only_a_warm_sandbox_of_the_asked_storage,
    snapshots_are_owned_named_once_per_owner_and_counted,
    volume_claims_are_one_writer_or_many_readers_and_end_with_their_sandbox,
    volumes_count_toward_disk_and_grow_under_the_caps,
    audit_rows_append_list_newest_first_and_prune,
    events_list_oldest_first_filtered_and_pruned,
    deliveries_are_made_with_their_events_for_matching_webhooks,
    usage_follows_transitions_and_open_intervals_end_now,
    a_state_change_marks_its_usage_in_its_own_transaction,
    usage_by_day_splits_at_utc_midnight,
    usage_counts_objects_and_a_lost_sandbox,
    usage_totals_say_what_the_whole_ledger_says,
    ended_sandboxes_are_counted_as_they_end,
    ended_sandboxes_are_pruned_after_their_retention,
    secrets_are_owned_by_name_updated_in_place_and_deleted,
    webhooks_keep_their_format_and_a_disabled_one_gets_no_deliveries,
    a_sandbox_keeps_its_class,
    nodes_register_heartbeat_and_are_lost_once,
    a_node_sees_only_its_own_sandboxes_where_it_acts,
    a_lost_node_loses_its_live_sandboxes_and_notes_its_paused_ones,
    a_drained_node_stays_draining_across_a_restart,
    a_closed_node_takes_no_sandbox_in_the_inserts_transaction,
    pushes_are_kept_and_a_paused_sandbox_moves_to_one_node_only,
);

#[test]
fn holding_names_every_state_but_the_final_ones() {
    // `state IN HOLDING` stands for "not ended" in the queries that walk
    // live sandboxes; a new state must be named there.
    let named: Vec<&str> = crate::sqlite::HOLDING
        .trim_matches(|c| c == '(' || c == ')')
        .split(", ")
        .map(|s| s.trim_matches('\''))
        .collect();
    let live: Vec<&str> = SandboxState::ALL
        .into_iter()
        .filter(|s| !matches!(s, SandboxState::Terminated | SandboxState::Lost))
        .map(SandboxState::as_str)
        .collect();
    assert_eq!(named, live);
}

#[test]
fn queries_of_live_sandboxes_do_not_walk_the_history() {
    // Ended sandboxes pile up (thousands a minute on an evaluation host);
    // the claim on a create's path and the periodic passes must go
    // through an index that skips them, not scan the table or an owner's
    // whole past.
    // `sandboxes_pooled` holds live warm sandboxes only: a scan of it is
    // a scan of what is alive.
    let s = SqliteStore::open_in_memory().expect("open");
    let queries = [
        crate::sqlite::claim_pick_sql(),
        crate::sqlite::pooled_sql(),
        crate::sqlite::idle_all_sql(),
        crate::sqlite::count_by_node_sql(),
        crate::sqlite::count_by_state_sql(),
        crate::sqlite::prune_pick_sql(),
    ];
    for sql in queries {
        let plan = s.query_plan(&sql).expect("plan");
        assert!(!plan.is_empty(), "{sql}");
        for step in &plan {
            // `sandboxes_ended` has a row per final state.
            let walks = (step.starts_with("SCAN s")
                && !step.contains("INDEX sandboxes_pooled")
                && !step.starts_with("SCAN sandboxes_ended"))
                || step.contains("sandboxes_by_owner");
            assert!(!walks, "{sql}\n walks the history: {plan:?}");
        }
    }
    // A scrape's open intervals: an index search for the open ones (a
    // NULL end, or the partial index of open intervals), however long the
    // ledger.
    let sql = crate::sqlite::open_intervals_sql();
    let plan = s.query_plan(&sql).expect("plan");
    let searched = |p: &String| p.contains("INDEX usage_open") || p.contains("INDEX usage_end (end_ms=?)");
    assert!(!plan.is_empty() && plan.iter().all(searched), "{sql}\n walks the ledger: {plan:?}");
}

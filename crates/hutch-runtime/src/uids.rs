//! Allocation of host uid/gid ranges: each sandbox maps its ids 0..65535 to
//! a range of its own, so no two sandboxes (and no host user) share an id.
//!
//! A range is a slot number; slot `n` is held by an exclusive `flock` on the
//! file `<dir>/<n>`. The lock lives on an open file description, and the
//! sandbox's PID 1 inherits a descriptor of it, so the slot stays taken
//! exactly as long as the sandbox lives, whatever happens to the process
//! that made it, and the kernel frees it when the sandbox dies. Once PID 1
//! has started, the runtime closes its own descriptor ([`Slot::hand_over`]):
//! a daemon with 10,000 sandboxes would otherwise hold 10,000 descriptors
//! for nothing, against an open-file limit that may be 20,000. Files of
//! dead sandboxes are unlinked by whoever next finds them unlocked; the
//! runtime that made a sandbox takes its lock back to do so, and leaves
//! a slot that someone else took in the meantime alone.
//!
//! Host ids are a host-wide resource, so the directory is one per host
//! ([`HOST_DIR`]), whatever run directory a runtime uses: two daemons, or
//! `hutch run` beside a daemon, never hand out the same range. A slot's file
//! records the sandbox id and the run directory of the runtime that took
//! it, so each runtime sweeps only what its own sandboxes left. A runtime
//! also marks each slot it takes in its run directory
//! (`<run>/slots/<n>`), so that its routine sweep ([`stale_marked`]) reads
//! its own slots, not every slot of the host: with thousands of sandboxes
//! alive, opening and locking each file cost every `hutch run` more than
//! the rest of its sweep.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Ids each sandbox gets: the whole 16-bit range, so that images with
/// `nobody` (65534) work.
pub const RANGE: u32 = 65536;
/// First host id handed to sandboxes: far above ordinary users and the
/// ranges of /etc/subuid.
pub const FIRST_ID: u32 = 1 << 31;
/// Where every runtime on the host keeps its slots.
pub const HOST_DIR: &str = "/run/hutch/uids";
/// Slots that fit between FIRST_ID and the top of the 32-bit id space
/// (leaving the last range, which holds the invalid id 2^32-1).
pub const SLOTS: u32 = ((u32::MAX - FIRST_ID) / RANGE) - 1;

#[derive(Debug, thiserror::Error)]
pub enum UidError {
    #[error("uid range directory {dir}: {source}")]
    Io { dir: PathBuf, source: io::Error },
    #[error("all {SLOTS} uid ranges are in use")]
    Exhausted,
}

/// One held uid range.
#[derive(Debug)]
pub struct Slot {
    pub index: u32,
    /// The locked file; None once handed over to the sandbox's PID 1.
    file: Option<File>,
    path: PathBuf,
    /// The sandbox it was taken for (the first line of its file's record).
    owner: String,
    /// Its mark in the run directory of the runtime that took it.
    marker: Option<PathBuf>,
}

impl Slot {
    /// First host id of the range (the sandbox's root).
    pub fn base(&self) -> u32 {
        FIRST_ID + self.index * RANGE
    }

    /// The locked file, to pass to the sandbox's PID 1 (None once handed
    /// over).
    pub fn file(&self) -> Option<&File> {
        self.file.as_ref()
    }

    /// Closes this descriptor of the locked file: call once the sandbox's
    /// PID 1 holds one, which keeps the slot taken from then on.
    pub fn hand_over(&mut self) {
        self.file = None;
    }

    /// Gives the slot back: unlinks the file, then drops the lock. Only call
    /// this when no process of the sandbox can still hold the lock. A slot
    /// handed over is locked again first, and left alone if anyone holds
    /// it or its file records another sandbox (it was freed and taken
    /// again in between).
    pub fn release(self) {
        let _retaken = match &self.file {
            Some(_) => None,
            None => match lock_unheld(&self.path) {
                Ok(Some((file, owner, _))) if owner == self.owner => Some(file),
                _ => return,
            },
        };
        if let Some(m) = &self.marker {
            let _ = fs::remove_file(m);
        }
        let _ = fs::remove_file(&self.path);
    }
}

/// Where a runtime whose run directory is `home` marks slot `index`.
fn marker(home: &Path, index: u32) -> PathBuf {
    home.join("slots").join(index.to_string())
}

/// Marks a slot just taken in `home`'s directory; without its mark, the
/// slot is given back.
fn mark(mut slot: Slot, home: &Path) -> io::Result<Slot> {
    let path = marker(home, slot.index);
    // Not recursive: the run directory is its runtime's to make.
    let made = match fs::DirBuilder::new().mode(0o700).create(home.join("slots")) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => Err(e),
        _ => OpenOptions::new().write(true).create(true).truncate(false).mode(0o600).open(&path),
    };
    match made {
        Ok(_) => {
            slot.marker = Some(path);
            Ok(slot)
        }
        Err(e) => {
            slot.release();
            Err(e)
        }
    }
}

/// Takes a free slot, recording `owner` (a sandbox id) and `home` (the run
/// directory of the runtime taking it) in its file.
pub fn allocate(dir: &Path, owner: &str, home: &Path) -> Result<Slot, UidError> {
    let err = |source| UidError::Io { dir: dir.to_path_buf(), source };
    fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(err)?;
    let mut seed = [0u8; 4];
    crate::sys::random_bytes(&mut seed).map_err(err)?;
    let start = u32::from_ne_bytes(seed) % SLOTS;
    for i in 0..SLOTS {
        let index = (start + i) % SLOTS;
        if let Some(slot) = try_slot(dir, index, owner, home).map_err(err)? {
            return mark(slot, home).map_err(err);
        }
    }
    Err(UidError::Exhausted)
}

/// Takes slot `index` if it is free (`None` if someone holds it).
pub fn take(dir: &Path, index: u32, owner: &str, home: &Path) -> Result<Option<Slot>, UidError> {
    let err = |source| UidError::Io { dir: dir.to_path_buf(), source };
    fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(err)?;
    try_slot(dir, index, owner, home).map_err(err)?.map(|slot| mark(slot, home)).transpose().map_err(err)
}

/// What a slot's file holds: the sandbox id, then the run directory.
fn record(owner: &str, home: &Path) -> String {
    format!("{owner}\n{}\n", home.display())
}

/// The (sandbox id, run directory) of a slot's file; files written before
/// run directories were recorded hold the id alone.
pub fn parse_record(text: &str) -> (String, Option<PathBuf>) {
    let mut lines = text.lines();
    let owner = lines.next().unwrap_or_default().to_owned();
    let home = lines.next().filter(|l| !l.is_empty()).map(PathBuf::from);
    (owner, home)
}

fn try_slot(dir: &Path, index: u32, owner: &str, home: &Path) -> io::Result<Option<Slot>> {
    let path = dir.join(index.to_string());
    let mut file = OpenOptions::new().read(true).write(true).create(true).truncate(false).mode(0o600).open(&path)?;
    if !crate::sys::try_lock(file.as_raw_fd())? {
        return Ok(None);
    }
    // Someone may have unlinked the file between our open and our lock
    // (releasing it); a lock on an unlinked file guards nothing.
    match fs::metadata(&path) {
        Ok(m) if m.ino() == file.metadata()?.ino() => {}
        _ => return Ok(None),
    }
    file.set_len(0)?;
    file.write_all(record(owner, home).as_bytes())?;
    Ok(Some(Slot { index, file: Some(file), path, owner: owner.to_owned(), marker: None }))
}

/// A slot whose file exists but whose lock nobody holds: its sandbox died
/// without cleaning up.
#[derive(Debug)]
pub struct Stale {
    /// The run directory of the runtime that took it, when recorded.
    pub home: Option<PathBuf>,
    slot: Slot,
}

impl Stale {
    /// The sandbox that took it.
    pub fn owner(&self) -> &str {
        &self.slot.owner
    }

    pub fn release(self) {
        self.slot.release();
    }
}

/// Locks an opened slot file if nobody holds it and it is still the file
/// at `path` (whoever released it may have unlinked it between our open
/// and our lock, and a new holder made another).
fn lock_in_place(file: &File, path: &Path) -> bool {
    if !matches!(crate::sys::try_lock(file.as_raw_fd()), Ok(true)) {
        return false;
    }
    match (fs::metadata(path), file.metadata()) {
        (Ok(a), Ok(b)) => a.ino() == b.ino(),
        _ => false,
    }
}

/// The slot file at `path`, locked, with its record (owner, run
/// directory), if nobody holds it (None if someone does; an error if it
/// cannot be opened).
fn lock_unheld(path: &Path) -> io::Result<Option<(File, String, Option<PathBuf>)>> {
    let mut file = OpenOptions::new().read(true).write(true).open(path)?;
    if !lock_in_place(&file, path) {
        return Ok(None);
    }
    let mut text = String::new();
    let _ = file.rewind();
    let _ = Read::by_ref(&mut file).take(4096).read_to_string(&mut text);
    let (owner, home) = parse_record(&text);
    Ok(Some((file, owner, home)))
}

/// Finds the slots of dead sandboxes. Each is returned locked, so that
/// nobody else takes it while the caller cleans up after its owner.
pub fn stale(dir: &Path) -> Vec<Stale> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let Some(index) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let path = e.path();
        let Ok(Some((file, owner, home))) = lock_unheld(&path) else {
            continue;
        };
        let marker = home.as_deref().map(|h| marker(h, index));
        let slot = Slot { index, file: Some(file), path, owner, marker };
        out.push(Stale { home, slot });
    }
    out
}

/// [`stale`], of the slots that the runtime of run directory `home`
/// marked only. A mark whose slot is gone or is another runtime's now is
/// removed. Slots taken before marks existed, and those of run
/// directories that are gone, are found by [`stale`] alone.
pub fn stale_marked(dir: &Path, home: &Path) -> Vec<Stale> {
    let Ok(entries) = fs::read_dir(home.join("slots")) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let Some(index) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let path = dir.join(index.to_string());
        let (file, owner, recorded) = match lock_unheld(&path) {
            Ok(Some(found)) => found,
            Ok(None) => continue,
            Err(_) => {
                let _ = fs::remove_file(e.path());
                continue;
            }
        };
        if recorded.as_deref() != Some(home) {
            let _ = fs::remove_file(e.path());
            continue;
        }
        let slot = Slot { index, file: Some(file), path, owner, marker: Some(e.path()) };
        out.push(Stale { home: recorded, slot });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("hutch-uids-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    /// A run directory that exists (a runtime makes its own).
    fn home(name: &str) -> PathBuf {
        let d = dir(&format!("home-{name}"));
        fs::create_dir(&d).expect("mkdir");
        d
    }

    /// Whether a run directory holds no mark, then removes it.
    fn no_marks_left(home: &Path) {
        let marks = fs::read_dir(home.join("slots")).map(|d| d.count()).unwrap_or(0);
        assert_eq!(marks, 0, "{} holds marks", home.display());
        fs::remove_dir_all(home).expect("cleanup");
    }

    #[test]
    fn held_slots_are_distinct_and_released_slots_leave_no_file() {
        let (d, x) = (dir("distinct"), home("x"));
        let a = allocate(&d, "a", &x).expect("alloc");
        let b = allocate(&d, "b", &x).expect("alloc");
        assert_ne!(a.index, b.index);
        assert_ne!(a.base(), b.base());
        assert!(a.base() >= FIRST_ID);
        assert!(stale(&d).is_empty(), "held slots are not stale");
        a.release();
        b.release();
        assert_eq!(fs::read_dir(&d).expect("readdir").count(), 0);
        fs::remove_dir(&d).expect("cleanup");
        no_marks_left(&x);
    }

    #[test]
    fn a_slot_handed_over_stays_taken_while_its_holder_lives_and_is_released_only_if_still_its_own() {
        let (d, x, y) = (dir("handover"), home("hx"), home("hy"));
        let mut a = allocate(&d, "sandbox-a", &x).expect("alloc");
        // The sandbox's PID 1: a descriptor of the same open file.
        let pid1 = a.file().expect("file").try_clone().expect("dup");
        a.hand_over();
        assert!(a.file().is_none());
        assert!(stale(&d).is_empty(), "a slot whose PID 1 holds the lock is not stale");
        assert!(take(&d, a.index, "intruder", &y).expect("take").is_none(), "a held slot cannot be taken");
        // The sandbox died: the slot is given back.
        drop(pid1);
        let index = a.index;
        a.release();
        assert!(!d.join(index.to_string()).exists(), "released");

        // Freed and taken again before the release: the new holder keeps it.
        let mut b = allocate(&d, "sandbox-b", &x).expect("alloc");
        let pid1 = b.file().expect("file").try_clone().expect("dup");
        b.hand_over();
        drop(pid1);
        let c = take(&d, b.index, "sandbox-c", &y).expect("take").expect("free once its holder died");
        b.release();
        assert!(d.join(c.index.to_string()).exists(), "another sandbox's slot is left alone");
        assert!(take(&d, c.index, "intruder", &y).expect("take").is_none(), "and still held");
        c.release();
        assert_eq!(fs::read_dir(&d).expect("readdir").count(), 0);
        fs::remove_dir(&d).expect("cleanup");
        // b's mark stays until a sweep finds its slot gone (stale_marked).
        assert!(stale_marked(&d, &x).is_empty());
        no_marks_left(&x);
        no_marks_left(&y);
    }

    #[test]
    fn a_dropped_slot_without_release_is_found_stale_with_its_owner() {
        let (d, run_a) = (dir("stale"), home("a"));
        let a = allocate(&d, "sandbox-1", &run_a).expect("alloc");
        let index = a.index;
        drop(a);
        let check = |found: Vec<Stale>| {
            assert_eq!(found.len(), 1);
            assert_eq!(found[0].owner(), "sandbox-1");
            assert_eq!(found[0].home.as_deref(), Some(run_a.as_path()));
            assert_eq!(found[0].slot.index, index);
        };
        // One after the other: each holds the locks of what it found.
        check(stale(&d));
        check(stale_marked(&d, &run_a));
        for s in stale(&d) {
            s.release();
        }
        assert_eq!(fs::read_dir(&d).expect("readdir").count(), 0);
        fs::remove_dir(&d).expect("cleanup");
        no_marks_left(&run_a);
    }

    #[test]
    fn a_held_slot_cannot_be_taken_again() {
        let (d, one, two) = (dir("take"), home("one"), home("two"));
        let a = allocate(&d, "a", &one).expect("alloc");
        assert!(take(&d, a.index, "b", &two).expect("take").is_none());
        let index = a.index;
        a.release();
        let b = take(&d, index, "b", &two).expect("take").expect("free again");
        b.release();
        fs::remove_dir(&d).expect("cleanup");
        no_marks_left(&one);
        no_marks_left(&two);
    }

    #[test]
    fn records_name_the_sandbox_and_its_run_directory() {
        assert_eq!(parse_record("sb-1\n/run/hutch\n"), ("sb-1".into(), Some(PathBuf::from("/run/hutch"))));
        assert_eq!(parse_record("sb-1"), ("sb-1".into(), None));
        assert_eq!(parse_record(""), (String::new(), None));
    }

    #[test]
    fn ranges_stay_below_the_invalid_id() {
        let last = FIRST_ID as u64 + (SLOTS as u64 - 1) * RANGE as u64 + RANGE as u64 - 1;
        assert!(last < u32::MAX as u64);
    }
}

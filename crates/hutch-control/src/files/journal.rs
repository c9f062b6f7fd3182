//! The undo record of an archive upload, kept on the host so that a daemon
//! killed part way through an upload leaves the target directory exactly as
//! it was, or exactly as the archive makes it, once a new daemon adopts the
//! sandbox.
//!
//! An upload goes through three phases, and the record says which one it is
//! in before the phase begins:
//!
//! - `staging`: the missing directories up to the target (`made`) and a
//!   hidden staging directory inside it are made, and the archive is written
//!   into the staging directory as it arrives. Undo: remove the staging
//!   directory, then each made directory if it is empty.
//! - `moving`: each move of the commit (`moves`, in order) puts a staged
//!   entry in place; a file that is replaced first goes to a backup name in
//!   the staging directory. Undo, newest move first, by looking at what is
//!   there: a backup that exists goes back over the new file; an entry whose
//!   staged copy is gone is moved back into the staging directory. Then as
//!   for `staging`.
//! - `committed`: every move is done. Finish instead of undoing: set the
//!   bits of the directories the archive made (`chmods`), remove the staging
//!   directory.
//!
//! Every step of both directions is idempotent, so a daemon killed while
//! undoing or finishing is undone or finished again by the next. The same
//! code undoes an upload that failed while the daemon ran. The record lives
//! in `<state>/uploads/<sandbox id>.<upload>.json` (0600, in a 0700
//! directory), written to a temporary, synced and renamed; it is found when
//! the sandbox is adopted after a restart (or resumed, if it was suspended),
//! and removed when the upload ends. Records of sandboxes that are gone are
//! swept at start-up.
//!
//! The record is written by the daemon only: nothing in it comes from the
//! sandbox. What it makes the agent do (renames and removals inside the
//! sandbox, as the upload's user, never through a symlink) the sandbox's
//! workload could do itself.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use hutch_agent::proto::EntryKind;
use hutch_api::ErrorCode;
use serde::{Deserialize, Serialize};

use super::{join, FilesError, Link};

/// Which phase an upload is in; see the module documentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    Staging,
    Moving,
    Committed,
}

/// One move of a commit: the staged entry at `path` (relative to the
/// target and to the staging directory) goes into place; with `backup`, the
/// file it replaces first moves to that name inside the staging directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Move {
    pub path: String,
    pub backup: Option<String>,
}

/// The record of one archive upload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Journal {
    pub version: u32,
    /// The sandbox user the upload acts as.
    pub user: String,
    /// Absolute, normalized.
    pub target: String,
    /// The staging directory, inside `target`.
    pub staging: String,
    /// Directories made on the way to `target`, outermost first.
    pub made: Vec<String>,
    pub phase: Phase,
    /// Empty before `moving`.
    pub moves: Vec<Move>,
    /// Absolute paths and permission bits, deepest first.
    pub chmods: Vec<(String, u32)>,
}

/// Where one sandbox's upload records live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalDir {
    /// `<state>/uploads`.
    pub dir: PathBuf,
    /// The sandbox's id: the records' name prefix.
    pub sandbox: String,
}

impl JournalDir {
    fn path(&self, upload: &str) -> PathBuf {
        self.dir.join(format!("{}.{upload}.json", self.sandbox))
    }

    /// Writes the record of `upload` durably: a temporary, synced, renamed
    /// over the old record, and the directory synced.
    pub async fn save(&self, upload: &str, journal: &Journal) -> Result<(), FilesError> {
        let (dir, path) = (self.dir.clone(), self.path(upload));
        let journal = journal.clone();
        blocking(move || {
            create_dir(&dir)?;
            let tmp = path.with_extension("tmp");
            let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
            serde_json::to_writer(std::io::BufWriter::new(&mut f), &journal).map_err(std::io::Error::other)?;
            f.flush()?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)?;
            std::fs::File::open(&dir)?.sync_all()
        })
        .await
        .map_err(|e| FilesError::new(ErrorCode::Internal, format!("writing the upload journal: {e}")))
    }

    /// Removes the record of `upload`.
    pub async fn remove(&self, upload: &str) {
        let path = self.path(upload);
        let _ = blocking(move || std::fs::remove_file(&path)).await;
    }

    /// Every record of this sandbox: (upload, journal); unreadable records
    /// are logged and removed (they cannot be applied).
    async fn load_all(&self) -> Vec<(String, Journal)> {
        let this = self.clone();
        blocking(move || {
            let prefix = format!("{}.", this.sandbox);
            let mut out = Vec::new();
            let entries = match std::fs::read_dir(&this.dir) {
                Ok(e) => e,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
                Err(e) => return Err(e),
            };
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                let Some(upload) = name.strip_prefix(&prefix).and_then(|r| r.strip_suffix(".json")) else {
                    continue;
                };
                match std::fs::read(entry.path()).map(|b| serde_json::from_slice::<Journal>(&b)) {
                    Ok(Ok(j)) if j.version == 1 => out.push((upload.to_owned(), j)),
                    other => {
                        tracing::warn!(
                            "sandbox {}: upload journal {name} is unreadable ({other:?}); removed",
                            this.sandbox
                        );
                        let _ = std::fs::remove_file(entry.path());
                    }
                }
            }
            Ok(out)
        })
        .await
        .unwrap_or_else(|e| {
            tracing::warn!("sandbox {}: upload journals unreadable: {e}", self.sandbox);
            Vec::new()
        })
    }
}

fn create_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    match std::fs::DirBuilder::new().mode(0o700).recursive(true).create(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> std::io::Result<T> + Send + 'static) -> std::io::Result<T> {
    tokio::task::spawn_blocking(f).await.map_err(std::io::Error::other)?
}

/// Whether something is at `path` (not following a symlink). An agent that
/// cannot answer is an error: absence is never guessed.
async fn exists(link: &mut Link, path: &str) -> Result<bool, FilesError> {
    Ok(link.stat(path).await?.is_some())
}

/// A refusal of one step (a path that changed meanwhile, a permission) is
/// logged and the rest goes on; a broken agent link stops everything.
fn step(r: Result<(), FilesError>, what: &str, at: &str, failed: &mut bool) -> Result<(), FilesError> {
    match r {
        Ok(()) => Ok(()),
        Err(e) if e.code == ErrorCode::NotFound => Ok(()),
        Err(e) if e.code == ErrorCode::Internal => Err(e),
        Err(e) => {
            tracing::warn!("upload recovery: {what} {at}: {e}");
            *failed = true;
            Ok(())
        }
    }
}

/// Brings an interrupted upload to an end: undone before `committed`,
/// finished after. `Ok(true)` when everything was done; `Ok(false)` when a
/// step was refused (logged; the rest was done); `Err` when the agent could
/// not be reached (nothing can be said; keep the record).
pub(super) async fn settle(link: &mut Link, j: &Journal) -> Result<bool, FilesError> {
    let mut failed = false;
    if j.phase == Phase::Committed {
        for (path, mode) in &j.chmods {
            step(link.chmod(path, *mode).await, "chmod", path, &mut failed)?;
        }
        step(link.remove(&j.staging).await, "remove", &j.staging, &mut failed)?;
        return Ok(!failed);
    }
    let staging_is_dir = matches!(link.stat(&j.staging).await?, Some(e) if e.kind == EntryKind::Dir);
    if staging_is_dir {
        for m in j.moves.iter().rev() {
            let at = join(&j.target, &m.path);
            match &m.backup {
                Some(backup) => {
                    let old = join(&j.staging, backup);
                    if exists(link, &old).await? {
                        step(link.rename(&old, &at).await, "restore", &at, &mut failed)?;
                    }
                }
                None => {
                    let staged = join(&j.staging, &m.path);
                    if !exists(link, &staged).await? && exists(link, &at).await? {
                        step(link.rename(&at, &staged).await, "take back", &at, &mut failed)?;
                    }
                }
            }
        }
        step(link.remove(&j.staging).await, "remove", &j.staging, &mut failed)?;
    }
    for dir in j.made.iter().rev() {
        step(link.remove_if_empty(dir).await, "remove", dir, &mut failed)?;
    }
    Ok(!failed)
}

/// Settles every upload a stopped daemon left for the sandbox whose agent
/// listens on `socket`; records that are settled are removed, the others
/// kept for the next adoption. Returns how many were settled.
pub async fn recover(dir: &JournalDir, socket: &Path) -> usize {
    let mut settled = 0;
    for (upload, j) in dir.load_all().await {
        let fs = super::SandboxFs::new(socket.to_path_buf(), Some(j.user.clone()));
        let result = match fs.link().await {
            Ok(mut link) => settle(&mut link, &j).await,
            Err(e) => Err(e),
        };
        match result {
            Ok(clean) => {
                let how = if j.phase == Phase::Committed { "finished" } else { "undone" };
                if clean {
                    tracing::info!(
                        "sandbox {}: an interrupted archive upload into {} was {how}",
                        dir.sandbox,
                        j.target
                    );
                } else {
                    tracing::warn!(
                        "sandbox {}: an interrupted archive upload into {} was {how}, with steps refused",
                        dir.sandbox,
                        j.target
                    );
                }
                dir.remove(&upload).await;
                settled += 1;
            }
            Err(e) => {
                tracing::warn!("sandbox {}: an interrupted upload into {} stays pending: {e}", dir.sandbox, j.target)
            }
        }
    }
    settled
}

/// Removes the records of sandboxes `keep` does not name (they are gone,
/// and so is everything the records describe).
pub async fn sweep(dir: &Path, keep: impl Fn(&str) -> bool + Send + 'static) {
    let dir = dir.to_path_buf();
    let _ = blocking(move || {
        let Ok(entries) = std::fs::read_dir(&dir) else { return Ok(()) };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some((sandbox, _)) = name.split_once('.') else { continue };
            if !keep(sandbox) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        Ok(())
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn records_round_trip_and_are_swept_by_sandbox() {
        let dir = std::env::temp_dir().join(format!("hutch-journal-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let jd = JournalDir { dir: dir.clone(), sandbox: "sb-1".into() };
        let j = Journal {
            version: 1,
            user: "user".into(),
            target: "/workspace/t".into(),
            staging: "/workspace/t/.hutch-archive-00".into(),
            made: vec!["/workspace/t".into()],
            phase: Phase::Moving,
            moves: vec![Move { path: "a".into(), backup: Some(".old-1".into()) }],
            chmods: vec![("/workspace/t/d".into(), 0o500)],
        };
        jd.save("00", &j).await.expect("save");
        let other = JournalDir { dir: dir.clone(), sandbox: "sb-2".into() };
        other.save("01", &j).await.expect("save");
        assert_eq!(jd.load_all().await, vec![("00".to_owned(), j.clone())]);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(jd.path("00")).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(std::fs::metadata(&dir).expect("meta").permissions().mode() & 0o777, 0o700);
        std::fs::write(dir.join("sb-1.bad.json"), b"{not json").expect("write");
        assert_eq!(jd.load_all().await.len(), 1, "an unreadable record is dropped");
        assert!(!dir.join("sb-1.bad.json").exists());
        sweep(&dir, |id| id == "sb-1").await;
        assert_eq!(other.load_all().await, vec![]);
        assert_eq!(jd.load_all().await.len(), 1);
        jd.remove("00").await;
        assert_eq!(jd.load_all().await, vec![]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

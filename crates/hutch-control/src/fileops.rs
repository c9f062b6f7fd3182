//! Single file operations of an E2B session: a closed set (stat, list,
//! make a directory, move, remove, read and set E2B metadata), each
//! validated here and sent to the agent as its one request. Whole-file
//! transfers go through [`crate::files::SandboxFs`].

use crate::control::Control;
use crate::error::{from_agent, ControlError, Result};
use crate::files::{Access, SandboxFs};
use crate::session::{Entry, EnvdSession};
use hutch_agent::proto::{Reply, Request};
use std::collections::BTreeMap;

/// The xattr namespace E2B file metadata lives in: key `k` is `user.e2b.k`.
pub const META_PREFIX: &str = "user.e2b.";
/// Most metadata keys, and bytes of keys and values, one write may set
/// (the agent caps a file's attributes at 64 KiB).
pub const META_KEYS: usize = 64;
pub const META_BYTES: usize = 16 << 10;
/// Deepest listing.
const MAX_DEPTH: u32 = 32;

impl Control {
    async fn file_op(&self, s: &EnvdSession, req: Request, access: Access) -> Result<Reply> {
        let live = self.running_of(&s.owner, &s.id).await?;
        let mut conn = live.fresh_conn().await.map_err(|e| from_agent(&s.id, e, access))?;
        match conn.call(req, &[]).await {
            Ok((reply, _)) => Ok(reply),
            Err(e) => Err(from_agent(&s.id, e, access)),
        }
    }

    /// File transfers of the session's sandbox, as its user.
    pub async fn envd_fs(&self, s: &EnvdSession) -> Result<SandboxFs> {
        let live = self.running_of(&s.owner, &s.id).await?;
        Ok(SandboxFs::new(live.socket.clone(), Some(s.user().to_owned()))
            .envd()
            .passing_writes(live.on_disk())
            .with_journal(self.upload_journal(&s.id)))
    }

    /// Describes a path (absolute) without following a final symlink.
    pub async fn fs_stat(&self, s: &EnvdSession, path: &str) -> Result<Entry> {
        match self
            .file_op(s, Request::Stat { path: path.to_owned(), user: Some(s.user().to_owned()) }, Access::Read)
            .await?
        {
            Reply::Stat { entry } => Ok(entry),
            other => Err(unexpected(&other)),
        }
    }

    /// A directory's entries, `depth` levels deep (1 to 32).
    pub async fn fs_list(&self, s: &EnvdSession, path: &str, depth: u32) -> Result<Vec<Entry>> {
        let depth = depth.clamp(1, MAX_DEPTH);
        let req = Request::ListDir { path: path.to_owned(), depth, user: Some(s.user().to_owned()) };
        match self.file_op(s, req, Access::List).await? {
            Reply::Entries { entries, .. } => Ok(entries),
            other => Err(unexpected(&other)),
        }
    }

    /// Makes a directory and its missing parents; false when it existed.
    pub async fn fs_mkdir(&self, s: &EnvdSession, path: &str) -> Result<bool> {
        let req = Request::Mkdir { path: path.to_owned(), parents: true, user: Some(s.user().to_owned()) };
        match self.file_op(s, req, Access::Write).await? {
            Reply::Created { created } => Ok(created),
            other => Err(unexpected(&other)),
        }
    }

    pub async fn fs_rename(&self, s: &EnvdSession, from: &str, to: &str) -> Result<()> {
        let req = Request::Rename {
            from: from.to_owned(),
            to: to.to_owned(),
            user: Some(s.user().to_owned()),
            commit: false,
        };
        self.file_op(s, req, Access::Write).await.map(|_| ())
    }

    /// Removes a file, or a directory with everything below it; a path
    /// that is not there (nor its parent) is removed already, as envd's
    /// `os.RemoveAll` answers.
    pub async fn fs_remove(&self, s: &EnvdSession, path: &str) -> Result<()> {
        match self
            .file_op(s, Request::Remove { path: path.to_owned(), user: Some(s.user().to_owned()) }, Access::Write)
            .await
        {
            Ok(_) => Ok(()),
            Err(ControlError::Files(f)) if f.code == hutch_api::ErrorCode::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// A path's E2B metadata (empty when it has none or it cannot be read).
    pub async fn fs_metadata(&self, s: &EnvdSession, path: &str) -> BTreeMap<String, String> {
        let req = Request::GetXattrs { path: path.to_owned(), user: Some(s.user().to_owned()) };
        match self.file_op(s, req, Access::Read).await {
            Ok(Reply::Xattrs { attrs }) => {
                attrs.into_iter().filter_map(|(k, v)| Some((k.strip_prefix(META_PREFIX)?.to_owned(), v))).collect()
            }
            _ => BTreeMap::new(),
        }
    }

    /// Sets E2B metadata (`key` → `user.e2b.key`) on a path.
    pub async fn fs_set_metadata(&self, s: &EnvdSession, path: &str, meta: &BTreeMap<String, String>) -> Result<()> {
        check_metadata(meta)?;
        let attrs = meta.iter().map(|(k, v)| (format!("{META_PREFIX}{k}"), v.clone())).collect();
        let req = Request::SetXattrs { path: path.to_owned(), attrs, user: Some(s.user().to_owned()) };
        self.file_op(s, req, Access::Write).await.map(|_| ())
    }
}

/// Metadata keys are non-empty and printable; the whole is bounded.
pub fn check_metadata(meta: &BTreeMap<String, String>) -> Result<()> {
    let total: usize = meta.iter().map(|(k, v)| k.len() + v.len()).sum();
    if meta.len() > META_KEYS || total > META_BYTES {
        return Err(ControlError::Invalid(format!("metadata is limited to {META_KEYS} keys and {META_BYTES} bytes")));
    }
    for (k, v) in meta {
        let printable = |s: &str| s.bytes().all(|b| (0x20..0x7f).contains(&b));
        if k.is_empty() || !printable(k) || !printable(v) {
            return Err(ControlError::Invalid(format!("metadata key {:?}: keys and values are printable ASCII", k)));
        }
    }
    Ok(())
}

fn unexpected(r: &Reply) -> ControlError {
    ControlError::Runtime(format!("sandbox agent answered {r:?} unexpectedly"))
}

impl Control {
    /// File transfers of a sandbox of the caller, as its user. A terminated
    /// sandbox is not found; one that is starting or suspended is not
    /// running.
    pub async fn fs(&self, caller: &crate::ids::Caller, id: &crate::ids::SandboxId) -> Result<SandboxFs> {
        let live = match self.running(caller, id).await {
            Ok(l) => l,
            Err(ControlError::NotRunning { state: hutch_api::SandboxState::Terminated, .. }) => {
                return Err(ControlError::NoSandbox(id.to_string()))
            }
            Err(e) => return Err(e),
        };
        Ok(SandboxFs::new(live.socket.clone(), None)
            .passing_writes(live.on_disk())
            .with_journal(self.upload_journal(id)))
    }
}

//! Directory watches: one inotify descriptor for the whole agent (created on
//! first use), kernel watch descriptors mapped back to the protocol watches
//! (one inotify wd can serve several watches of the same directory), and the
//! mapping of inotify events onto [`WatchEvent`]s.

use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use hutch_agent::proto::{ErrorCode, WatchEvent, WatchKind};

use super::files::{FsError, FsResult};
use super::sys;

/// Most watches the agent holds at once.
pub const MAX_WATCHES: usize = 128;
/// Most directories one recursive watch covers.
const MAX_DIRS_PER_WATCH: usize = 8192;

const MASK: u32 = libc::IN_CREATE
    | libc::IN_MOVED_TO
    | libc::IN_MODIFY
    | libc::IN_CLOSE_WRITE
    | libc::IN_DELETE
    | libc::IN_MOVED_FROM
    | libc::IN_ATTRIB
    | libc::IN_ONLYDIR;

struct Watch {
    conn: u64,
    /// Absolute path of the watched directory.
    path: String,
    recursive: bool,
    wds: Vec<i32>,
    /// Events were dropped while the connection was congested.
    lost: bool,
}

/// One event for one connection.
pub struct Delivery {
    pub conn: u64,
    pub watch: u64,
    pub event: WatchEvent,
}

#[derive(Default)]
pub struct Watches {
    fd: Option<OwnedFd>,
    next_id: u64,
    watches: HashMap<u64, Watch>,
    /// wd -> (watch, directory relative to the watch's root, "" for the root).
    wds: HashMap<i32, Vec<(u64, String)>>,
}

fn map_kind(mask: u32) -> Option<WatchKind> {
    if mask & libc::IN_Q_OVERFLOW != 0 {
        Some(WatchKind::Overflow)
    } else if mask & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0 {
        Some(WatchKind::Create)
    } else if mask & libc::IN_MOVED_FROM != 0 {
        // As fsnotify reports a move: rename of the old name, create of the
        // new one (when it lands in a watched directory).
        Some(WatchKind::Rename)
    } else if mask & libc::IN_DELETE != 0 {
        Some(WatchKind::Remove)
    } else if mask & (libc::IN_MODIFY | libc::IN_CLOSE_WRITE) != 0 {
        Some(WatchKind::Write)
    } else if mask & libc::IN_ATTRIB != 0 {
        Some(WatchKind::Chmod)
    } else {
        None
    }
}

fn rel_join(rel: &str, name: &str) -> String {
    match (rel.is_empty(), name.is_empty()) {
        (true, _) => name.to_string(),
        (false, true) => rel.to_string(),
        (false, false) => format!("{rel}/{name}"),
    }
}

impl Watches {
    /// The inotify descriptor, when one exists, to register with epoll.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|f| f.as_fd())
    }

    /// Starts a watch on `path` (already checked to be a directory) for
    /// `conn`; returns the watch id and whether the inotify descriptor was
    /// just created.
    pub fn add(&mut self, conn: u64, path: &str, recursive: bool) -> FsResult<(u64, bool)> {
        if self.watches.len() >= MAX_WATCHES {
            return Err(FsError::new(ErrorCode::Capacity, format!("at most {MAX_WATCHES} watches")));
        }
        let created = self.fd.is_none();
        if created {
            self.fd = Some(sys::inotify_init().map_err(|e| FsError::os("inotify", path, e))?);
        }
        let id = self.next_id;
        self.next_id += 1;
        self.watches.insert(id, Watch { conn, path: path.to_string(), recursive, wds: Vec::new(), lost: false });
        if let Err(e) = self.add_dir(id, "", 0) {
            self.remove(id);
            return Err(FsError::os("watch", path, e));
        }
        Ok((id, created))
    }

    /// Watches one directory of watch `id` (and, when recursive, below it).
    fn add_dir(&mut self, id: u64, rel: &str, flags: u32) -> Result<(), sys::Errno> {
        let (Some(fd), Some(w)) = (self.fd.as_ref(), self.watches.get_mut(&id)) else { return Ok(()) };
        if w.wds.len() >= MAX_DIRS_PER_WATCH {
            return Ok(());
        }
        let full = if rel.is_empty() { w.path.clone() } else { format!("{}/{rel}", w.path.trim_end_matches('/')) };
        let c = CString::new(full.as_str()).map_err(|_| sys::Errno(libc::EINVAL))?;
        let wd = sys::inotify_add_watch(fd.as_fd(), &c, MASK | flags)?;
        w.wds.push(wd);
        let users = self.wds.entry(wd).or_default();
        if !users.iter().any(|(u, _)| *u == id) {
            users.push((id, rel.to_string()));
        }
        if !w.recursive {
            return Ok(());
        }
        let Ok(dir) = sys::open(&c, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW) else { return Ok(()) };
        for d in sys::read_dir(dir.as_fd()).unwrap_or_default() {
            let is_dir = if d.d_type == libc::DT_UNKNOWN {
                sys::fstatat(dir.as_fd(), &d.name, libc::AT_SYMLINK_NOFOLLOW)
                    .map(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR)
                    .unwrap_or(false)
            } else {
                d.d_type == libc::DT_DIR
            };
            if is_dir {
                let sub = rel_join(rel, &String::from_utf8_lossy(d.name.as_bytes()));
                let _ = self.add_dir(id, &sub, libc::IN_DONT_FOLLOW);
            }
        }
        Ok(())
    }

    /// Ends watch `id`; false when there is no such watch.
    pub fn remove(&mut self, id: u64) -> bool {
        let Some(w) = self.watches.remove(&id) else { return false };
        for wd in w.wds {
            if let Some(users) = self.wds.get_mut(&wd) {
                users.retain(|(u, _)| *u != id);
                if users.is_empty() {
                    self.wds.remove(&wd);
                    if let Some(fd) = &self.fd {
                        sys::inotify_rm_watch(fd.as_fd(), wd);
                    }
                }
            }
        }
        true
    }

    pub fn owner(&self, id: u64) -> Option<u64> {
        self.watches.get(&id).map(|w| w.conn)
    }

    /// Ends every watch of a closed connection.
    pub fn remove_conn(&mut self, conn: u64) {
        let ids: Vec<u64> = self.watches.iter().filter(|(_, w)| w.conn == conn).map(|(id, _)| *id).collect();
        for id in ids {
            self.remove(id);
        }
    }

    /// Reads what inotify has queued and turns it into deliveries.
    /// `congested` says whether a connection cannot take more right now: its
    /// events are dropped and it gets one Overflow event later instead.
    pub fn read_events(&mut self, congested: impl Fn(u64) -> bool) -> Vec<Delivery> {
        let mut out = Vec::new();
        let Some(fd) = self.fd.as_ref() else { return out };
        let mut buf = vec![0u8; 64 * 1024];
        let n = match sys::read(fd.as_fd(), &mut buf) {
            Ok(n) => n,
            Err(_) => return out,
        };
        let mut raw = Vec::new();
        let mut pos = 0;
        // struct inotify_event { i32 wd; u32 mask; u32 cookie; u32 len; char name[len]; }
        while pos + 16 <= n {
            let word = |i: usize| [buf[pos + i], buf[pos + i + 1], buf[pos + i + 2], buf[pos + i + 3]];
            let wd = i32::from_ne_bytes(word(0));
            let mask = u32::from_ne_bytes(word(4));
            let len = u32::from_ne_bytes(word(12)) as usize;
            let end = (pos + 16 + len).min(n);
            let name = &buf[pos + 16..end];
            let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
            raw.push((wd, mask, String::from_utf8_lossy(name).into_owned()));
            pos = end;
        }
        for (wd, mask, name) in raw {
            if mask & libc::IN_Q_OVERFLOW != 0 {
                for (&id, w) in &self.watches {
                    out.push(Delivery {
                        conn: w.conn,
                        watch: id,
                        event: WatchEvent { kind: WatchKind::Overflow, name: String::new() },
                    });
                }
                continue;
            }
            if mask & libc::IN_IGNORED != 0 {
                if let Some(users) = self.wds.remove(&wd) {
                    for (id, _) in users {
                        if let Some(w) = self.watches.get_mut(&id) {
                            w.wds.retain(|&x| x != wd);
                        }
                    }
                }
                continue;
            }
            let Some(kind) = map_kind(mask) else { continue };
            let users = self.wds.get(&wd).cloned().unwrap_or_default();
            for (id, rel) in users {
                let rel_name = rel_join(&rel, &name);
                let Some(w) = self.watches.get_mut(&id) else { continue };
                let conn = w.conn;
                let recurse = w.recursive && kind == WatchKind::Create && mask & libc::IN_ISDIR != 0;
                if congested(conn) {
                    w.lost = true;
                } else {
                    if std::mem::take(&mut w.lost) {
                        out.push(Delivery {
                            conn,
                            watch: id,
                            event: WatchEvent { kind: WatchKind::Overflow, name: String::new() },
                        });
                    }
                    out.push(Delivery { conn, watch: id, event: WatchEvent { kind, name: rel_name.clone() } });
                }
                if recurse {
                    let _ = self.add_dir(id, &rel_name, libc::IN_DONT_FOLLOW);
                    // What appeared in the new directory before its watch
                    // did is reported as if it had been seen.
                    let (conn, full) = match self.watches.get(&id) {
                        Some(w) => (w.conn, format!("{}/{rel_name}", w.path.trim_end_matches('/'))),
                        None => continue,
                    };
                    for event in existing(&full, &rel_name) {
                        if congested(conn) {
                            if let Some(w) = self.watches.get_mut(&id) {
                                w.lost = true;
                            }
                            break;
                        }
                        out.push(Delivery { conn, watch: id, event });
                    }
                }
            }
        }
        out
    }
}

/// Most entries reported for a directory found already filled.
const MAX_EXISTING: usize = 1024;

/// Events for what a directory (at `full`, named `rel` in the watch) holds
/// already: a create for each entry, and a write for each regular file
/// with content; directories below it, depth first. Bounded.
fn existing(full: &str, rel: &str) -> Vec<WatchEvent> {
    let mut out = Vec::new();
    let mut todo = vec![(full.to_string(), rel.to_string())];
    while let Some((dir_path, dir_rel)) = todo.pop() {
        let Ok(c) = CString::new(dir_path.as_str()) else { continue };
        let Ok(dir) = sys::open(&c, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW) else { continue };
        for d in sys::read_dir(dir.as_fd()).unwrap_or_default() {
            if out.len() >= MAX_EXISTING {
                return out;
            }
            let Ok(st) = sys::fstatat(dir.as_fd(), &d.name, libc::AT_SYMLINK_NOFOLLOW) else { continue };
            let name = String::from_utf8_lossy(d.name.as_bytes()).into_owned();
            let child = rel_join(&dir_rel, &name);
            out.push(WatchEvent { kind: WatchKind::Create, name: child.clone() });
            match st.st_mode & libc::S_IFMT {
                libc::S_IFREG if st.st_size > 0 => out.push(WatchEvent { kind: WatchKind::Write, name: child }),
                libc::S_IFDIR => todo.push((format!("{dir_path}/{name}"), child)),
                _ => {}
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inotify_masks_map_to_watch_kinds() {
        assert_eq!(map_kind(libc::IN_CREATE | libc::IN_ISDIR), Some(WatchKind::Create));
        assert_eq!(map_kind(libc::IN_MOVED_TO), Some(WatchKind::Create));
        assert_eq!(map_kind(libc::IN_CLOSE_WRITE), Some(WatchKind::Write));
        assert_eq!(map_kind(libc::IN_MODIFY), Some(WatchKind::Write));
        assert_eq!(map_kind(libc::IN_DELETE), Some(WatchKind::Remove));
        assert_eq!(map_kind(libc::IN_MOVED_FROM), Some(WatchKind::Rename));
        assert_eq!(map_kind(libc::IN_ATTRIB), Some(WatchKind::Chmod));
        assert_eq!(map_kind(libc::IN_Q_OVERFLOW), Some(WatchKind::Overflow));
        assert_eq!(map_kind(libc::IN_IGNORED), None);
    }

    #[test]
    fn a_filled_directory_reports_what_it_holds() {
        let root = std::env::temp_dir().join(format!("hutch-watch-existing-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("sub")).expect("dirs");
        std::fs::write(root.join("full.txt"), b"x").expect("file");
        std::fs::write(root.join("empty.txt"), b"").expect("file");
        std::fs::write(root.join("sub/deep.txt"), b"y").expect("file");
        let mut got: Vec<(WatchKind, String)> =
            existing(root.to_str().expect("utf-8"), "new").into_iter().map(|e| (e.kind, e.name)).collect();
        got.sort_by(|a, b| a.1.cmp(&b.1).then(format!("{:?}", a.0).cmp(&format!("{:?}", b.0))));
        let _ = std::fs::remove_dir_all(&root);
        let want: Vec<(WatchKind, String)> = [
            (WatchKind::Create, "new/empty.txt"),
            (WatchKind::Create, "new/full.txt"),
            (WatchKind::Write, "new/full.txt"),
            (WatchKind::Create, "new/sub"),
            (WatchKind::Create, "new/sub/deep.txt"),
            (WatchKind::Write, "new/sub/deep.txt"),
        ]
        .into_iter()
        .map(|(k, n)| (k, n.to_owned()))
        .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn relative_names_join_below_the_watched_dir() {
        assert_eq!(rel_join("", "a"), "a");
        assert_eq!(rel_join("sub", "a"), "sub/a");
        assert_eq!(rel_join("sub", ""), "sub");
    }
}

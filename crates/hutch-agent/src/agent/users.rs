//! Users of the sandbox, looked up in its /etc/passwd (read with a size
//! bound, never through a FIFO, cached until the file changes).

use std::os::fd::BorrowedFd;

use super::sys;

/// Largest /etc/passwd the agent reads.
const MAX_PASSWD: usize = 1024 * 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    /// Absolute home directory ("/" when the entry has none).
    pub home: String,
    pub shell: String,
}

impl User {
    /// Root as it is when /etc/passwd does not list it.
    fn builtin_root() -> User {
        User { name: "root".into(), uid: 0, gid: 0, home: "/root".into(), shell: "/bin/sh".into() }
    }
}

/// Finds `name` in passwd text (`name:x:uid:gid:gecos:home:shell` lines).
pub fn find_user(passwd: &[u8], name: &str) -> Option<User> {
    for line in passwd.split(|&b| b == b'\n') {
        let Ok(line) = std::str::from_utf8(line) else { continue };
        let fields: Vec<&str> = line.trim_end_matches('\r').split(':').collect();
        if fields.len() < 7 || fields[0] != name {
            continue;
        }
        let (Ok(uid), Ok(gid)) = (fields[2].parse(), fields[3].parse()) else { continue };
        let home = if fields[5].starts_with('/') { fields[5] } else { "/" };
        let shell = if fields[6].is_empty() { "/bin/sh" } else { fields[6] };
        return Some(User { name: name.into(), uid, gid, home: home.into(), shell: shell.into() });
    }
    None
}

/// Identity of the passwd file last read: device, inode, size, mtime, ctime.
type FileKey = [i64; 6];

/// /etc/passwd of the sandbox, re-read only when it changes.
#[derive(Default)]
pub struct Users {
    key: Option<FileKey>,
    text: Vec<u8>,
}

impl Users {
    /// Looks `name` up; root is known even without an /etc/passwd entry.
    pub fn lookup(&mut self, root: BorrowedFd<'_>, name: &str) -> Option<User> {
        self.refresh(root);
        find_user(&self.text, name).or_else(|| (name == "root").then(User::builtin_root))
    }

    fn refresh(&mut self, root: BorrowedFd<'_>) {
        let flags = libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY;
        let fd = match sys::openat2(root, c"/etc/passwd", flags, 0, super::files::RESOLVE) {
            Ok(fd) => fd,
            Err(_) => {
                self.key = None;
                self.text.clear();
                return;
            }
        };
        let Ok(st) = sys::fstat(std::os::fd::AsFd::as_fd(&fd)) else { return };
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            self.key = None;
            self.text.clear();
            return;
        }
        let key = [st.st_dev as i64, st.st_ino as i64, st.st_size, st.st_mtime, st.st_mtime_nsec, st.st_ctime_nsec];
        if self.key == Some(key) {
            return;
        }
        let mut text = Vec::new();
        let mut offset = 0u64;
        let mut buf = vec![0u8; 64 * 1024];
        while text.len() < MAX_PASSWD {
            match sys::pread(std::os::fd::AsFd::as_fd(&fd), &mut buf, offset) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let n = n.min(MAX_PASSWD - text.len());
                    text.extend_from_slice(&buf[..n]);
                    offset += n as u64;
                }
            }
        }
        self.key = Some(key);
        self.text = text;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &[u8] = b"root:x:0:0:root:/root:/bin/bash\n\
        # comment\n\
        broken:x:notanumber:1::/x:/bin/sh\n\
        user:x:1000:1000:User,,,:/home/user:\n\
        nohome:x:1001:1001::relative:/bin/zsh\r\n";

    #[test]
    fn passwd_lookup_reads_all_fields() {
        let u = find_user(PASSWD, "user").expect("user exists");
        assert_eq!((u.uid, u.gid), (1000, 1000));
        assert_eq!(u.home, "/home/user");
        assert_eq!(u.shell, "/bin/sh", "empty shell defaults to /bin/sh");
        let r = find_user(PASSWD, "root").expect("root exists");
        assert_eq!((r.uid, r.home.as_str(), r.shell.as_str()), (0, "/root", "/bin/bash"));
    }

    #[test]
    fn passwd_lookup_skips_broken_lines_and_relative_homes() {
        assert_eq!(find_user(PASSWD, "broken"), None);
        assert_eq!(find_user(PASSWD, "missing"), None);
        assert_eq!(find_user(PASSWD, "x"), None);
        let n = find_user(PASSWD, "nohome").expect("listed");
        assert_eq!((n.home.as_str(), n.shell.as_str()), ("/", "/bin/zsh"));
    }
}

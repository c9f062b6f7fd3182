//! Loop devices for the storage image: attach one (`LOOP_CTL_GET_FREE`,
//! then `LOOP_CONFIGURE` with autoclear and direct I/O), find the one an
//! image is attached to, and tell one that its file grew.
//!
//! Autoclear: the kernel detaches the device when its last user closes it,
//! so once the file system on it is unmounted (and no sandbox's mount
//! namespace holds it any longer) nothing is left to clean. Direct I/O: the
//! image's blocks are not cached a second time in the host's page cache
//! (the file system above already caches them, charged to the writer).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LOOP_SET_CAPACITY: libc::c_ulong = 0x4C07;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_FLAGS_DIRECT_IO: u32 = 16;
const LO_NAME_SIZE: usize = 64;

/// `struct loop_info64`.
#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

/// `struct loop_config`.
#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// A loop device configured by us, held open until the file system on it
/// is mounted (closing it before would detach it: autoclear).
#[derive(Debug)]
pub struct Attached {
    pub device: PathBuf,
    pub fd: OwnedFd,
}

/// Attaches `image` to a free loop device.
pub fn attach(image: &Path) -> io::Result<Attached> {
    let ctl = crate::sys::open("/dev/loop-control", libc::O_RDWR | libc::O_CLOEXEC)?;
    let file = crate::sys::open(image, libc::O_RDWR | libc::O_CLOEXEC)?;
    // Another process may take the device the kernel named between our
    // two calls: then the configure fails with EBUSY and we ask again.
    let mut last = io::Error::new(io::ErrorKind::ResourceBusy, "every free loop device was taken meanwhile");
    for _ in 0..32 {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument.
        let n = unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let device = PathBuf::from(format!("/dev/loop{n}"));
        let fd = crate::sys::open(&device, libc::O_RDWR | libc::O_CLOEXEC)?;
        // SAFETY: every field of LoopConfig is an integer or a byte array,
        // for which all zeroes is valid (and what the kernel wants unset).
        let mut config: LoopConfig = unsafe { std::mem::zeroed() };
        config.fd = file.as_raw_fd() as u32;
        config.block_size = 4096;
        config.info.lo_flags = LO_FLAGS_AUTOCLEAR | LO_FLAGS_DIRECT_IO;
        let name = image.as_os_str().as_encoded_bytes();
        let n = name.len().min(LO_NAME_SIZE - 1);
        config.info.lo_file_name[..n].copy_from_slice(&name[..n]);
        // SAFETY: config is a valid loop_config that lives across the call.
        let r = unsafe { libc::ioctl(fd.as_raw_fd(), LOOP_CONFIGURE, &config as *const LoopConfig) };
        if r == 0 {
            return Ok(Attached { device, fd });
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EBUSY) {
            return Err(e);
        }
        last = e;
    }
    Err(last)
}

/// The loop device `image` is attached to, if any (its canonical path is
/// what the kernel shows as the backing file).
pub fn find(image: &Path) -> Option<PathBuf> {
    let image = std::fs::canonicalize(image).ok()?;
    let wanted = image.as_os_str().as_encoded_bytes();
    for e in std::fs::read_dir("/sys/block").ok()?.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with("loop") {
            continue;
        }
        let Ok(backing) = std::fs::read(e.path().join("loop/backing_file")) else { continue };
        if backing.strip_suffix(b"\n").unwrap_or(&backing) == wanted {
            return Some(PathBuf::from(format!("/dev/{name}")));
        }
    }
    None
}

/// Tells a loop device that its backing file's size changed.
pub fn set_capacity(device: &Path) -> io::Result<()> {
    let fd = crate::sys::open(device, libc::O_RDWR | libc::O_CLOEXEC)?;
    // SAFETY: LOOP_SET_CAPACITY takes no argument.
    if unsafe { libc::ioctl(fd.as_raw_fd(), LOOP_SET_CAPACITY, 0) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether the host can make loop devices at all.
pub fn available() -> bool {
    Path::new("/dev/loop-control").exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loop_config_has_the_kernels_layout() {
        assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
        assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
        assert_eq!(std::mem::offset_of!(LoopConfig, info), 8);
    }
}

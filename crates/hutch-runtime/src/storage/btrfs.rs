//! btrfs through its ioctls (`linux/btrfs.h`): subvolumes, snapshots,
//! quota groups, file system facts. No `btrfs` process on any sandbox's
//! path: every call here is one system call on a directory descriptor.
//!
//! The argument structs are the kernel's, laid out by hand (`#[repr(C)]`,
//! sizes checked by tests against the header's). Names are NUL-terminated
//! in fixed buffers; a name that does not fit is refused before the call.

use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, BorrowedFd};

/// `statfs.f_type` of btrfs.
pub const SUPER_MAGIC: i64 = 0x9123_683e;
/// The objectid of every subvolume's root directory.
const FIRST_FREE_OBJECTID: u64 = 256;

const MAGIC: u64 = 0x94;
const IOC_WRITE: u64 = 1;
const IOC_READ: u64 = 2;

const fn ioc(dir: u64, nr: u64, size: usize) -> u64 {
    (dir << 30) | ((size as u64) << 16) | (MAGIC << 8) | nr
}

/// `struct btrfs_ioctl_vol_args`.
#[repr(C)]
struct VolArgs {
    fd: i64,
    name: [u8; 4088],
}

/// `struct btrfs_ioctl_vol_args_v2` (the name arm of its last union).
#[repr(C)]
struct VolArgsV2 {
    fd: i64,
    transid: u64,
    flags: u64,
    unused: [u64; 4],
    name: [u8; 4040],
}

/// `struct btrfs_qgroup_limit`.
#[repr(C)]
#[derive(Default)]
struct QgroupLimit {
    flags: u64,
    max_rfer: u64,
    max_excl: u64,
    rsv_rfer: u64,
    rsv_excl: u64,
}

/// `struct btrfs_ioctl_qgroup_limit_args`.
#[repr(C)]
struct QgroupLimitArgs {
    qgroupid: u64,
    lim: QgroupLimit,
}

/// `struct btrfs_ioctl_quota_ctl_args`.
#[repr(C)]
struct QuotaCtlArgs {
    cmd: u64,
    status: u64,
}

/// `struct btrfs_ioctl_ino_lookup_args`.
#[repr(C)]
struct InoLookupArgs {
    treeid: u64,
    objectid: u64,
    name: [u8; 4080],
}

/// `struct btrfs_ioctl_fs_info_args`.
#[repr(C)]
struct FsInfoArgs {
    max_id: u64,
    num_devices: u64,
    fsid: [u8; 16],
    nodesize: u32,
    sectorsize: u32,
    clone_alignment: u32,
    csum_type: u16,
    csum_size: u16,
    flags: u64,
    generation: u64,
    metadata_uuid: [u8; 16],
    reserved: [u8; 944],
}

const IOC_SUBVOL_CREATE: u64 = ioc(IOC_WRITE, 14, size_of::<VolArgs>());
const IOC_INO_LOOKUP: u64 = ioc(IOC_READ | IOC_WRITE, 18, size_of::<InoLookupArgs>());
const IOC_SNAP_CREATE_V2: u64 = ioc(IOC_WRITE, 23, size_of::<VolArgsV2>());
const IOC_FS_INFO: u64 = ioc(IOC_READ, 31, size_of::<FsInfoArgs>());
const IOC_QUOTA_CTL: u64 = ioc(IOC_READ | IOC_WRITE, 40, size_of::<QuotaCtlArgs>());
// The kernel declares it _IOR, though it only reads the argument.
const IOC_QGROUP_LIMIT: u64 = ioc(IOC_READ, 43, size_of::<QgroupLimitArgs>());
const IOC_SNAP_DESTROY_V2: u64 = ioc(IOC_WRITE, 63, size_of::<VolArgsV2>());
const IOC_RESIZE: u64 = ioc(IOC_WRITE, 3, size_of::<VolArgs>());
const IOC_SUBVOL_GETFLAGS: u64 = ioc(IOC_READ, 25, size_of::<u64>());

const SUBVOL_RDONLY: u64 = 1 << 1;
const QUOTA_CTL_ENABLE: u64 = 1;
const QUOTA_CTL_ENABLE_SIMPLE: u64 = 4;
const QGROUP_LIMIT_MAX_RFER: u64 = 1 << 0;
/// The kernel's value for "no limit".
const QGROUP_NO_LIMIT: u64 = u64::MAX;

/// One ioctl whose argument is `arg`, which the kernel may read and write.
fn ioctl<T>(dir: BorrowedFd<'_>, request: u64, arg: &mut T) -> io::Result<()> {
    // SAFETY: `arg` is a live, exclusively borrowed value of the struct the
    // request's size field names (the constants above are built from
    // size_of of the same types), so the kernel reads and writes only it.
    let r = unsafe { libc::ioctl(dir.as_raw_fd(), request as libc::c_ulong, arg as *mut T) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A zeroed argument struct: every one above is plain integers and bytes,
/// for which all zeroes is a valid value (and what the kernel expects in
/// the fields we do not set).
fn zeroed<T>() -> Box<T> {
    // SAFETY: only called with the `#[repr(C)]` integer-and-byte-array
    // structs of this module, valid when all zero.
    unsafe { Box::new(std::mem::zeroed()) }
}

/// Copies `name` into a kernel name buffer, NUL-terminated; refuses names
/// that do not fit or hold a NUL or a slash.
fn put_name(buf: &mut [u8], name: &str) -> io::Result<()> {
    let b = name.as_bytes();
    if b.is_empty() || b.len() >= buf.len() || b.contains(&0) || b.contains(&b'/') || name == "." || name == ".." {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("bad subvolume name {name:?}")));
    }
    buf[..b.len()].copy_from_slice(b);
    buf[b.len()] = 0;
    Ok(())
}

/// Makes an empty subvolume `name` in directory `dir`.
pub fn subvol_create(dir: BorrowedFd<'_>, name: &str) -> io::Result<()> {
    let mut args = zeroed::<VolArgs>();
    put_name(&mut args.name, name)?;
    ioctl(dir, IOC_SUBVOL_CREATE, args.as_mut())
}

/// Snapshots subvolume `source` (a descriptor of its root directory) as
/// `name` in directory `dir`; read-only when `read_only`. The kernel
/// flushes the source's dirty data first, so the snapshot holds every
/// write made before the call.
pub fn snapshot(source: BorrowedFd<'_>, dir: BorrowedFd<'_>, name: &str, read_only: bool) -> io::Result<()> {
    let mut args = zeroed::<VolArgsV2>();
    args.fd = i64::from(source.as_raw_fd());
    args.flags = if read_only { SUBVOL_RDONLY } else { 0 };
    put_name(&mut args.name, name)?;
    ioctl(dir, IOC_SNAP_CREATE_V2, args.as_mut())
}

/// Deletes subvolume `name` of directory `dir` with everything in it (the
/// kernel frees its extents in the background).
pub fn subvol_delete(dir: BorrowedFd<'_>, name: &str) -> io::Result<()> {
    let mut args = zeroed::<VolArgsV2>();
    put_name(&mut args.name, name)?;
    ioctl(dir, IOC_SNAP_DESTROY_V2, args.as_mut())
}

/// The id of the subvolume holding `fd`.
pub fn subvol_id(fd: BorrowedFd<'_>) -> io::Result<u64> {
    let mut args = zeroed::<InoLookupArgs>();
    args.objectid = FIRST_FREE_OBJECTID;
    ioctl(fd, IOC_INO_LOOKUP, args.as_mut())?;
    Ok(args.treeid)
}

/// Whether the subvolume holding `fd` is read-only.
pub fn subvol_read_only(fd: BorrowedFd<'_>) -> io::Result<bool> {
    let mut flags = 0u64;
    ioctl(fd, IOC_SUBVOL_GETFLAGS, &mut flags)?;
    Ok(flags & SUBVOL_RDONLY != 0)
}

/// Turns full quota groups on for the file system of `fd` (a no-op when
/// they are on already): every extent is charged to every subvolume that
/// references it, which the kernel works out by walking back references
/// at each commit (a snapshot costs a commit of its own, ~10-30 ms here).
pub fn quota_enable(fd: BorrowedFd<'_>) -> io::Result<()> {
    let mut args = QuotaCtlArgs { cmd: QUOTA_CTL_ENABLE, status: 0 };
    ioctl(fd, IOC_QUOTA_CTL, &mut args)
}

/// Turns simple quotas on (Linux 6.7 and later; EINVAL before): an extent
/// is charged to the subvolume that wrote it, and only to it, so a
/// snapshot shares its source's blocks without being charged for them and
/// costs no accounting commit (~3 ms here, against ~10-30 ms with full
/// quota groups). Limits are enforced as with full quota groups.
pub fn quota_enable_simple(fd: BorrowedFd<'_>) -> io::Result<()> {
    let mut args = QuotaCtlArgs { cmd: QUOTA_CTL_ENABLE_SIMPLE, status: 0 };
    ioctl(fd, IOC_QUOTA_CTL, &mut args)
}

/// Sets (Some) or clears (None) the referenced-bytes limit of the level-0
/// quota group of subvolume `subvol`: writes that would take it past the
/// limit fail with EDQUOT.
pub fn qgroup_limit(fd: BorrowedFd<'_>, subvol: u64, max_referenced: Option<u64>) -> io::Result<()> {
    let mut args = QgroupLimitArgs {
        qgroupid: subvol,
        lim: QgroupLimit {
            flags: QGROUP_LIMIT_MAX_RFER,
            max_rfer: max_referenced.unwrap_or(QGROUP_NO_LIMIT),
            ..QgroupLimit::default()
        },
    };
    ioctl(fd, IOC_QGROUP_LIMIT, &mut args)
}

/// The UUID of the file system of `fd` (what names it under /sys/fs/btrfs).
pub fn fsid(fd: BorrowedFd<'_>) -> io::Result<[u8; 16]> {
    let mut args = zeroed::<FsInfoArgs>();
    ioctl(fd, IOC_FS_INFO, args.as_mut())?;
    Ok(args.fsid)
}

/// Grows the file system of `fd` to the whole of its (single) device.
pub fn resize_max(fd: BorrowedFd<'_>) -> io::Result<()> {
    let mut args = zeroed::<VolArgs>();
    put_name(&mut args.name, "max")?;
    ioctl(fd, IOC_RESIZE, args.as_mut())
}

/// A file system UUID as the kernel prints it (`%pU`).
pub fn uuid_string(u: &[u8; 16]) -> String {
    let h = hex::encode(u);
    format!("{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
}

/// What a quota group holds, from /sys/fs/btrfs/<fsid>/qgroups/0_<id>/.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QgroupInfo {
    /// Bytes its subvolume references, as of the last committed transaction
    /// (shared extents included).
    pub referenced: u64,
    /// Bytes only it references, as of the last committed transaction.
    pub exclusive: u64,
    /// Bytes reserved for writes not committed yet (data and metadata).
    pub reserved: u64,
    /// Its referenced-bytes limit, if any.
    pub max_referenced: Option<u64>,
}

/// Reads a quota group's figures from sysfs (`sysfs` is normally
/// /sys/fs/btrfs).
pub fn qgroup_info(sysfs: &std::path::Path, fsid: &[u8; 16], subvol: u64) -> io::Result<QgroupInfo> {
    let dir = sysfs.join(uuid_string(fsid)).join("qgroups").join(format!("0_{subvol}"));
    let read = |name: &str| -> io::Result<u64> {
        let text = std::fs::read_to_string(dir.join(name))?;
        parse_u64(&text).ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("{name}: {text:?}")))
    };
    // Older kernels lack the reservation files; they count as nothing.
    let optional = |name: &str| match read(name) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(0),
        other => other,
    };
    let limited = read("limit_flags")? & QGROUP_LIMIT_MAX_RFER != 0;
    Ok(QgroupInfo {
        referenced: read("referenced")?,
        exclusive: read("exclusive")?,
        reserved: optional("rsv_data")?
            .saturating_add(optional("rsv_meta_pertrans")?)
            .saturating_add(optional("rsv_meta_prealloc")?),
        max_referenced: if limited { Some(read("max_referenced")?) } else { None },
    })
}

/// A sysfs number: decimal, or hex with `0x` (limit_flags is printed so).
pub fn parse_u64(text: &str) -> Option<u64> {
    let t = text.trim();
    match t.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).ok(),
        None => t.parse().ok(),
    }
}

/// The quota mode of a file system (`qgroup`, `squota`), or None when
/// quotas are off.
pub fn quota_mode(sysfs: &std::path::Path, fsid: &[u8; 16]) -> Option<String> {
    let text = std::fs::read_to_string(sysfs.join(uuid_string(fsid)).join("qgroups/mode")).ok()?;
    Some(text.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argument_structs_have_the_kernels_sizes() {
        assert_eq!(size_of::<VolArgs>(), 4096);
        assert_eq!(size_of::<VolArgsV2>(), 4096);
        assert_eq!(std::mem::offset_of!(VolArgsV2, name), 56);
        assert_eq!(size_of::<QgroupLimitArgs>(), 48);
        assert_eq!(size_of::<QuotaCtlArgs>(), 16);
        assert_eq!(size_of::<InoLookupArgs>(), 4096);
        assert_eq!(size_of::<FsInfoArgs>(), 1024);
        assert_eq!(std::mem::offset_of!(FsInfoArgs, fsid), 16);
        // The request numbers of linux/btrfs.h, as the C macros make them.
        assert_eq!(IOC_SUBVOL_CREATE, 0x5000_940e);
        assert_eq!(IOC_SNAP_CREATE_V2, 0x5000_9417);
        assert_eq!(IOC_SNAP_DESTROY_V2, 0x5000_943f);
        assert_eq!(IOC_QGROUP_LIMIT, 0x8030_942b);
        assert_eq!(IOC_QUOTA_CTL, 0xc010_9428);
        assert_eq!(IOC_INO_LOOKUP, 0xd000_9412);
        assert_eq!(IOC_FS_INFO, 0x8400_941f);
    }

    #[test]
    fn names_must_fit_and_be_plain() {
        let mut buf = [0u8; 8];
        assert!(put_name(&mut buf, "abc").is_ok());
        assert_eq!(&buf[..4], b"abc\0");
        for bad in ["", ".", "..", "a/b", "a\0b", "12345678"] {
            assert!(put_name(&mut buf, bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn sysfs_numbers_and_uuids() {
        assert_eq!(parse_u64("16384\n"), Some(16384));
        assert_eq!(parse_u64("0x1\n"), Some(1));
        assert_eq!(parse_u64("x"), None);
        let u = [0x61, 0x07, 0x39, 0x4b, 0xf7, 0xa4, 0x4d, 0x95, 0xa0, 0x44, 0x23, 0x8f, 0xbb, 0xee, 0x62, 0xa9];
        assert_eq!(uuid_string(&u), "6107394b-f7a4-4d95-a044-238fbbee62a9");
    }
}

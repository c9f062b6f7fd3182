//! A fresh btrfs file system without btrfs-progs: the seed (a small file
//! system made once by `scripts/make-btrfs-seed.sh`, committed as its
//! non-zero blocks, gzip-compressed) is written into the sparse image, and
//! its superblocks get a fsid of their own. The daemon grows the file
//! system to the image's size after mounting it (`BTRFS_IOC_RESIZE`,
//! "max"), so one seed serves every size.
//!
//! Every image made from the seed has the same tree blocks, which carry
//! the seed's fsid. Two such file systems could not be mounted side by
//! side under one fsid, so each image gets a random fsid in its
//! superblocks and the seed's goes to `metadata_uuid` (the incompat
//! feature made for this: tree blocks keep the metadata uuid, the device
//! is known by the new fsid), as `btrfstune -m` does. Only superblocks
//! change, each with its crc32c.

use std::io::{self, Read};

pub const SEED: &[u8] = include_bytes!("../../storage/btrfs-seed.gz");

const MAGIC: &[u8; 8] = b"HBSEED01";
const BLOCK: usize = 4096;

/// Superblock copies: the primary at 64 KiB, mirrors at 64 MiB and 256 GiB.
pub const SUPER_OFFSETS: [u64; 3] = [64 << 10, 64 << 20, 256 << 30];
const SUPER_SIZE: usize = 4096;
const SB_CSUM: usize = 0x00;
const SB_FSID: usize = 0x20;
const SB_BYTENR: usize = 0x30;
const SB_MAGIC: usize = 0x40;
const SB_INCOMPAT: usize = 0xbc;
const SB_CSUM_TYPE: usize = 0xc4;
const SB_METADATA_UUID: usize = 0x23b;
const BTRFS_MAGIC: &[u8; 8] = b"_BHRfS_M";
const INCOMPAT_METADATA_UUID: u64 = 1 << 10;

/// The seed, unpacked: its size and its non-zero blocks (offset, bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seed {
    pub size: u64,
    pub blocks: Vec<(u64, Vec<u8>)>,
}

/// Unpacks a seed (gzip of the format `make-btrfs-seed.sh` writes).
pub fn unpack(gz: &[u8]) -> io::Result<Seed> {
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("btrfs seed: {what}"));
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(gz).read_to_end(&mut raw)?;
    if raw.len() < 16 || &raw[..8] != MAGIC {
        return Err(bad("not a seed"));
    }
    let size = u64::from_le_bytes(raw[8..16].try_into().map_err(|_| bad("short header"))?);
    let records = &raw[16..];
    if !records.len().is_multiple_of(8 + BLOCK) {
        return Err(bad("torn record"));
    }
    let mut blocks = Vec::new();
    for r in records.chunks(8 + BLOCK) {
        let off = u64::from_le_bytes(r[..8].try_into().map_err(|_| bad("short record"))?);
        if off.checked_add(BLOCK as u64).is_none_or(|end| end > size) {
            return Err(bad("block past the end"));
        }
        blocks.push((off, r[8..].to_vec()));
    }
    Ok(Seed { size, blocks })
}

/// crc32c (Castagnoli), as btrfs checksums its superblocks.
pub fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for b in data {
        crc ^= *b as u32;
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0x82f6_3b78 } else { crc >> 1 };
        }
    }
    !crc
}

/// Gives one superblock copy the fsid `fsid`, keeping the tree blocks'
/// fsid as its metadata uuid, and checksums it again. Pure: for tests.
pub fn refsid(sb: &mut [u8], fsid: [u8; 16]) -> io::Result<()> {
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidData, format!("btrfs superblock: {what}"));
    if sb.len() != SUPER_SIZE || &sb[SB_MAGIC..SB_MAGIC + 8] != BTRFS_MAGIC {
        return Err(bad("no magic"));
    }
    if u16::from_le_bytes([sb[SB_CSUM_TYPE], sb[SB_CSUM_TYPE + 1]]) != 0 {
        return Err(bad("checksum is not crc32c"));
    }
    let mut incompat = u64::from_le_bytes(sb[SB_INCOMPAT..SB_INCOMPAT + 8].try_into().map_err(|_| bad("short"))?);
    if incompat & INCOMPAT_METADATA_UUID == 0 {
        let old: [u8; 16] = sb[SB_FSID..SB_FSID + 16].try_into().map_err(|_| bad("short"))?;
        sb[SB_METADATA_UUID..SB_METADATA_UUID + 16].copy_from_slice(&old);
        incompat |= INCOMPAT_METADATA_UUID;
        sb[SB_INCOMPAT..SB_INCOMPAT + 8].copy_from_slice(&incompat.to_le_bytes());
    }
    sb[SB_FSID..SB_FSID + 16].copy_from_slice(&fsid);
    let crc = crc32c(&sb[32..]);
    sb[SB_CSUM..SB_CSUM + 32].fill(0);
    sb[SB_CSUM..SB_CSUM + 4].copy_from_slice(&crc.to_le_bytes());
    Ok(())
}

/// Whether a superblock's checksum matches (for tests and checks).
pub fn super_ok(sb: &[u8]) -> bool {
    sb.len() == SUPER_SIZE
        && &sb[SB_MAGIC..SB_MAGIC + 8] == BTRFS_MAGIC
        && sb[SB_CSUM..SB_CSUM + 4] == crc32c(&sb[32..]).to_le_bytes()
}

/// The seed's blocks with a fresh random fsid in every superblock copy
/// (a random version-4 UUID).
pub fn blocks_for_new_fs(seed: &Seed) -> io::Result<Vec<(u64, Vec<u8>)>> {
    let mut fsid = [0u8; 16];
    crate::sys::random_bytes(&mut fsid)?;
    fsid[6] = (fsid[6] & 0x0f) | 0x40;
    fsid[8] = (fsid[8] & 0x3f) | 0x80;
    let mut blocks = seed.blocks.clone();
    let mut supers = 0;
    for (off, data) in blocks.iter_mut() {
        if SUPER_OFFSETS.contains(off) {
            let bytenr = u64::from_le_bytes(data[SB_BYTENR..SB_BYTENR + 8].try_into().unwrap_or_default());
            if bytenr != *off {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "btrfs seed: superblock out of place"));
            }
            refsid(data, fsid)?;
            supers += 1;
        }
    }
    if supers == 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "btrfs seed: no superblock"));
    }
    Ok(blocks)
}

/// Writes a fresh file system into `file` (already sized, sparse):
/// only the seed's non-zero blocks are written.
pub fn write_fs(file: &std::fs::File) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    let seed = unpack(SEED)?;
    let len = file.metadata()?.len();
    if len < seed.size {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "image smaller than the btrfs seed"));
    }
    for (off, data) in blocks_for_new_fs(&seed)? {
        file.write_all_at(&data, off)?;
    }
    file.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn the_embedded_seed_is_a_btrfs_with_valid_superblocks() {
        let seed = unpack(SEED).expect("unpack the seed");
        assert_eq!(seed.size, 128 << 20);
        let primary = &seed.blocks.iter().find(|(o, _)| *o == SUPER_OFFSETS[0]).expect("primary superblock").1;
        assert!(super_ok(primary), "the seed's own checksum");
        let a = blocks_for_new_fs(&seed).expect("new fs");
        let b = blocks_for_new_fs(&seed).expect("new fs");
        let sb = |blocks: &[(u64, Vec<u8>)]| blocks.iter().find(|(o, _)| *o == SUPER_OFFSETS[0]).expect("sb").1.clone();
        let (sa, sb2) = (sb(&a), sb(&b));
        assert!(super_ok(&sa) && super_ok(&sb2));
        assert_ne!(sa[SB_FSID..SB_FSID + 16], sb2[SB_FSID..SB_FSID + 16], "each file system has its own fsid");
        assert_eq!(sa[SB_METADATA_UUID..SB_METADATA_UUID + 16], primary[SB_FSID..SB_FSID + 16]);
        // Every non-superblock block is the seed's, untouched.
        let changed = a.iter().zip(&seed.blocks).filter(|(x, y)| x.1 != y.1).count();
        assert_eq!(changed, SUPER_OFFSETS.iter().filter(|o| **o < seed.size).count());
    }

    /// The committed seed is what the script makes today, block for block
    /// in layout, superblock for superblock in structure (mkfs.btrfs makes
    /// new uuids and times each run; the fsid is fixed). Runs the script:
    /// needs btrfs-progs and python3 (scripts/test.sh installs them).
    #[test]
    fn the_embedded_seed_matches_what_the_script_makes() {
        let dir = std::env::temp_dir().join(format!("hutch-seed-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("tmp");
        let out = dir.join("seed.gz");
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/make-btrfs-seed.sh");
        let run = std::process::Command::new(script).arg(&out).output().expect("run make-btrfs-seed.sh");
        let made = std::fs::read(&out);
        let _ = std::fs::remove_dir_all(&dir);
        assert!(run.status.success(), "make-btrfs-seed.sh: {}", String::from_utf8_lossy(&run.stderr));
        let made = unpack(&made.expect("the script's seed")).expect("unpack the script's seed");
        let ours = unpack(SEED).expect("unpack the embedded seed");
        assert_eq!(made.size, ours.size);
        let offsets = |s: &Seed| s.blocks.iter().map(|(o, _)| *o).collect::<Vec<_>>();
        assert_eq!(offsets(&made), offsets(&ours), "block layout: run scripts/make-btrfs-seed.sh");
        let sb = |s: &Seed| s.blocks.iter().find(|(o, _)| *o == SUPER_OFFSETS[0]).expect("superblock").1.clone();
        let (a, b) = (sb(&made), sb(&ours));
        // fsid, then bytenr .. log_root_level (roots, sizes, features),
        // then the label.
        for (from, to) in [(SB_FSID, SB_FSID + 16), (SB_BYTENR, 0xc9), (0x12b, 0x22b)] {
            assert_eq!(a[from..to], b[from..to], "superblock bytes {from:#x}..{to:#x}: run scripts/make-btrfs-seed.sh");
        }
    }

    #[test]
    fn a_written_image_has_the_seeds_blocks_and_a_new_fsid() {
        use std::os::unix::fs::FileExt;
        let path = std::env::temp_dir().join(format!("hutch-seed-img-{}", std::process::id()));
        let f = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path).expect("create");
        let _ = std::fs::remove_file(&path);
        f.set_len(64 << 30).expect("sparse 64 GiB");
        let t = std::time::Instant::now();
        write_fs(&f).expect("write the file system");
        eprintln!("a 64 GiB image's file system written in {:?}", t.elapsed());
        let mut sb = vec![0u8; SUPER_SIZE];
        f.read_exact_at(&mut sb, SUPER_OFFSETS[0]).expect("read the superblock");
        assert!(super_ok(&sb));
        let seed = unpack(SEED).expect("seed");
        assert_ne!(
            sb[SB_FSID..SB_FSID + 16],
            seed.blocks.iter().find(|b| b.0 == SUPER_OFFSETS[0]).expect("sb").1[SB_FSID..SB_FSID + 16]
        );
        let small = tempfile_of(1 << 20);
        assert!(write_fs(&small).is_err(), "an image smaller than the seed is refused");
    }

    fn tempfile_of(len: u64) -> std::fs::File {
        let path = std::env::temp_dir().join(format!("hutch-seed-small-{}", std::process::id()));
        let f = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path).expect("create");
        let _ = std::fs::remove_file(&path);
        f.set_len(len).expect("size");
        f
    }

    #[test]
    fn damaged_seeds_are_refused() {
        assert!(unpack(b"not gzip").is_err());
        let mut sb = vec![0u8; SUPER_SIZE];
        assert!(refsid(&mut sb, [1; 16]).is_err(), "no magic");
        assert!(refsid(&mut [0u8; 10], [1; 16]).is_err());
    }
}

#!/usr/bin/env bash
# Makes the btrfs seed that hutch writes into a fresh storage image
# (crates/hutch-runtime/storage/btrfs-seed.gz; see ARCHITECTURE.md, "Disk
# storage"): a 128 MiB file system made by mkfs.btrfs with hutch's options,
# kept as its non-zero 4 KiB blocks, gzip-compressed. The daemon gives each
# image its own fsid and grows it to the image's size; it never runs
# mkfs.btrfs. Needs btrfs-progs and python3 (here, not on hosts).
#
#   scripts/make-btrfs-seed.sh [OUT]     (default: the committed seed)
#
# Format: "HBSEED01", the image size (u64 LE), then records of an offset
# (u64 LE) and 4096 bytes, in offset order.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/../crates/hutch-runtime/storage/btrfs-seed.gz}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
truncate -s 128M "$tmp/seed.img"
# Single copies of data and metadata (the host's disk is the one device);
# a fixed fsid, replaced per image (metadata_uuid keeps this one in the
# tree blocks).
mkfs.btrfs -q -f -K -m single -d single -L hutch -U 68757463-6862-4000-8000-736565640001 \
    "$tmp/seed.img" >/dev/null
python3 - "$tmp/seed.img" "$out" <<'PY'
import gzip, struct, sys
src, out = sys.argv[1], sys.argv[2]
data = open(src, "rb").read()
body = [b"HBSEED01", struct.pack("<Q", len(data))]
for off in range(0, len(data), 4096):
    block = data[off:off + 4096]
    if block.count(0) != len(block):
        body.append(struct.pack("<Q", off) + block)
with open(out, "wb") as f:
    with gzip.GzipFile(fileobj=f, mode="wb", compresslevel=9, mtime=0) as g:
        g.write(b"".join(body))
PY

-- Volumes: files that outlive sandboxes, kept in the daemon's storage (a
-- btrfs subvolume named after the id, with a quota group limit of
-- size_mib). A row is written only once its subvolume is whole, and
-- deleted before it.
CREATE TABLE volumes (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    size_mib INTEGER NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE UNIQUE INDEX volumes_name ON volumes (owner, name);
-- Which sandbox mounts which volume where. A claim holds while its sandbox
-- has not ended (any state but terminated): a sandbox's end, whoever
-- records it (a delete, an expiry, the recovery after a restart), releases
-- its claims with no write of their own.
CREATE TABLE volume_mounts (
    volume_id TEXT NOT NULL REFERENCES volumes (id) ON DELETE CASCADE,
    sandbox_id TEXT NOT NULL,
    path TEXT NOT NULL,
    read_only INTEGER NOT NULL,
    PRIMARY KEY (volume_id, sandbox_id)
);
CREATE INDEX volume_mounts_sandbox ON volume_mounts (sandbox_id);

-- Snapshots: a sandbox's files at one instant, kept in the daemon's storage
-- (a read-only btrfs subvolume named after the id). A row is written only
-- once its subvolume is whole, and deleted before it.
CREATE TABLE snapshots (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    name TEXT,
    sandbox_id TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    size_bytes INTEGER NOT NULL,
    -- JSON: what a sandbox started from it runs (the source's template
    -- settings, image, limits, environment and network policy).
    recipe TEXT NOT NULL
);
CREATE UNIQUE INDEX snapshots_name ON snapshots (owner, name) WHERE name IS NOT NULL;
CREATE INDEX snapshots_owner ON snapshots (owner, created_at);
-- The snapshot a sandbox started from, if any.
ALTER TABLE sandboxes ADD COLUMN origin TEXT;
-- Snapshots a key may keep.
ALTER TABLE api_keys ADD COLUMN max_snapshots INTEGER;

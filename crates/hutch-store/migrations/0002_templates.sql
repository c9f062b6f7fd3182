-- Templates (per owner, versioned) and warm pools.
CREATE TABLE templates (
    id               TEXT PRIMARY KEY,
    owner            TEXT NOT NULL,
    name             TEXT NOT NULL,
    -- Raised by a change to what runs (image, env, memory, limits).
    version          INTEGER NOT NULL,
    image            TEXT NOT NULL,
    class            TEXT NOT NULL,
    memory_mb        INTEGER NOT NULL,
    vcpus            REAL NOT NULL,
    disk_mib         INTEGER NOT NULL,
    pids             INTEGER NOT NULL,
    env              TEXT NOT NULL,
    default_ttl_s    INTEGER NOT NULL,
    max_ttl_s        INTEGER NOT NULL,
    warm_min         INTEGER NOT NULL,
    warm_max         INTEGER NOT NULL,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    -- Set by a delete: hidden, no new sandboxes, its pool drained.
    deleted_at       INTEGER
);
CREATE UNIQUE INDEX templates_by_name ON templates (owner, name) WHERE deleted_at IS NULL;

-- Which template (and version) a sandbox runs; NULL for `base`.
ALTER TABLE sandboxes ADD COLUMN template_id TEXT;
ALTER TABLE sandboxes ADD COLUMN template_version INTEGER;
-- 1: started by a warm pool (stays 1 once claimed).
ALTER TABLE sandboxes ADD COLUMN warm INTEGER NOT NULL DEFAULT 0;
-- 1: in a warm pool, not yet claimed; hidden from its owner.
ALTER TABLE sandboxes ADD COLUMN pooled INTEGER NOT NULL DEFAULT 0;
CREATE INDEX sandboxes_pooled ON sandboxes (template_id, created_at) WHERE pooled = 1;

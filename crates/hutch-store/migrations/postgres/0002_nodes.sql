-- The daemons (nodes) sharing this database, and which node each sandbox
-- lives on. A daemon touches only the sandboxes of its own node; sandboxes
-- made before nodes existed are the local node's.
CREATE TABLE nodes (
    name         TEXT PRIMARY KEY,
    advertise    TEXT NOT NULL,
    memory_mib   BIGINT NOT NULL DEFAULT 0,
    disk_mib     BIGINT NOT NULL DEFAULT 0,
    sandboxes    BIGINT NOT NULL DEFAULT 0,
    -- The isolation classes it runs, comma-separated (container,gvisor).
    classes      TEXT NOT NULL DEFAULT '',
    state        TEXT NOT NULL DEFAULT 'active' CHECK (state IN ('active', 'draining', 'lost')),
    started_at   BIGINT NOT NULL,
    heartbeat_at BIGINT NOT NULL
);
ALTER TABLE sandboxes ADD COLUMN node TEXT NOT NULL DEFAULT 'local';
CREATE INDEX sandboxes_by_node ON sandboxes (node, state);

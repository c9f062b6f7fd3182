-- The daemons (nodes) sharing this database, and which node each sandbox
-- lives on. A daemon touches only the sandboxes of its own node; sandboxes
-- made before nodes existed are the local node's.
CREATE TABLE nodes (
    name         TEXT PRIMARY KEY,
    advertise    TEXT NOT NULL,
    memory_mib   INTEGER NOT NULL DEFAULT 0,
    disk_mib     INTEGER NOT NULL DEFAULT 0,
    sandboxes    INTEGER NOT NULL DEFAULT 0,
    -- The isolation classes it runs, comma-separated (container,gvisor).
    classes      TEXT NOT NULL DEFAULT '',
    -- active | draining | lost
    state        TEXT NOT NULL DEFAULT 'active',
    started_at   INTEGER NOT NULL,
    heartbeat_at INTEGER NOT NULL
);
ALTER TABLE sandboxes ADD COLUMN node TEXT NOT NULL DEFAULT 'local';
CREATE INDEX sandboxes_by_node ON sandboxes (node, state);

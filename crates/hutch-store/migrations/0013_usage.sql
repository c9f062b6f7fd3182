-- Usage metering: a ledger of intervals, written when something that is
-- billed changes (a sandbox's state or limits, a snapshot or a volume made,
-- resized or deleted), never sampled. A sandbox has one open interval
-- (end_ms NULL) while it is not terminated: `kind` is 'running',
-- 'paused' (paused or suspended) or 'held' (starting, terminating: only
-- its disk layer counts). A snapshot or a volume has one open interval
-- ('snapshot', 'volume') while it exists. A report closes open intervals
-- at the time it is asked for.
CREATE TABLE usage_intervals (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    owner TEXT NOT NULL,
    kind TEXT NOT NULL,
    -- The sandbox, snapshot or volume.
    subject TEXT NOT NULL,
    -- The sandbox it is of (a snapshot's: the one it was taken of).
    sandbox_id TEXT,
    template TEXT,
    memory_mb INTEGER NOT NULL DEFAULT 0,
    vcpus REAL NOT NULL DEFAULT 0,
    -- The writable layer's limit, the snapshot's size, the volume's size.
    size_bytes INTEGER NOT NULL DEFAULT 0,
    start_ms INTEGER NOT NULL,
    end_ms INTEGER
);
CREATE UNIQUE INDEX usage_open ON usage_intervals (subject) WHERE end_ms IS NULL;
CREATE INDEX usage_owner_time ON usage_intervals (owner, start_ms);
CREATE INDEX usage_end ON usage_intervals (end_ms);
-- What is counted rather than timed: commands started and bytes a
-- sandbox sent out, added in batches (at transitions, at a delete and by a
-- periodic flush).
CREATE TABLE usage_counts (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    owner TEXT NOT NULL,
    sandbox_id TEXT NOT NULL,
    template TEXT NOT NULL,
    at INTEGER NOT NULL,
    commands INTEGER NOT NULL DEFAULT 0,
    egress_bytes INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX usage_counts_owner_time ON usage_counts (owner, at);
-- When the daemon last wrote its counts: after a crash, the last moment its
-- sandboxes were known to run.
CREATE TABLE usage_clock (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    alive_at INTEGER NOT NULL
);

-- Running totals, so that a `/metrics` scrape reads one row per key and
-- the open intervals, not the whole ledger, and one row per final state,
-- not every ended sandbox. Both grow without end on a busy host (a
-- million ended sandboxes took 143 ms to count, on the store's only
-- connection, at every scrape by any key).
--
-- Written to run again (IF NOT EXISTS, and the backfill replaces what is
-- there): a test runs it on a store with history and compares the result
-- with the totals kept since.

-- Per key: what its closed intervals measured (`UsageRow::charge`, which
-- the store calls as it closes one) and every count flushed.
CREATE TABLE IF NOT EXISTS usage_totals (
    owner TEXT PRIMARY KEY,
    memory_mib_seconds REAL NOT NULL DEFAULT 0,
    vcpu_seconds REAL NOT NULL DEFAULT 0,
    paused_seconds REAL NOT NULL DEFAULT 0,
    disk_gib_hours REAL NOT NULL DEFAULT 0,
    snapshot_gib_hours REAL NOT NULL DEFAULT 0,
    volume_gib_hours REAL NOT NULL DEFAULT 0,
    egress_bytes INTEGER NOT NULL DEFAULT 0,
    commands INTEGER NOT NULL DEFAULT 0
);
DELETE FROM usage_totals;
INSERT INTO usage_totals (owner, memory_mib_seconds, vcpu_seconds, paused_seconds, disk_gib_hours,
                          snapshot_gib_hours, volume_gib_hours)
SELECT owner,
    SUM(CASE kind WHEN 'running' THEN memory_mb * ((end_ms - start_ms) / 1000.0) ELSE 0 END),
    SUM(CASE kind WHEN 'running' THEN vcpus * ((end_ms - start_ms) / 1000.0) ELSE 0 END),
    SUM(CASE kind WHEN 'paused' THEN (end_ms - start_ms) / 1000.0 ELSE 0 END),
    SUM(CASE WHEN kind IN ('running', 'paused', 'held')
        THEN size_bytes / 1073741824.0 * ((end_ms - start_ms) / 1000.0) / 3600.0 ELSE 0 END),
    SUM(CASE kind WHEN 'snapshot'
        THEN size_bytes / 1073741824.0 * ((end_ms - start_ms) / 1000.0) / 3600.0 ELSE 0 END),
    SUM(CASE kind WHEN 'volume'
        THEN size_bytes / 1073741824.0 * ((end_ms - start_ms) / 1000.0) / 3600.0 ELSE 0 END)
FROM usage_intervals WHERE end_ms IS NOT NULL GROUP BY owner;
INSERT INTO usage_totals (owner, commands, egress_bytes)
SELECT owner, SUM(commands), SUM(egress_bytes) FROM usage_counts WHERE true GROUP BY owner
ON CONFLICT (owner) DO UPDATE SET commands = excluded.commands, egress_bytes = excluded.egress_bytes;

-- Ended sandboxes per final state, kept by triggers, so that every path
-- that ends a sandbox (or removes an ended row) counts. The final states
-- are those `HOLDING` in sqlite.rs leaves out.
CREATE TABLE IF NOT EXISTS sandboxes_ended (
    state TEXT PRIMARY KEY,
    n INTEGER NOT NULL
);
DELETE FROM sandboxes_ended;
INSERT INTO sandboxes_ended (state, n)
SELECT state, COUNT(*) FROM sandboxes WHERE state IN ('terminated', 'lost') GROUP BY state;
CREATE TRIGGER IF NOT EXISTS sandboxes_ended_insert AFTER INSERT ON sandboxes
WHEN NEW.state IN ('terminated', 'lost')
BEGIN
    INSERT INTO sandboxes_ended (state, n) VALUES (NEW.state, 1)
    ON CONFLICT (state) DO UPDATE SET n = n + 1;
END;
CREATE TRIGGER IF NOT EXISTS sandboxes_ended_update AFTER UPDATE OF state ON sandboxes
WHEN OLD.state IS NOT NEW.state AND (OLD.state IN ('terminated', 'lost') OR NEW.state IN ('terminated', 'lost'))
BEGIN
    UPDATE sandboxes_ended SET n = n - 1 WHERE state = OLD.state;
    INSERT INTO sandboxes_ended (state, n) SELECT NEW.state, 1 WHERE NEW.state IN ('terminated', 'lost')
    ON CONFLICT (state) DO UPDATE SET n = n + 1;
END;
CREATE TRIGGER IF NOT EXISTS sandboxes_ended_delete AFTER DELETE ON sandboxes
WHEN OLD.state IN ('terminated', 'lost')
BEGIN
    UPDATE sandboxes_ended SET n = n - 1 WHERE state = OLD.state;
END;

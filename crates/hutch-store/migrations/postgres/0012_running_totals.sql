-- Running totals for `/metrics`: per key, what its closed intervals
-- measured and every count flushed; per final state, the ended sandboxes
-- (see the SQLite migration 0029_running_totals). Written to run again: a
-- test runs it on a store with history and compares.
CREATE TABLE IF NOT EXISTS usage_totals (
    owner TEXT PRIMARY KEY,
    memory_mib_seconds DOUBLE PRECISION NOT NULL DEFAULT 0,
    vcpu_seconds DOUBLE PRECISION NOT NULL DEFAULT 0,
    paused_seconds DOUBLE PRECISION NOT NULL DEFAULT 0,
    disk_gib_hours DOUBLE PRECISION NOT NULL DEFAULT 0,
    snapshot_gib_hours DOUBLE PRECISION NOT NULL DEFAULT 0,
    volume_gib_hours DOUBLE PRECISION NOT NULL DEFAULT 0,
    egress_bytes BIGINT NOT NULL DEFAULT 0,
    commands BIGINT NOT NULL DEFAULT 0
);
DELETE FROM usage_totals;
INSERT INTO usage_totals (owner, memory_mib_seconds, vcpu_seconds, paused_seconds, disk_gib_hours,
                          snapshot_gib_hours, volume_gib_hours)
SELECT owner,
    SUM(CASE kind WHEN 'running' THEN memory_mb * ((end_ms - start_ms) / 1000.0::DOUBLE PRECISION) ELSE 0 END),
    SUM(CASE kind WHEN 'running' THEN vcpus * ((end_ms - start_ms) / 1000.0::DOUBLE PRECISION) ELSE 0 END),
    SUM(CASE kind WHEN 'paused' THEN (end_ms - start_ms) / 1000.0::DOUBLE PRECISION ELSE 0 END),
    SUM(CASE WHEN kind IN ('running', 'paused', 'held')
        THEN size_bytes / 1073741824.0::DOUBLE PRECISION * ((end_ms - start_ms) / 1000.0::DOUBLE PRECISION) / 3600.0
        ELSE 0 END),
    SUM(CASE kind WHEN 'snapshot'
        THEN size_bytes / 1073741824.0::DOUBLE PRECISION * ((end_ms - start_ms) / 1000.0::DOUBLE PRECISION) / 3600.0
        ELSE 0 END),
    SUM(CASE kind WHEN 'volume'
        THEN size_bytes / 1073741824.0::DOUBLE PRECISION * ((end_ms - start_ms) / 1000.0::DOUBLE PRECISION) / 3600.0
        ELSE 0 END)
FROM usage_intervals WHERE end_ms IS NOT NULL GROUP BY owner;
INSERT INTO usage_totals (owner, commands, egress_bytes)
SELECT owner, SUM(commands), SUM(egress_bytes) FROM usage_counts GROUP BY owner
ON CONFLICT (owner) DO UPDATE SET commands = excluded.commands, egress_bytes = excluded.egress_bytes;

CREATE TABLE IF NOT EXISTS sandboxes_ended (
    state TEXT PRIMARY KEY,
    n BIGINT NOT NULL
);
DELETE FROM sandboxes_ended;
INSERT INTO sandboxes_ended (state, n)
SELECT state, COUNT(*) FROM sandboxes WHERE state IN ('terminated', 'lost') GROUP BY state;
CREATE OR REPLACE FUNCTION sandboxes_ended_count() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') AND OLD.state IN ('terminated', 'lost') THEN
        UPDATE sandboxes_ended SET n = n - 1 WHERE state = OLD.state;
    END IF;
    IF TG_OP IN ('UPDATE', 'INSERT') AND NEW.state IN ('terminated', 'lost') THEN
        INSERT INTO sandboxes_ended (state, n) VALUES (NEW.state, 1)
        ON CONFLICT (state) DO UPDATE SET n = sandboxes_ended.n + 1;
    END IF;
    RETURN NULL;
END;
$$;
CREATE OR REPLACE TRIGGER sandboxes_ended_insert AFTER INSERT ON sandboxes
    FOR EACH ROW WHEN (NEW.state IN ('terminated', 'lost')) EXECUTE FUNCTION sandboxes_ended_count();
CREATE OR REPLACE TRIGGER sandboxes_ended_update AFTER UPDATE OF state ON sandboxes
    FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state
        AND (OLD.state IN ('terminated', 'lost') OR NEW.state IN ('terminated', 'lost')))
    EXECUTE FUNCTION sandboxes_ended_count();
CREATE OR REPLACE TRIGGER sandboxes_ended_delete AFTER DELETE ON sandboxes
    FOR EACH ROW WHEN (OLD.state IN ('terminated', 'lost')) EXECUTE FUNCTION sandboxes_ended_count();

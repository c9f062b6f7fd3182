-- When a sandbox ended, for the retention of ended sandboxes (`hutch serve
-- --sandbox-retention`): set by triggers as a sandbox enters a final state
-- (the final states are those `HOLDING` in sqlite.rs leaves out), so that
-- every path that ends one sets it. Sandboxes that ended before this
-- migration count as ended now: they are kept a full retention from here.
ALTER TABLE sandboxes ADD COLUMN ended_at INTEGER;
UPDATE sandboxes SET ended_at = CAST(unixepoch('subsec') * 1000 AS INTEGER) WHERE state IN ('terminated', 'lost');
CREATE INDEX sandboxes_ended_at ON sandboxes (ended_at);
CREATE TRIGGER sandboxes_ended_at_insert AFTER INSERT ON sandboxes
WHEN NEW.state IN ('terminated', 'lost') AND NEW.ended_at IS NULL
BEGIN
    UPDATE sandboxes SET ended_at = CAST(unixepoch('subsec') * 1000 AS INTEGER) WHERE id = NEW.id;
END;
CREATE TRIGGER sandboxes_ended_at_update AFTER UPDATE OF state ON sandboxes
WHEN NEW.state IN ('terminated', 'lost') AND OLD.state NOT IN ('terminated', 'lost')
BEGIN
    UPDATE sandboxes SET ended_at = CAST(unixepoch('subsec') * 1000 AS INTEGER) WHERE id = NEW.id;
END;

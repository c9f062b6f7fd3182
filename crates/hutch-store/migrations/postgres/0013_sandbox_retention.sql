-- When a sandbox ended, for the retention of ended sandboxes (see the
-- SQLite migration 0030_sandbox_retention): set as a sandbox enters a
-- final state, by a trigger; those ended before count as ended now.
ALTER TABLE sandboxes ADD COLUMN ended_at BIGINT;
UPDATE sandboxes SET ended_at = (extract(epoch FROM clock_timestamp()) * 1000)::BIGINT
    WHERE state IN ('terminated', 'lost');
CREATE INDEX sandboxes_ended_at ON sandboxes (ended_at);
CREATE FUNCTION sandboxes_ended_at() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state IN ('terminated', 'lost') AND NEW.ended_at IS NULL
        AND (TG_OP = 'INSERT' OR OLD.state NOT IN ('terminated', 'lost')) THEN
        NEW.ended_at := (extract(epoch FROM clock_timestamp()) * 1000)::BIGINT;
    END IF;
    RETURN NEW;
END;
$$;
CREATE TRIGGER sandboxes_ended_at BEFORE INSERT OR UPDATE OF state ON sandboxes
    FOR EACH ROW EXECUTE FUNCTION sandboxes_ended_at();

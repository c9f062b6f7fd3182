-- Event ids are given by the store, no longer by each daemon (which went
-- on from the highest id it found at its start, so two daemons emitting at
-- once could give one id twice): an identity, never given twice, going on
-- after the ids already stored. `append_events` takes them under an
-- advisory lock so that they commit in their order (see pg.rs).
ALTER TABLE events ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY;
SELECT setval(pg_get_serial_sequence('events', 'id'), COALESCE((SELECT MAX(id) FROM events), 0) + 1, false);

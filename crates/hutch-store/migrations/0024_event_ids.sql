-- Event ids are given by the store, no longer by the daemon (which went on
-- from the highest id it found at its start, so two daemons emitting at
-- once could give one id twice). AUTOINCREMENT: an id is never given
-- again, even after a prune removed the newest events, so a client's
-- cursor never points past events still to come.
CREATE TABLE events_by_store (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at INTEGER NOT NULL,
    owner TEXT NOT NULL,
    type TEXT NOT NULL,
    sandbox_id TEXT,
    body TEXT NOT NULL
);
INSERT INTO events_by_store (id, at, owner, type, sandbox_id, body)
    SELECT id, at, owner, type, sandbox_id, body FROM events ORDER BY id;
DROP TABLE events;
ALTER TABLE events_by_store RENAME TO events;
CREATE INDEX events_owner ON events (owner, id);
CREATE INDEX events_at ON events (at);
CREATE INDEX events_sandbox ON events (sandbox_id, id);

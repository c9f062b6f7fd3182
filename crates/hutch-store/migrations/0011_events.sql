-- Events: every transition and notable outcome, stored with its owner.
-- `id` is given by the daemon (one increasing sequence: the order in which
-- events happened, the cursor of `GET /v1/events` and the SSE stream's
-- `id:`); `at` is Unix ms; `body` is the event as the API shows it (JSON).
CREATE TABLE events (
    id INTEGER PRIMARY KEY,
    at INTEGER NOT NULL,
    owner TEXT NOT NULL,
    type TEXT NOT NULL,
    sandbox_id TEXT,
    body TEXT NOT NULL
);
CREATE INDEX events_owner ON events (owner, id);
CREATE INDEX events_at ON events (at);
CREATE INDEX events_sandbox ON events (sandbox_id, id);

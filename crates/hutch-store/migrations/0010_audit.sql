-- The audit log: one row per mutating API call, appended by the daemon's
-- audit writer. `seq` orders rows as they were appended (the cursor of
-- `GET /v1/audit`); `at` is when the response started (Unix ms); the key's
-- name is copied at append time so that a later revocation keeps it.
-- `targets` is a JSON object of the route's path parameters.
CREATE TABLE audit (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at INTEGER NOT NULL,
    key_id TEXT NOT NULL,
    key_name TEXT NOT NULL,
    method TEXT NOT NULL,
    route TEXT NOT NULL,
    targets TEXT NOT NULL,
    client TEXT NOT NULL,
    status INTEGER NOT NULL,
    error_code TEXT
);
CREATE INDEX audit_at ON audit (at);
CREATE INDEX audit_key ON audit (key_id, seq);
-- Rows are never rewritten; only the retention prune deletes (oldest first).
CREATE TRIGGER audit_append_only BEFORE UPDATE ON audit
BEGIN
    SELECT RAISE(ABORT, 'the audit log is append-only');
END;

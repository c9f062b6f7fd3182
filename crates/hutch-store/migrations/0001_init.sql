-- hutch's first schema. Times are Unix milliseconds, UTC.
CREATE TABLE api_keys (
    id          TEXT PRIMARY KEY,
    name        TEXT NOT NULL,
    -- SHA-256 of the secret, hex; the secret itself is never stored.
    hash        TEXT NOT NULL UNIQUE,
    admin       INTEGER NOT NULL DEFAULT 0,
    created_at  INTEGER NOT NULL,
    revoked_at  INTEGER
);

CREATE TABLE sandboxes (
    id               TEXT PRIMARY KEY,
    owner            TEXT NOT NULL,
    template         TEXT NOT NULL,
    state            TEXT NOT NULL,
    created_at       INTEGER NOT NULL,
    expires_at       INTEGER NOT NULL,
    max_expires_at   INTEGER NOT NULL,
    memory_mb        INTEGER NOT NULL,
    vcpus            REAL NOT NULL,
    disk_mib         INTEGER NOT NULL,
    pids             INTEGER NOT NULL,
    env              TEXT NOT NULL,
    metadata         TEXT NOT NULL,
    limits_applied   TEXT NOT NULL,
    last_error_code  TEXT,
    -- Host pid of the sandbox's PID 1, once it runs.
    host_pid         INTEGER,
    idempotency_key  TEXT,
    request_hash     TEXT
);
CREATE INDEX sandboxes_by_owner ON sandboxes (owner, created_at DESC, id DESC);
CREATE INDEX sandboxes_by_state ON sandboxes (state);
CREATE UNIQUE INDEX sandboxes_by_key ON sandboxes (owner, idempotency_key) WHERE idempotency_key IS NOT NULL;

-- One row per Idempotency-Key of a command: the key's scope is the sandbox
-- (exec) or the owner (one-shot executions).
CREATE TABLE executions (
    scope         TEXT NOT NULL,
    key           TEXT NOT NULL,
    request_hash  TEXT NOT NULL,
    -- running, done, lost
    state         TEXT NOT NULL,
    -- The stored result (JSON), without output when output is not kept.
    result        TEXT,
    created_at    INTEGER NOT NULL,
    PRIMARY KEY (scope, key)
);

-- hutch's PostgreSQL schema: the SQLite schema after its migration 0018
-- (../0001_init.sql to ../0018_class.sql, where each column is
-- explained), in one step. Later changes come as 0002_..., applied in
-- order and recorded in schema_version.
--
-- Translated from SQLite: integers are BIGINT (Rust's i64), REAL is
-- DOUBLE PRECISION, 0/1 flags are BOOLEAN, BLOB is BYTEA, AUTOINCREMENT is
-- an identity column (never reused, as AUTOINCREMENT); JSON stays TEXT.
-- Ids, owners and names compare and sort bytewise (COLLATE "C"), as in
-- SQLite, whatever the database's collation: pages cut at an id are the
-- same on both.
-- Times are Unix milliseconds, UTC.

CREATE TABLE api_keys (
    id               TEXT COLLATE "C" PRIMARY KEY,
    name             TEXT NOT NULL,
    hash             TEXT NOT NULL UNIQUE,
    admin            BOOLEAN NOT NULL DEFAULT FALSE,
    created_at       BIGINT NOT NULL,
    revoked_at       BIGINT,
    max_sandboxes    BIGINT,
    max_memory_mb    BIGINT,
    max_disk_mib     BIGINT,
    max_ttl_seconds  BIGINT,
    max_builds       BIGINT,
    max_snapshots    BIGINT,
    grant_secret     TEXT
);

CREATE TABLE sandboxes (
    id                TEXT COLLATE "C" PRIMARY KEY,
    owner             TEXT COLLATE "C" NOT NULL,
    template          TEXT NOT NULL,
    state             TEXT NOT NULL,
    created_at        BIGINT NOT NULL,
    expires_at        BIGINT NOT NULL,
    max_expires_at    BIGINT NOT NULL,
    memory_mb         BIGINT NOT NULL,
    vcpus             DOUBLE PRECISION NOT NULL,
    disk_mib          BIGINT NOT NULL,
    pids              BIGINT NOT NULL,
    env               TEXT NOT NULL,
    metadata          TEXT NOT NULL,
    limits_applied    TEXT NOT NULL,
    last_error_code   TEXT,
    host_pid          BIGINT,
    idempotency_key   TEXT,
    request_hash      TEXT,
    template_id       TEXT COLLATE "C",
    template_version  BIGINT,
    warm              BOOLEAN NOT NULL DEFAULT FALSE,
    pooled            BOOLEAN NOT NULL DEFAULT FALSE,
    network           TEXT NOT NULL DEFAULT '{}',
    net_learned       TEXT NOT NULL DEFAULT '[]',
    storage           TEXT NOT NULL DEFAULT 'memory',
    origin            TEXT,
    on_expire         TEXT NOT NULL DEFAULT 'delete',
    ttl_s             BIGINT,
    paused_ttl_s      BIGINT,
    idle_timeout_s    BIGINT,
    on_idle           TEXT,
    class             TEXT NOT NULL DEFAULT 'container'
);
CREATE INDEX sandboxes_by_owner ON sandboxes (owner, created_at DESC, id DESC);
CREATE INDEX sandboxes_by_state ON sandboxes (state);
CREATE UNIQUE INDEX sandboxes_by_key ON sandboxes (owner, idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX sandboxes_pooled ON sandboxes (template_id, created_at) WHERE pooled;
CREATE INDEX sandboxes_usage ON sandboxes (state, owner, memory_mb, disk_mib);

CREATE TABLE executions (
    scope         TEXT NOT NULL,
    key           TEXT NOT NULL,
    request_hash  TEXT NOT NULL,
    state         TEXT NOT NULL,
    result        TEXT,
    created_at    BIGINT NOT NULL,
    PRIMARY KEY (scope, key)
);

CREATE TABLE templates (
    id              TEXT COLLATE "C" PRIMARY KEY,
    owner           TEXT COLLATE "C" NOT NULL,
    name            TEXT COLLATE "C" NOT NULL,
    version         BIGINT NOT NULL,
    image           TEXT NOT NULL,
    class           TEXT NOT NULL,
    memory_mb       BIGINT NOT NULL,
    vcpus           DOUBLE PRECISION NOT NULL,
    disk_mib        BIGINT NOT NULL,
    pids            BIGINT NOT NULL,
    env             TEXT NOT NULL,
    default_ttl_s   BIGINT NOT NULL,
    max_ttl_s       BIGINT NOT NULL,
    warm_min        BIGINT NOT NULL,
    warm_max        BIGINT NOT NULL,
    created_at      BIGINT NOT NULL,
    updated_at      BIGINT NOT NULL,
    deleted_at      BIGINT,
    startup         TEXT,
    readiness       TEXT,
    network         TEXT NOT NULL DEFAULT '{}',
    storage         TEXT,
    on_expire       TEXT,
    paused_ttl_s    BIGINT,
    idle_timeout_s  BIGINT,
    on_idle         TEXT,
    secrets         TEXT NOT NULL DEFAULT '[]'
);
CREATE UNIQUE INDEX templates_by_name ON templates (owner, name) WHERE deleted_at IS NULL;

CREATE TABLE builds (
    id           TEXT COLLATE "C" PRIMARY KEY,
    template_id  TEXT COLLATE "C" NOT NULL,
    owner        TEXT COLLATE "C" NOT NULL,
    state        TEXT NOT NULL,
    created_at   BIGINT NOT NULL,
    finished_at  BIGINT,
    error        TEXT,
    parent       TEXT NOT NULL,
    image        TEXT,
    version      BIGINT
);
CREATE INDEX builds_by_template ON builds (template_id, created_at);
CREATE INDEX builds_running ON builds (state, owner);

CREATE TABLE snapshots (
    id          TEXT COLLATE "C" PRIMARY KEY,
    owner       TEXT COLLATE "C" NOT NULL,
    name        TEXT COLLATE "C",
    sandbox_id  TEXT NOT NULL,
    created_at  BIGINT NOT NULL,
    size_bytes  BIGINT NOT NULL,
    recipe      TEXT NOT NULL
);
CREATE UNIQUE INDEX snapshots_name ON snapshots (owner, name) WHERE name IS NOT NULL;
CREATE INDEX snapshots_owner ON snapshots (owner, created_at);

CREATE TABLE volumes (
    id          TEXT COLLATE "C" PRIMARY KEY,
    owner       TEXT COLLATE "C" NOT NULL,
    name        TEXT COLLATE "C" NOT NULL,
    size_mib    BIGINT NOT NULL,
    created_at  BIGINT NOT NULL
);
CREATE UNIQUE INDEX volumes_name ON volumes (owner, name);

CREATE TABLE volume_mounts (
    volume_id   TEXT COLLATE "C" NOT NULL REFERENCES volumes (id) ON DELETE CASCADE,
    sandbox_id  TEXT COLLATE "C" NOT NULL,
    path        TEXT COLLATE "C" NOT NULL,
    read_only   BOOLEAN NOT NULL,
    PRIMARY KEY (volume_id, sandbox_id)
);
CREATE INDEX volume_mounts_sandbox ON volume_mounts (sandbox_id);

CREATE TABLE audit (
    seq         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at          BIGINT NOT NULL,
    key_id      TEXT NOT NULL,
    key_name    TEXT NOT NULL,
    method      TEXT NOT NULL,
    route       TEXT NOT NULL,
    targets     TEXT NOT NULL,
    client      TEXT NOT NULL,
    status      BIGINT NOT NULL,
    error_code  TEXT
);
CREATE INDEX audit_at ON audit (at);
CREATE INDEX audit_key ON audit (key_id, seq);
-- Rows are never rewritten; only the retention prune deletes.
CREATE FUNCTION audit_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'the audit log is append-only';
END
$$;
CREATE TRIGGER audit_append_only BEFORE UPDATE ON audit
    FOR EACH ROW EXECUTE FUNCTION audit_append_only();

CREATE TABLE events (
    id          BIGINT PRIMARY KEY,
    at          BIGINT NOT NULL,
    owner       TEXT COLLATE "C" NOT NULL,
    type        TEXT NOT NULL,
    sandbox_id  TEXT COLLATE "C",
    body        TEXT NOT NULL
);
CREATE INDEX events_owner ON events (owner, id);
CREATE INDEX events_at ON events (at);
CREATE INDEX events_sandbox ON events (sandbox_id, id);

CREATE TABLE webhooks (
    id          TEXT COLLATE "C" PRIMARY KEY,
    owner       TEXT COLLATE "C" NOT NULL,
    url         TEXT NOT NULL,
    events      TEXT NOT NULL,
    secret      TEXT NOT NULL,
    created_at  BIGINT NOT NULL,
    format      TEXT NOT NULL DEFAULT 'native',
    name        TEXT NOT NULL DEFAULT '',
    enabled     BOOLEAN NOT NULL DEFAULT TRUE
);
CREATE INDEX webhooks_owner ON webhooks (owner);

CREATE TABLE webhook_deliveries (
    id           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    webhook_id   TEXT COLLATE "C" NOT NULL REFERENCES webhooks (id) ON DELETE CASCADE,
    event_id     BIGINT NOT NULL,
    event_type   TEXT NOT NULL,
    payload      TEXT NOT NULL,
    status       TEXT NOT NULL,
    attempts     BIGINT NOT NULL DEFAULT 0,
    created_at   BIGINT NOT NULL,
    next_at      BIGINT,
    last_at      BIGINT,
    last_status  BIGINT,
    last_error   TEXT
);
CREATE INDEX deliveries_due ON webhook_deliveries (status, next_at);
CREATE INDEX deliveries_webhook ON webhook_deliveries (webhook_id, id);

CREATE TABLE usage_intervals (
    id          BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    owner       TEXT COLLATE "C" NOT NULL,
    kind        TEXT NOT NULL,
    subject     TEXT COLLATE "C" NOT NULL,
    sandbox_id  TEXT COLLATE "C",
    template    TEXT,
    memory_mb   BIGINT NOT NULL DEFAULT 0,
    vcpus       DOUBLE PRECISION NOT NULL DEFAULT 0,
    size_bytes  BIGINT NOT NULL DEFAULT 0,
    start_ms    BIGINT NOT NULL,
    end_ms      BIGINT
);
CREATE UNIQUE INDEX usage_open ON usage_intervals (subject) WHERE end_ms IS NULL;
CREATE INDEX usage_owner_time ON usage_intervals (owner, start_ms);
CREATE INDEX usage_end ON usage_intervals (end_ms);

CREATE TABLE usage_counts (
    id            BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    owner         TEXT COLLATE "C" NOT NULL,
    sandbox_id    TEXT COLLATE "C" NOT NULL,
    template      TEXT NOT NULL,
    at            BIGINT NOT NULL,
    commands      BIGINT NOT NULL DEFAULT 0,
    egress_bytes  BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX usage_counts_owner_time ON usage_counts (owner, at);

CREATE TABLE usage_clock (
    id        BIGINT PRIMARY KEY CHECK (id = 1),
    alive_at  BIGINT NOT NULL
);

CREATE TABLE secrets (
    id          TEXT COLLATE "C" PRIMARY KEY,
    owner       TEXT COLLATE "C" NOT NULL,
    name        TEXT COLLATE "C" NOT NULL,
    hosts       TEXT NOT NULL,
    header      TEXT,
    format      TEXT,
    metadata    TEXT NOT NULL DEFAULT '{}',
    version     BIGINT NOT NULL DEFAULT 1,
    sealed      BYTEA NOT NULL,
    created_at  BIGINT NOT NULL,
    updated_at  BIGINT NOT NULL
);
CREATE UNIQUE INDEX secrets_name ON secrets (owner, name);

-- Webhooks: an owner's endpoint and the event types it wants (a JSON array
-- of types, or ["*"]); `secret` signs each delivery.
CREATE TABLE webhooks (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    url TEXT NOT NULL,
    events TEXT NOT NULL,
    secret TEXT NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE INDEX webhooks_owner ON webhooks (owner);
-- One delivery of one event to one webhook, made in the transaction that
-- appends the event; `payload` is the body sent. `status` is pending,
-- delivered or failed; a pending one is due at `next_at` (Unix ms).
CREATE TABLE webhook_deliveries (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    webhook_id TEXT NOT NULL REFERENCES webhooks (id) ON DELETE CASCADE,
    event_id INTEGER NOT NULL,
    event_type TEXT NOT NULL,
    payload TEXT NOT NULL,
    status TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    next_at INTEGER,
    last_at INTEGER,
    last_status INTEGER,
    last_error TEXT
);
CREATE INDEX deliveries_due ON webhook_deliveries (status, next_at);
CREATE INDEX deliveries_webhook ON webhook_deliveries (webhook_id, id);

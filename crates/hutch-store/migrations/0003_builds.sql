-- Template builds (a Dockerfile fragment run over the template's image) and
-- the startup command and readiness check of every template.
CREATE TABLE builds (
    id           TEXT PRIMARY KEY,
    template_id  TEXT NOT NULL,
    owner        TEXT NOT NULL,
    -- queued, building, succeeded, failed
    state        TEXT NOT NULL,
    created_at   INTEGER NOT NULL,
    finished_at  INTEGER,
    -- Why it failed: the step and its exit code, or the check that did not pass.
    error        TEXT,
    -- The image it built on: `base`, or an image of the store.
    parent       TEXT NOT NULL,
    -- Set when it succeeded: the image made and the template version it became.
    image        TEXT,
    version      INTEGER
);
CREATE INDEX builds_by_template ON builds (template_id, created_at);

-- JSON objects, or NULL: {"command"} and {"command"|"port", "timeout_seconds"}.
ALTER TABLE templates ADD COLUMN startup TEXT;
ALTER TABLE templates ADD COLUMN readiness TEXT;

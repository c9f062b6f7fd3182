-- Secrets: values sealed with the daemon's key (ChaCha20-Poly1305, key
-- file `secrets.key` in the state directory, mode 0600). `sealed` is the
-- nonce followed by the ciphertext and its tag; the plaintext is never
-- written here. `hosts` is a JSON array of host names (`*.` wildcards)
-- whose HTTPS requests get the value; `header` and `format` say which
-- header the egress proxy sets, when one is configured.
CREATE TABLE secrets (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    hosts TEXT NOT NULL,
    header TEXT,
    format TEXT,
    -- JSON object: the E2B API's metadata of a secret.
    metadata TEXT NOT NULL DEFAULT '{}',
    version INTEGER NOT NULL DEFAULT 1,
    sealed BLOB NOT NULL,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
);
CREATE UNIQUE INDEX secrets_name ON secrets (owner, name);
-- The secrets (by name, JSON array) a template's sandboxes name.
ALTER TABLE templates ADD COLUMN secrets TEXT NOT NULL DEFAULT '[]';

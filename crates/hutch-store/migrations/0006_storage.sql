-- Where a sandbox's files live: 'disk' (a layer under the state directory)
-- or 'memory' (a tmpfs). Sandboxes recorded before this had memory layers.
ALTER TABLE sandboxes ADD COLUMN storage TEXT NOT NULL DEFAULT 'memory';
-- A template's choice for its sandboxes; NULL: the host's default.
ALTER TABLE templates ADD COLUMN storage TEXT;

-- What happens at a sandbox's expiry: 'delete' or 'pause' (to disk, kept
-- paused_ttl_s seconds); the lifetime it was given (ttl_s), which a resume
-- of a sandbox paused at its expiry gives it again.
ALTER TABLE sandboxes ADD COLUMN on_expire TEXT NOT NULL DEFAULT 'delete';
ALTER TABLE sandboxes ADD COLUMN ttl_s INTEGER;
ALTER TABLE sandboxes ADD COLUMN paused_ttl_s INTEGER;
-- A template's choice for its sandboxes; NULL: 'delete' and the default.
ALTER TABLE templates ADD COLUMN on_expire TEXT;
ALTER TABLE templates ADD COLUMN paused_ttl_s INTEGER;

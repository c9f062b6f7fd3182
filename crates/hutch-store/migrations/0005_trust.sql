-- Per-key quotas (NULL: no cap of the key's own; the host's caps apply).
ALTER TABLE api_keys ADD COLUMN max_sandboxes INTEGER;
ALTER TABLE api_keys ADD COLUMN max_memory_mb INTEGER;
ALTER TABLE api_keys ADD COLUMN max_disk_mib INTEGER;
ALTER TABLE api_keys ADD COLUMN max_ttl_seconds INTEGER;
ALTER TABLE api_keys ADD COLUMN max_builds INTEGER;
-- What live sandboxes hold, per owner, read by every admission without
-- touching the rows.
CREATE INDEX sandboxes_usage ON sandboxes (state, owner, memory_mb, disk_mib);
CREATE INDEX builds_running ON builds (state, owner);

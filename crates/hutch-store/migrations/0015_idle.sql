-- A sandbox's idle policy: paused or ended ('pause' or 'delete') after
-- idle_timeout_s seconds with no API use and no command running. NULL:
-- none. Activity itself is kept in the daemon's memory, never here.
ALTER TABLE sandboxes ADD COLUMN idle_timeout_s INTEGER;
ALTER TABLE sandboxes ADD COLUMN on_idle TEXT;
-- A template's choice for its sandboxes (a create's replaces it).
ALTER TABLE templates ADD COLUMN idle_timeout_s INTEGER;
ALTER TABLE templates ADD COLUMN on_idle TEXT;

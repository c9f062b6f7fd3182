-- The node (daemon) that runs an idempotent command or a template build:
-- a daemon's start marks lost, or failed, only its own node's. Rows made
-- before (NULL) are any node's: the first daemon to start marks them, as
-- before.
ALTER TABLE executions ADD COLUMN node TEXT;
ALTER TABLE builds ADD COLUMN node TEXT;

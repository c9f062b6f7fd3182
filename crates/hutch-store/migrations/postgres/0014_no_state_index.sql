-- `sandboxes_by_state` repeated the first column of `sandboxes_usage`,
-- which serves every lookup by state as well (see the SQLite migration
-- 0031_no_state_index).
DROP INDEX IF EXISTS sandboxes_by_state;

-- `sandboxes_by_state` repeated the first column of `sandboxes_usage`
-- (state, owner, memory_mb, disk_mib), which serves every lookup by state
-- as well. Each state change wrote both; now it writes one.
DROP INDEX IF EXISTS sandboxes_by_state;

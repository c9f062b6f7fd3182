-- A webhook delivery is claimed by the node (daemon) that sends it, until
-- `claimed_until` (Unix ms): of daemons sharing the database, one sends
-- it; a claim that ran out (its node died mid-send) lets another retry.
-- Recording the attempt frees it.
ALTER TABLE webhook_deliveries ADD COLUMN claimed_by TEXT;
ALTER TABLE webhook_deliveries ADD COLUMN claimed_until INTEGER;

-- Where a node pushed a snapshot's, or a sandbox paused to disk's, files
-- in the fleet's OCI registry (`host/repo@sha256:...`): what another node
-- pulls to start them. NULL: not pushed (no registry, or files that
-- cannot move, such as those of a sandbox on `base`).
ALTER TABLE sandboxes ADD COLUMN pushed_ref TEXT;
ALTER TABLE snapshots ADD COLUMN pushed_ref TEXT;

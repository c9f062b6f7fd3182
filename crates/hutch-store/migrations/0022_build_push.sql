-- Where a node pushed a successful template build's image in the fleet's
-- OCI registry (`host/repo@sha256:...`): what another node pulls to start
-- sandboxes of it. NULL: not pushed (no registry, a build over `base`,
-- or its push failed).
ALTER TABLE builds ADD COLUMN pushed_ref TEXT;

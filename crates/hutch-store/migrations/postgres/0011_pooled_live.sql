-- The warm pools' index holds live warm sandboxes only (see the SQLite
-- migration 0028_pooled_live): drained or expired warm sandboxes keep
-- `pooled` and would otherwise be read again by every pool pass.
DROP INDEX sandboxes_pooled;
CREATE INDEX sandboxes_pooled ON sandboxes (template_id, created_at)
    WHERE pooled AND state IN ('starting', 'running', 'suspended', 'terminating', 'paused');

-- The warm pools' index holds live warm sandboxes only. Drained warm
-- sandboxes, and those that expired unclaimed, end with `pooled = 1` (they
-- stay hidden from their owner); in the old index every pool pass and
-- every claim read them all again, a list that grows with the host's
-- history. The state list is `HOLDING` in sqlite.rs, word for word: SQLite
-- uses a partial index only for a query that names its condition.
DROP INDEX sandboxes_pooled;
CREATE INDEX sandboxes_pooled ON sandboxes (template_id, created_at)
    WHERE pooled = 1 AND state IN ('starting', 'running', 'suspended', 'terminating', 'paused');

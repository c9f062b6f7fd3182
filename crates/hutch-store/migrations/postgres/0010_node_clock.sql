-- When each node (daemon) was last known alive (its last usage flush):
-- where a node's restart ends the intervals of its sandboxes that did not
-- outlive it. `usage_clock` (one row) was every daemon's at once, so a
-- node's restart took another node's flush for its own; it is still read
-- by a node with no row here yet (its clock from before this migration).
CREATE TABLE usage_node_clock (
    node TEXT PRIMARY KEY,
    alive_at BIGINT NOT NULL
);

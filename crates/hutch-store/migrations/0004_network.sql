-- A sandbox's network: its policy as asked, what the daemon observed, and
-- where it lives on the host (address index, host link), as JSON.
ALTER TABLE sandboxes ADD COLUMN network TEXT NOT NULL DEFAULT '{}';
-- Addresses the daemon's resolver admitted for an allow-listed sandbox
-- (JSON array), written on their own so no other update overwrites them.
ALTER TABLE sandboxes ADD COLUMN net_learned TEXT NOT NULL DEFAULT '[]';
-- A template's network policy for its sandboxes (JSON: egress, allow, deny).
ALTER TABLE templates ADD COLUMN network TEXT NOT NULL DEFAULT '{}';

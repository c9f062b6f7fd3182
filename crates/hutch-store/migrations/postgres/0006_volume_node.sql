-- The node whose disk holds a volume's files: its routes are answered
-- there, and creates that mount it are placed there. Volumes made before
-- volumes named their node are the local node's (as sandboxes were).
ALTER TABLE volumes ADD COLUMN node TEXT NOT NULL DEFAULT 'local';

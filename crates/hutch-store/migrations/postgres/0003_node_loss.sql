-- Node loss: a sandbox of a node declared lost becomes `lost`, and why is
-- kept in words (which node, since when); a paused sandbox of a lost node
-- keeps its state and gets the same note.
ALTER TABLE sandboxes ADD COLUMN reason TEXT;

-- How a sandbox is isolated (hutch_api::Class): what the runtime starts,
-- resumes and destroys it as. Every sandbox made before classes were
-- chosen is a container.
ALTER TABLE sandboxes ADD COLUMN class TEXT NOT NULL DEFAULT 'container';

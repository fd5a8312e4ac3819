-- Responses API objects ride on tasks: a /v1/responses request is a task of kind 'response'.

ALTER TABLE tasks ADD COLUMN kind TEXT NOT NULL DEFAULT 'task' CHECK (kind IN ('task', 'response'));
ALTER TABLE tasks ADD COLUMN background INTEGER NOT NULL DEFAULT 1;
ALTER TABLE tasks ADD COLUMN stored INTEGER NOT NULL DEFAULT 1;    -- the request's "store"
ALTER TABLE tasks ADD COLUMN previous_response_id TEXT;
ALTER TABLE tasks ADD COLUMN expires_at INTEGER;                   -- store:false background results

CREATE INDEX tasks_by_expiry ON tasks (expires_at) WHERE expires_at IS NOT NULL;

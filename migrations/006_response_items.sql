-- Where each item of a stored response lives, so an ``item_reference`` input item (opencode,
-- the AI SDK's stored mode) finds it: its output items, and the input items sent with an id.
-- Per owner: an id names nothing of anyone else's. Rows go with their task.

CREATE TABLE response_items (
    owner   TEXT NOT NULL,                          -- token name; '' when auth is off
    item_id TEXT NOT NULL,
    task_id TEXT NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    PRIMARY KEY (owner, item_id)
) WITHOUT ROWID;

CREATE INDEX response_items_by_task ON response_items (task_id);

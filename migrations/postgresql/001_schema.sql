-- lmspd's schema on PostgreSQL: the same tables and columns as SQLite's migrations 001-006
-- (migrations/*.sql), in PostgreSQL's types. Task and event payloads are JSON kept as bytea,
-- as SQLite keeps them as BLOBs: the store hands them back byte for byte.
--
-- No counter tables kept by triggers here (SQLite's task_counts and reasoning_echo_bytes):
-- on PostgreSQL several nodes write at once, and one hot counter row locked in every
-- transaction would serialise them all (and order their locks into deadlocks). The counts are
-- read from the indexes instead (queries_pg.sql), bounded by the queue bound.

CREATE TABLE tasks (
    id                   text PRIMARY KEY,              -- task_<ULID>
    owner                text NOT NULL,                 -- token name; '' when auth is off
    type                 text NOT NULL DEFAULT 'response' CHECK (type IN ('response')),
    status               text NOT NULL CHECK (status IN
                             ('queued', 'loading', 'running', 'cancelling', 'succeeded', 'failed', 'cancelled')),
    on_restart           text NOT NULL CHECK (on_restart IN ('fail', 'retry', 'resume')),
    request              bytea NOT NULL,                -- the response request, JSON
    response_id          text NOT NULL UNIQUE,
    response             bytea,                         -- the final response object, JSON
    error                bytea,                         -- a problem object, JSON, when failed
    attempt              bigint NOT NULL DEFAULT 1,
    next_seq             bigint NOT NULL DEFAULT 0,     -- sequence number of the next event
    events_expired       bigint NOT NULL DEFAULT 0,     -- 1 once the janitor purged the events
    created_at           bigint NOT NULL,
    updated_at           bigint NOT NULL,
    finished_at          bigint,
    kind                 text NOT NULL DEFAULT 'task' CHECK (kind IN ('task', 'response')),
    background           bigint NOT NULL DEFAULT 1,
    stored               bigint NOT NULL DEFAULT 1,     -- the request's "store"
    previous_response_id text,
    expires_at           bigint,                        -- store:false background results
    conversation         text
);

CREATE INDEX tasks_by_status ON tasks (status, id);
CREATE INDEX tasks_by_owner ON tasks (owner, id);
CREATE INDEX tasks_by_finished ON tasks (finished_at) WHERE finished_at IS NOT NULL;
CREATE INDEX tasks_by_expiry ON tasks (expires_at) WHERE expires_at IS NOT NULL;
CREATE INDEX tasks_by_conversation ON tasks (owner, conversation, id) WHERE conversation IS NOT NULL;

CREATE TABLE events (
    task_id     text NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    seq         bigint NOT NULL,
    type        text NOT NULL,
    data        bytea NOT NULL,                         -- the event JSON, sequence_number included
    tokens      bytea,                                  -- generated token ids of a delta event (resume), JSON
    PRIMARY KEY (task_id, seq)
);

CREATE TABLE idempotency_keys (
    owner       text NOT NULL,
    key         text NOT NULL,
    fingerprint text NOT NULL,                          -- SHA-256 of the canonical request body
    task_id     text NOT NULL,
    created_at  bigint NOT NULL,
    PRIMARY KEY (owner, key)
);

CREATE INDEX idempotency_keys_by_age ON idempotency_keys (created_at);

CREATE TABLE reasoning_echo (
    owner   text NOT NULL,                              -- token name; '' when auth is off
    key     text NOT NULL,                              -- SHA-256 of the canonical assistant turn
    item    bytea NOT NULL,                             -- the reasoning item, JSON
    size    bigint NOT NULL,                            -- octet_length(item)
    used_at bigint NOT NULL,                            -- LRU clock: higher is more recent
    PRIMARY KEY (owner, key)
);

CREATE INDEX reasoning_echo_by_use ON reasoning_echo (used_at);

CREATE TABLE response_items (
    owner   text NOT NULL,                              -- token name; '' when auth is off
    item_id text NOT NULL,
    task_id text NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    PRIMARY KEY (owner, item_id)
);

CREATE INDEX response_items_by_task ON response_items (task_id);

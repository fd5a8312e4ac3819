-- Durable LMSP tasks, their event logs and idempotency keys.

CREATE TABLE tasks (
    id              TEXT PRIMARY KEY,               -- task_<ULID>
    owner           TEXT NOT NULL,                  -- token name; '' when auth is off
    type            TEXT NOT NULL DEFAULT 'response' CHECK (type IN ('response')),
    status          TEXT NOT NULL CHECK (status IN
                        ('queued', 'loading', 'running', 'cancelling', 'succeeded', 'failed', 'cancelled')),
    on_restart      TEXT NOT NULL CHECK (on_restart IN ('fail', 'retry', 'resume')),
    request         BLOB NOT NULL,                  -- the response request, JSON
    response_id     TEXT NOT NULL UNIQUE,
    response        BLOB,                           -- the final response object, JSON
    error           BLOB,                           -- a problem object, JSON, when failed
    attempt         INTEGER NOT NULL DEFAULT 1,
    generated       BLOB,                           -- resume snapshot: generated token ids, JSON
    next_seq        INTEGER NOT NULL DEFAULT 0,     -- sequence number of the next event
    events_expired  INTEGER NOT NULL DEFAULT 0,     -- 1 once the janitor purged the events
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL,
    finished_at     INTEGER
);

CREATE INDEX tasks_by_status ON tasks (status, id);
CREATE INDEX tasks_by_owner ON tasks (owner, id);
CREATE INDEX tasks_by_finished ON tasks (finished_at) WHERE finished_at IS NOT NULL;

CREATE TABLE events (
    task_id     TEXT NOT NULL REFERENCES tasks (id) ON DELETE CASCADE,
    seq         INTEGER NOT NULL,
    type        TEXT NOT NULL,
    data        BLOB NOT NULL,                      -- the event JSON, sequence_number included
    tokens      BLOB,                               -- generated token ids of a delta event (resume), JSON
    PRIMARY KEY (task_id, seq)
) WITHOUT ROWID;

CREATE TABLE idempotency_keys (
    owner       TEXT NOT NULL,
    key         TEXT NOT NULL,
    fingerprint TEXT NOT NULL,                      -- SHA-256 of the canonical request body
    task_id     TEXT NOT NULL,
    created_at  INTEGER NOT NULL,
    PRIMARY KEY (owner, key)
) WITHOUT ROWID;

-- Tasks per status, kept by triggers in the same transactions, so the queue bound is
-- checked in O(1) however many tasks are queued.
CREATE TABLE task_counts (
    status  TEXT PRIMARY KEY,
    n       INTEGER NOT NULL
) WITHOUT ROWID;

CREATE TRIGGER task_counts_insert AFTER INSERT ON tasks BEGIN
    INSERT INTO task_counts (status, n) VALUES (NEW.status, 1)
    ON CONFLICT (status) DO UPDATE SET n = n + 1;
END;

CREATE TRIGGER task_counts_update AFTER UPDATE OF status ON tasks WHEN OLD.status != NEW.status BEGIN
    UPDATE task_counts SET n = n - 1 WHERE status = OLD.status;
    INSERT INTO task_counts (status, n) VALUES (NEW.status, 1)
    ON CONFLICT (status) DO UPDATE SET n = n + 1;
END;

CREATE TRIGGER task_counts_delete AFTER DELETE ON tasks BEGIN
    UPDATE task_counts SET n = n - 1 WHERE status = OLD.status;
END;

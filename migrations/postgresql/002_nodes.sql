-- Nodes (SPEC §15): every `lmspd serve` on this database holds a lease, renewed every
-- [cluster] heartbeat_secs, on the database's clock (so the nodes' clocks need not agree). A task
-- a node claimed carries the node and its lease epoch: every write of the node's into that task
-- checks both (queries_pg.sql), so a node whose lease was taken over writes nothing into it.

CREATE SEQUENCE node_epochs;

CREATE TABLE nodes (
    id           text PRIMARY KEY,                  -- [cluster] node_id, default host:port
    epoch        bigint NOT NULL,                   -- from node_epochs: new at each start
    host         text NOT NULL,
    pid          bigint NOT NULL,
    url          text NOT NULL,                     -- where the node serves
    models       jsonb NOT NULL DEFAULT '[]',       -- the models it serves (loaded first)
    running      bigint NOT NULL DEFAULT 0,         -- tasks it is generating
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    expires_at   timestamptz NOT NULL
);

ALTER TABLE tasks ADD COLUMN node text;             -- the node that claimed it (NULL: queued)
ALTER TABLE tasks ADD COLUMN epoch bigint;          -- that node's lease epoch at the claim

CREATE INDEX tasks_by_node ON tasks (node) WHERE node IS NOT NULL;

-- Wake the other nodes (LISTEN lmspd) once a change commits: an event appended ("e:<task>"),
-- a status changed ("s:<task>:<status>"), a task queued ("q:<task>"). The rows are the truth:
-- a node that missed a notification (its listener reconnected) reads them again.
CREATE FUNCTION lmspd_notify_event() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('lmspd', 'e:' || NEW.task_id);
    RETURN NULL;
END $$;

CREATE FUNCTION lmspd_notify_task() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' OR NEW.status = 'queued' THEN
        PERFORM pg_notify('lmspd', 'q:' || NEW.id);
    END IF;
    IF TG_OP = 'UPDATE' THEN
        PERFORM pg_notify('lmspd', 's:' || NEW.id || ':' || NEW.status);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER events_notify AFTER INSERT ON events FOR EACH ROW EXECUTE FUNCTION lmspd_notify_event();
CREATE TRIGGER tasks_notify_insert AFTER INSERT ON tasks FOR EACH ROW EXECUTE FUNCTION lmspd_notify_task();
CREATE TRIGGER tasks_notify_status AFTER UPDATE OF status ON tasks FOR EACH ROW
    WHEN (OLD.status IS DISTINCT FROM NEW.status) EXECUTE FUNCTION lmspd_notify_task();

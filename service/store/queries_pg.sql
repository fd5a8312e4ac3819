-- PostgreSQL's named queries: the same names, parameters and results as queries.sql (SQLite).
-- Each starts with "-- name: <name>" and runs as one statement; comments are dropped on loading.

-- name: count_queued
SELECT count(*) FROM tasks WHERE status = 'queued';

-- name: status_counts
SELECT status, count(*) AS n FROM tasks GROUP BY status;

-- name: owner_status_counts
SELECT status, count(*) AS n FROM tasks WHERE owner = :owner GROUP BY status;

-- name: count_active
SELECT count(*) FROM tasks WHERE status IN {ACTIVE};

-- name: intake_lock
-- Several nodes count the queue and insert at once: each node's writer sees only its own
-- uncommitted tasks, so without this the queue bound (and background_max_jobs) could be overshot
-- by a batch per node. Held to the end of the transaction, so the next node's count sees this
-- one's tasks committed; taken by intake first in its batch (Writer.submit(first=True)), before
-- any row lock, so waiting for it holds nothing another node waits for (no deadlock). The key
-- is "lmspq" in ASCII (pg_migrate.py's is "lmspd").
SELECT pg_advisory_xact_lock(465692749937);

-- name: insert_task
-- Its affinity: the node that ran its previous response, else the one that last ran a task of
-- its owner with its prompt_cache_key (that node's prompt cache holds its prefix).
INSERT INTO tasks (id, owner, status, on_restart, request, response_id, next_seq, created_at, updated_at,
                   kind, background, stored, previous_response_id, conversation, expires_at,
                   model, cache_key, affinity, queued_at)
VALUES (:id, :owner, 'queued', :on_restart, :request, :response_id, 0, :now, :now,
        :kind, CAST(:background AS integer), CAST(:stored AS integer), :previous_response_id, :conversation,
        :expires_at, CAST(:model AS text), CAST(:cache_key AS text),
        coalesce((SELECT p.node FROM tasks p WHERE p.response_id = CAST(:previous_response_id AS text)),
                 (SELECT p.node FROM tasks p
                  WHERE p.owner = CAST(:owner AS text) AND p.cache_key = CAST(:cache_key AS text)
                    AND p.node IS NOT NULL ORDER BY p.id DESC LIMIT 1)),
        extract(epoch FROM clock_timestamp()))
RETURNING *;

-- name: conversation_turns
SELECT * FROM tasks WHERE owner = :owner AND conversation = :conversation ORDER BY id;

-- name: count_active_background
SELECT count(*) FROM tasks WHERE kind = 'response' AND background = 1 AND status IN {ACTIVE};

-- name: transition
-- A compare-and-set: the first committed transition wins, terminal states never change. Under
-- READ COMMITTED an UPDATE that waited for another's row lock re-checks its WHERE on the row
-- that other transaction committed, so two nodes racing still see one winner. A claimed task
-- moves only by its node's current lease (fencing).
UPDATE tasks SET status = CAST(:to AS text), updated_at = :now,
                 response = coalesce(CAST(:response AS bytea), response),
                 error = coalesce(CAST(:error AS bytea), error),
                 finished_at = CASE WHEN CAST(:to AS text) IN {TERMINAL} THEN :now ELSE finished_at END,
                 node = CASE WHEN status = 'queued' THEN CAST(:me AS text) ELSE node END,
                 epoch = CASE WHEN status = 'queued' THEN CAST(:epoch AS bigint) ELSE epoch END
WHERE id = :id AND status IN (SELECT jsonb_array_elements_text(CAST(:sources AS jsonb)))
  AND (node IS NULL OR (node = CAST(:me AS text) AND epoch = CAST(:epoch AS bigint)));

-- name: claim
-- A queued task claimed by this node (node, epoch: its lease). One that another node is claiming
-- this moment is skipped (SKIP LOCKED), not waited for: that node has it. NO KEY UPDATE, the lock
-- an UPDATE takes: an event's foreign-key check (KEY SHARE) does not make a claim skip the task.
-- Only a task this node may take now: its model, its affinity (lmspd_claimable, migration 004).
UPDATE tasks SET status = CAST(:to AS text), updated_at = :now, node = CAST(:me AS text),
                 epoch = CAST(:epoch AS bigint)
WHERE id = (SELECT id FROM tasks t WHERE id = :id AND status = 'queued' AND node IS NULL
              AND lmspd_claimable(t, CAST(:me AS text), CAST(:hold AS double precision))
            FOR NO KEY UPDATE SKIP LOCKED)
  AND status IN (SELECT jsonb_array_elements_text(CAST(:sources AS jsonb)));

-- name: delete_finished_unstored
-- This node's own (or never claimed): another node's may still be streaming to its reader.
DELETE FROM tasks WHERE id IN (
    SELECT id FROM tasks WHERE kind = 'response' AND stored = 0 AND background = 0
      AND status IN {TERMINAL} AND (node = CAST(:me AS text) OR node IS NULL) LIMIT :limit);

-- name: get_task_by_response
SELECT * FROM tasks WHERE response_id = :response_id;

-- name: delete_task
DELETE FROM tasks WHERE id = :id;

-- name: get_task
SELECT * FROM tasks WHERE id = :id;

-- name: insert_idempotency_key
-- Two nodes inserting one key: the second waits for the first to commit, then inserts nothing.
INSERT INTO idempotency_keys (owner, key, fingerprint, task_id, created_at)
VALUES (:owner, :key, :fingerprint, :task_id, :now)
ON CONFLICT (owner, key) DO NOTHING;

-- name: get_idempotency_key
SELECT fingerprint, task_id FROM idempotency_keys WHERE owner = :owner AND key = :key;

-- name: advance_seq
-- Fenced as a transition is: only the node holding the task's lease appends to a claimed task.
UPDATE tasks SET next_seq = :new_next, updated_at = :now WHERE id = :id AND next_seq = :expected
  AND (node IS NULL OR (node = CAST(:me AS text) AND epoch = CAST(:epoch AS bigint)))
RETURNING *;

-- name: insert_event
INSERT INTO events (task_id, seq, type, data, tokens) VALUES (:task_id, :seq, :type, :data, :tokens);

-- name: events_after
SELECT seq, type, data, tokens FROM events WHERE task_id = :task_id AND seq > :after ORDER BY seq LIMIT :limit;

-- name: list_tasks_by_owner
SELECT * FROM tasks
WHERE owner = :owner AND (CAST(:after AS text) IS NULL OR id < CAST(:after AS text))
  AND (CAST(:statuses AS jsonb) IS NULL
       OR status IN (SELECT jsonb_array_elements_text(CAST(:statuses AS jsonb))))
ORDER BY id DESC LIMIT :limit;

-- name: queued_ids
-- Those this node may claim now (the claim asks the same): others' are not tried in vain.
SELECT id FROM tasks t WHERE status = 'queued'
  AND lmspd_claimable(t, CAST(:me AS text), CAST(:hold AS double precision))
ORDER BY id LIMIT :limit;

-- name: unfinished_ids
-- This node's to settle: those it holds (from its last run, or taken over from a dead node).
SELECT id FROM tasks WHERE status IN {ACTIVE} AND status <> 'queued' AND node = CAST(:me AS text) ORDER BY id;

-- name: requeue
-- Back in line, and no node's: any node serving it claims it again.
UPDATE tasks SET status = 'queued', attempt = attempt + :bump, updated_at = :now, node = NULL, epoch = NULL,
                 queued_at = extract(epoch FROM clock_timestamp())
WHERE id = :id AND status IN {STARTED}
  AND (node IS NULL OR (node = CAST(:me AS text) AND epoch = CAST(:epoch AS bigint)));

-- name: expire_events
UPDATE tasks SET events_expired = 1
WHERE id IN (SELECT id FROM tasks WHERE finished_at < :cutoff AND events_expired = 0 LIMIT :limit);

-- name: delete_expired_events
DELETE FROM events WHERE (task_id, seq) IN (
    SELECT e.task_id, e.seq FROM events e JOIN tasks t ON t.id = e.task_id WHERE t.events_expired = 1 LIMIT :limit);

-- name: purge_tasks
DELETE FROM tasks WHERE id IN (SELECT id FROM tasks WHERE finished_at < :cutoff LIMIT :limit);

-- name: purge_expired
DELETE FROM tasks WHERE id IN (
    SELECT id FROM tasks WHERE expires_at < :cutoff AND finished_at IS NOT NULL LIMIT :limit);

-- name: purge_idempotency_keys
DELETE FROM idempotency_keys WHERE (owner, key) IN (
    SELECT owner, key FROM idempotency_keys WHERE created_at < :cutoff LIMIT :limit);

-- name: responses_expired
DELETE FROM tasks WHERE id IN (
    SELECT id FROM tasks WHERE kind = 'response' AND finished_at < :cutoff LIMIT :limit);

-- name: responses_over_count
DELETE FROM tasks WHERE id IN (
    SELECT id FROM tasks WHERE kind = 'response' AND finished_at IS NOT NULL
    ORDER BY finished_at DESC, id DESC OFFSET :keep);

-- name: responses_over_bytes
DELETE FROM tasks WHERE id IN (
    SELECT id FROM (
        SELECT id, sum(octet_length(request) + coalesce(octet_length(response), 0))
                   OVER (ORDER BY finished_at DESC, id DESC) AS running
        FROM tasks WHERE kind = 'response' AND finished_at IS NOT NULL) AS sized
    WHERE running > :budget);

-- name: conversations_expired
UPDATE tasks SET conversation = NULL WHERE conversation IS NOT NULL AND (owner, conversation) IN (
    SELECT owner, conversation FROM tasks WHERE conversation IS NOT NULL
    GROUP BY owner, conversation HAVING max(coalesce(finished_at, 9223372036854775807)) < :cutoff);

-- name: conversations_over_count
UPDATE tasks SET conversation = NULL WHERE conversation IS NOT NULL AND (owner, conversation) IN (
    SELECT owner, conversation FROM (
        SELECT owner, conversation, max(id) AS last FROM tasks WHERE conversation IS NOT NULL
        GROUP BY owner, conversation ORDER BY last DESC OFFSET :keep) AS older);

-- name: conversations_over_bytes
UPDATE tasks SET conversation = NULL WHERE conversation IS NOT NULL AND (owner, conversation) IN (
    SELECT owner, conversation FROM (
        SELECT owner, conversation, sum(size) OVER (ORDER BY last DESC) AS running FROM (
            SELECT owner, conversation, max(id) AS last,
                   sum(octet_length(request) + coalesce(octet_length(response), 0)) AS size
            FROM tasks WHERE conversation IS NOT NULL GROUP BY owner, conversation) AS sized) AS summed
    WHERE running > :budget);

-- name: cancel_task
UPDATE tasks SET status = CAST(:to AS text), updated_at = :now,
                 response = coalesce(CAST(:response AS bytea), response),
                 finished_at = CASE WHEN CAST(:to AS text) IN {TERMINAL} THEN :now ELSE finished_at END
WHERE id = :id AND status = :from;

-- name: echo_lookup
SELECT key, item FROM reasoning_echo
WHERE owner = :owner AND key IN (SELECT jsonb_array_elements_text(CAST(:keys AS jsonb)));

-- name: echo_put
INSERT INTO reasoning_echo (owner, key, item, size, used_at)
VALUES (:owner, :key, :item, octet_length(CAST(:item AS bytea)),
        (SELECT coalesce(max(used_at), 0) + 1 FROM reasoning_echo))
ON CONFLICT (owner, key) DO UPDATE SET item = excluded.item, size = excluded.size, used_at = excluded.used_at;

-- name: echo_touch
UPDATE reasoning_echo SET used_at = (SELECT max(used_at) + 1 FROM reasoning_echo)
WHERE owner = :owner AND key = :key;

-- name: echo_bytes
SELECT coalesce(sum(size), 0) AS total FROM reasoning_echo;

-- name: echo_oldest
SELECT owner, key, size FROM reasoning_echo ORDER BY used_at;

-- name: echo_delete
DELETE FROM reasoning_echo WHERE owner = :owner AND key = :key;

-- name: item_put
INSERT INTO response_items (owner, item_id, task_id) VALUES (:owner, :item_id, :task_id)
ON CONFLICT (owner, item_id) DO UPDATE SET task_id = excluded.task_id;

-- name: item_task
SELECT t.* FROM response_items i JOIN tasks t ON t.id = i.task_id
WHERE i.owner = :owner AND i.item_id = :item_id;

-- name: node_register
-- A node's start: a new lease epoch; the tasks its previous run left are its own again, under
-- the new epoch (a previous run still alive, only paused, is fenced out by it).
WITH node AS (
    INSERT INTO nodes (id, epoch, host, pid, url, models, expires_at)
    VALUES (:id, nextval('node_epochs'), :host, :pid, :url, CAST(:models AS jsonb),
            now() + make_interval(secs => :lease))
    ON CONFLICT (id) DO UPDATE SET epoch = excluded.epoch, host = excluded.host, pid = excluded.pid,
        url = excluded.url, models = excluded.models, started_at = now(), heartbeat_at = now(),
        expires_at = excluded.expires_at
    RETURNING epoch
), adopted AS (
    UPDATE tasks SET epoch = (SELECT epoch FROM node) WHERE node = :id AND status IN {ACTIVE}
)
SELECT epoch FROM node;

-- name: node_heartbeat
-- Renewed only under the node's own epoch: no row back means its lease was taken over.
UPDATE nodes SET heartbeat_at = now(), expires_at = now() + make_interval(secs => :lease),
                 running = :running, models = CAST(:models AS jsonb)
WHERE id = :id AND epoch = :epoch
RETURNING epoch;

-- name: nodes_expired
-- Nodes whose lease ran out, and nodes that hold unfinished tasks but have no row at all.
SELECT id FROM nodes WHERE expires_at < now() AND id <> CAST(:me AS text)
UNION
SELECT DISTINCT node FROM tasks
WHERE node IS NOT NULL AND node <> CAST(:me AS text) AND status IN {ACTIVE}
  AND NOT EXISTS (SELECT 1 FROM nodes WHERE nodes.id = tasks.node)
ORDER BY 1;

-- name: node_take_over
-- The dead node's row goes (its heartbeat, should it come back, finds none) and its unfinished
-- tasks become this node's, in one transaction; the supervisor then settles them by policy. Two
-- survivors at once: the second waits for the first's row lock and then finds nothing to take.
WITH dead AS (
    DELETE FROM nodes WHERE id = :dead AND expires_at < now() RETURNING id
)
UPDATE tasks SET node = CAST(:me AS text), epoch = CAST(:epoch AS bigint)
WHERE node = :dead AND status IN {ACTIVE}
  AND (EXISTS (SELECT 1 FROM dead) OR NOT EXISTS (SELECT 1 FROM nodes WHERE id = :dead))
RETURNING id;

-- name: node_leave
-- A node stopping: its lease ends now, so a survivor settles what it leaves at once.
UPDATE nodes SET expires_at = now() - interval '1 second' WHERE id = :id AND epoch = :epoch;

-- name: nodes_list
SELECT id, epoch, host, pid, url, models, running,
       CAST(extract(epoch FROM started_at) AS bigint) AS started_at,
       CAST(extract(epoch FROM heartbeat_at) AS bigint) AS heartbeat_at,
       CAST(extract(epoch FROM expires_at) AS bigint) AS expires_at,
       expires_at < now() AS expired,
       (SELECT count(*) FROM tasks t WHERE t.node = nodes.id AND t.status IN {ACTIVE}) AS tasks
FROM nodes ORDER BY id;

-- name: clock
SELECT extract(epoch FROM now()) AS now;

-- name: secret_put
INSERT INTO secrets (name, value) VALUES (:name, :value) ON CONFLICT (name) DO NOTHING;

-- name: secret_get
SELECT value FROM secrets WHERE name = :name;

-- name: nodes_count
SELECT count(*) FILTER (WHERE expires_at >= now()) AS live, count(*) FILTER (WHERE expires_at < now()) AS expired
FROM nodes;

-- name: live_models
-- The models some node with a live lease serves: what intake on any node accepts.
SELECT DISTINCT jsonb_array_elements_text(models) AS model FROM nodes WHERE expires_at >= now() ORDER BY 1;

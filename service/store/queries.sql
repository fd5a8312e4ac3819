-- Named queries: each starts with "-- name: <name>" and runs as one statement.

-- name: count_queued
SELECT coalesce((SELECT n FROM task_counts WHERE status = 'queued'), 0);

-- name: status_counts
SELECT status, n FROM task_counts;

-- name: owner_status_counts
SELECT status, count(*) AS n FROM tasks WHERE owner = :owner GROUP BY status;

-- name: count_active
SELECT coalesce(sum(n), 0) FROM task_counts WHERE status IN {ACTIVE};

-- name: intake_lock
-- One writer here: the count and the insert are one at a time already (queries_pg.sql's locks).
SELECT 1;

-- name: insert_task
-- (:model and :cache_key go unused: one node serves every task it accepted; queries_pg.sql.)
INSERT INTO tasks (id, owner, status, on_restart, request, response_id, next_seq, created_at, updated_at,
                   kind, background, stored, previous_response_id, conversation, expires_at)
VALUES (:id, :owner, 'queued', :on_restart, :request, :response_id, 0, :now, :now,
        :kind, :background, :stored, :previous_response_id, :conversation, :expires_at)
RETURNING *;

-- name: conversation_turns
SELECT * FROM tasks WHERE owner = :owner AND conversation = :conversation ORDER BY id;

-- name: count_active_background
SELECT count(*) FROM tasks WHERE kind = 'response' AND background = 1 AND status IN {ACTIVE};

-- name: transition
-- A compare-and-set: the first committed transition wins, terminal states never change.
UPDATE tasks SET status = :to, updated_at = :now, response = coalesce(:response, response),
                 error = coalesce(:error, error),
                 finished_at = CASE WHEN :to IN {TERMINAL} THEN :now ELSE finished_at END
WHERE id = :id AND status IN (SELECT value FROM json_each(:sources));

-- name: claim
-- A queued task taken to run (PostgreSQL's also records the node, and takes only a task of a
-- model that node serves: queries_pg.sql). One writer, one node here: a claim is the transition.
UPDATE tasks SET status = :to, updated_at = :now
WHERE id = :id AND status = 'queued' AND status IN (SELECT value FROM json_each(:sources));

-- name: delete_finished_unstored
-- Foreground store:false responses whose request ended (their reader is gone).
DELETE FROM tasks WHERE id IN (
    SELECT id FROM tasks WHERE kind = 'response' AND stored = 0 AND background = 0
      AND status IN {TERMINAL} LIMIT :limit);

-- name: get_task_by_response
SELECT * FROM tasks WHERE response_id = :response_id;

-- name: delete_task
DELETE FROM tasks WHERE id = :id;

-- name: get_task
SELECT * FROM tasks WHERE id = :id;

-- name: insert_idempotency_key
-- A key already there (another request with it committed first) inserts nothing: rowcount 0.
INSERT INTO idempotency_keys (owner, key, fingerprint, task_id, created_at)
VALUES (:owner, :key, :fingerprint, :task_id, :now)
ON CONFLICT (owner, key) DO NOTHING;

-- name: get_idempotency_key
SELECT fingerprint, task_id FROM idempotency_keys WHERE owner = :owner AND key = :key;

-- name: advance_seq
-- Appending events is a compare-and-set on next_seq: a writer with a stale view fails.
UPDATE tasks SET next_seq = :new_next, updated_at = :now WHERE id = :id AND next_seq = :expected
RETURNING *;

-- name: insert_event
INSERT INTO events (task_id, seq, type, data, tokens) VALUES (:task_id, :seq, :type, :data, :tokens);

-- name: events_after
SELECT seq, type, data, tokens FROM events WHERE task_id = :task_id AND seq > :after ORDER BY seq LIMIT :limit;

-- name: list_tasks_by_owner
SELECT * FROM tasks
WHERE owner = :owner AND (:after IS NULL OR id < :after)
  AND (:statuses IS NULL OR status IN (SELECT value FROM json_each(:statuses)))
ORDER BY id DESC LIMIT :limit;

-- name: queued_ids
-- (:me and :hold go unused: on one node every queued task is this node's to claim.)
SELECT id FROM tasks WHERE status = 'queued' ORDER BY id LIMIT :limit;

-- name: unfinished_ids
SELECT id FROM tasks WHERE status IN {ACTIVE} ORDER BY id;

-- name: requeue
-- Not a client-visible transition: a restart or engine crash puts started work back in line.
UPDATE tasks SET status = 'queued', attempt = attempt + :bump, updated_at = :now
WHERE id = :id AND status IN {STARTED};

-- name: expire_events
-- Marks at most :limit finished tasks whose events passed the retention window; the
-- events endpoint answers 410 for them from then on.
UPDATE tasks SET events_expired = 1
WHERE id IN (SELECT id FROM tasks WHERE finished_at < :cutoff AND events_expired = 0 LIMIT :limit);

-- name: delete_expired_events
DELETE FROM events WHERE (task_id, seq) IN (
    SELECT e.task_id, e.seq FROM events e JOIN tasks t ON t.id = e.task_id WHERE t.events_expired = 1 LIMIT :limit);

-- name: purge_tasks
DELETE FROM tasks WHERE id IN (SELECT id FROM tasks WHERE finished_at < :cutoff LIMIT :limit);

-- name: purge_expired
-- Finished store:false background responses, readable only for their ephemeral TTL.
DELETE FROM tasks WHERE id IN (
    SELECT id FROM tasks WHERE expires_at < :cutoff AND finished_at IS NOT NULL LIMIT :limit);

-- name: purge_idempotency_keys
DELETE FROM idempotency_keys WHERE (owner, key) IN (
    SELECT owner, key FROM idempotency_keys WHERE created_at < :cutoff LIMIT :limit);

-- name: responses_expired
-- Finished responses past the store TTL (the seed's --responses-store-ttl-secs).
DELETE FROM tasks WHERE id IN (
    SELECT id FROM tasks WHERE kind = 'response' AND finished_at < :cutoff LIMIT :limit);

-- name: responses_over_count
-- Keep the newest :keep finished responses; active ones are never evicted.
DELETE FROM tasks WHERE id IN (
    SELECT id FROM tasks WHERE kind = 'response' AND finished_at IS NOT NULL
    ORDER BY finished_at DESC, id DESC LIMIT -1 OFFSET :keep);

-- name: responses_over_bytes
-- Evict the oldest finished responses until the rest fit in :budget bytes of JSON.
DELETE FROM tasks WHERE id IN (
    SELECT id FROM (
        SELECT id, sum(length(request) + coalesce(length(response), 0))
                   OVER (ORDER BY finished_at DESC, id DESC) AS running
        FROM tasks WHERE kind = 'response' AND finished_at IS NOT NULL)
    WHERE running > :budget);

-- name: conversations_expired
UPDATE tasks SET conversation = NULL WHERE conversation IS NOT NULL AND (owner, conversation) IN (
    SELECT owner, conversation FROM tasks WHERE conversation IS NOT NULL
    GROUP BY owner, conversation HAVING max(coalesce(finished_at, 9223372036854775807)) < :cutoff);

-- name: conversations_over_count
UPDATE tasks SET conversation = NULL WHERE conversation IS NOT NULL AND (owner, conversation) IN (
    SELECT owner, conversation FROM (
        SELECT owner, conversation, max(id) AS last FROM tasks WHERE conversation IS NOT NULL
        GROUP BY owner, conversation ORDER BY last DESC LIMIT -1 OFFSET :keep));

-- name: conversations_over_bytes
UPDATE tasks SET conversation = NULL WHERE conversation IS NOT NULL AND (owner, conversation) IN (
    SELECT owner, conversation FROM (
        SELECT owner, conversation, sum(size) OVER (ORDER BY last DESC) AS running FROM (
            SELECT owner, conversation, max(id) AS last,
                   sum(length(request) + coalesce(length(response), 0)) AS size
            FROM tasks WHERE conversation IS NOT NULL GROUP BY owner, conversation))
    WHERE running > :budget);

-- name: cancel_task
-- docs/lmsp.md §7.3: a queued task is cancelled at once, a started one goes to cancelling.
UPDATE tasks SET status = :to, updated_at = :now,
                 response = coalesce(:response, response),
                 finished_at = CASE WHEN :to IN {TERMINAL} THEN :now ELSE finished_at END
WHERE id = :id AND status = :from;

-- name: echo_lookup
SELECT key, item FROM reasoning_echo WHERE owner = :owner AND key IN (SELECT value FROM json_each(:keys));

-- name: echo_put
INSERT INTO reasoning_echo (owner, key, item, size, used_at)
VALUES (:owner, :key, :item, length(:item), (SELECT coalesce(max(used_at), 0) + 1 FROM reasoning_echo))
ON CONFLICT (owner, key) DO UPDATE SET item = excluded.item, size = excluded.size, used_at = excluded.used_at;

-- name: echo_touch
UPDATE reasoning_echo SET used_at = (SELECT max(used_at) + 1 FROM reasoning_echo)
WHERE owner = :owner AND key = :key;

-- name: echo_bytes
SELECT total FROM reasoning_echo_bytes;

-- name: echo_oldest
-- Least recently used first; the caller stops reading once enough is freed.
SELECT owner, key, size FROM reasoning_echo ORDER BY used_at;

-- name: echo_delete
DELETE FROM reasoning_echo WHERE owner = :owner AND key = :key;

-- name: item_put
-- The latest response to carry an id holds it (clients resend their own message ids each turn).
INSERT INTO response_items (owner, item_id, task_id) VALUES (:owner, :item_id, :task_id)
ON CONFLICT (owner, item_id) DO UPDATE SET task_id = excluded.task_id;

-- name: item_task
SELECT t.* FROM response_items i JOIN tasks t ON t.id = i.task_id
WHERE i.owner = :owner AND i.item_id = :item_id;

-- Claims by model and prompt cache (SPEC §15; docs/operations.md, "Several nodes"). A node claims
-- a queued task only if it serves the task's model, and a task whose prompt cache another live
-- node holds waits for that node for one heartbeat before any other takes it.

ALTER TABLE tasks ADD COLUMN model text;             -- the model asked for (NULL: tasks from before)
ALTER TABLE tasks ADD COLUMN cache_key text;         -- its prompt_cache_key
ALTER TABLE tasks ADD COLUMN affinity text;          -- the node holding its prompt cache at intake
ALTER TABLE tasks ADD COLUMN queued_at double precision;  -- when it last became queued (database clock)

CREATE INDEX tasks_by_cache_key ON tasks (owner, cache_key, id) WHERE cache_key IS NOT NULL;

-- The rule, in one place (queued_ids and claim in queries_pg.sql both ask it). ``me`` NULL: a
-- store that is no node's (tools, tests) takes any task. Otherwise the model must be one this
-- node's lease row lists, or one no live node lists (then whoever claims it resolves it, as on
-- one node: nothing waits for a node that may never come); and a task with an affinity to
-- another node, live and serving its model, waits ``hold`` seconds after it was queued.
CREATE FUNCTION lmspd_claimable(t tasks, me text, hold double precision) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT me IS NULL OR (
        (t.model IS NULL
         OR EXISTS (SELECT 1 FROM nodes n WHERE n.id = me AND n.models @> jsonb_build_array(t.model))
         OR NOT EXISTS (SELECT 1 FROM nodes n
                        WHERE n.expires_at >= now() AND n.models @> jsonb_build_array(t.model)))
        AND (t.affinity IS NULL OR t.affinity = me
             OR t.queued_at <= extract(epoch FROM now()) - hold
             OR NOT EXISTS (SELECT 1 FROM nodes n
                            WHERE n.id = t.affinity AND n.expires_at >= now()
                              AND (t.model IS NULL OR n.models @> jsonb_build_array(t.model)))))
$$;

-- Resume snapshots live in the event log (each delta event carries its token ids), so the
-- tasks.generated column was never written: drop it.

ALTER TABLE tasks DROP COLUMN generated;

-- A response made with "conversation" joins that conversation's transcript.

ALTER TABLE tasks ADD COLUMN conversation TEXT;

CREATE INDEX tasks_by_conversation ON tasks (owner, conversation, id) WHERE conversation IS NOT NULL;

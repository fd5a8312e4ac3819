-- The reasoning echo: the reasoning item returned with an assistant turn, per owner, keyed
-- by the turn's content, so a later request that sends the turn back without it renders it
-- as generated. Bounded in bytes, least recently used first out.

CREATE TABLE reasoning_echo (
    owner   TEXT NOT NULL,                          -- token name; '' when auth is off
    key     TEXT NOT NULL,                          -- SHA-256 of the canonical assistant turn
    item    BLOB NOT NULL,                          -- the reasoning item, JSON
    size    INTEGER NOT NULL,                       -- length(item)
    used_at INTEGER NOT NULL,                       -- LRU clock: higher is more recent
    PRIMARY KEY (owner, key)
) WITHOUT ROWID;

CREATE INDEX reasoning_echo_by_use ON reasoning_echo (used_at);

-- The total size, kept by triggers in the same transactions, so the byte bound is checked
-- in O(1) however many items are kept.
CREATE TABLE reasoning_echo_bytes (
    id      INTEGER PRIMARY KEY CHECK (id = 0),
    total   INTEGER NOT NULL
);

INSERT INTO reasoning_echo_bytes (id, total) VALUES (0, 0);

CREATE TRIGGER reasoning_echo_insert AFTER INSERT ON reasoning_echo BEGIN
    UPDATE reasoning_echo_bytes SET total = total + NEW.size;
END;

CREATE TRIGGER reasoning_echo_update AFTER UPDATE OF size ON reasoning_echo BEGIN
    UPDATE reasoning_echo_bytes SET total = total - OLD.size + NEW.size;
END;

CREATE TRIGGER reasoning_echo_delete AFTER DELETE ON reasoning_echo BEGIN
    UPDATE reasoning_echo_bytes SET total = total - OLD.size;
END;

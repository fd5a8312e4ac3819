-- Secrets every node must share (SPEC §15): the reasoning key that seals `encrypted_content`
-- (responses/sealing.py). On SQLite it is a file in the data directory; here, a row, so a
-- reasoning item sealed on one node opens on any other. Made once: the first node's insert
-- wins, and every node reads the row back.

CREATE TABLE secrets (
    name  text PRIMARY KEY,
    value bytea NOT NULL
);

"""The durable store: SQLite through one ``db.Database`` (a writer thread, backoff on a full
disk), ``migrate`` (the numbered files of :mod:`lmspd.migrations`), ``queries.sql`` (named
queries, procrastinate's style), ``task_store`` (tasks and their event logs), ``status`` (the
task state machine), ``echo``, ``check`` and ``files`` (the data directory's modes: 0700 and
0600).

The only room that touches the database. Imports only the ground floor."""

"""PostgreSQL's migrations (``NNN_name.sql``), tracked in the table ``lmspd_schema``: package data."""

"""The numbered schema migrations (``NNN_name.sql``), applied in order by :mod:`lmspd.store.migrate`.

A package only so that ``importlib.resources`` finds the files, editable or installed."""

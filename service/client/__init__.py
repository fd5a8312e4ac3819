"""A client library for a running ``lmspd serve``: the LMSP task API over HTTP.

``http.TaskClient`` (typed requests; an event stream that resumes with ``Last-Event-ID``),
``sse`` (the event-stream parser), ``watch`` (the live view behind ``lmspd tasks watch``, whose
commands are :mod:`lmspd.cli.tasks`). Imports nothing of lmspd's but itself, and no MLX."""

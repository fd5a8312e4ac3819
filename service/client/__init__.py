"""A client of a running ``lmspd serve``: the LMSP task API over HTTP, behind ``lmspd tasks ...``.

``http.TaskClient`` (typed requests; an event stream that resumes with ``Last-Event-ID``),
``sse`` (the event-stream parser), ``watch`` (the live view), ``cli`` (the commands). Nothing
here imports MLX or the server; this module imports nothing so that ``lmspd`` starts fast."""

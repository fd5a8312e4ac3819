"""The engine: MLX in a process of its own. ``process`` (the server's handle: spawns the engine,
talks ``protocol`` to it, restarts it); ``worker`` (the engine's loop, whose ``Engine`` composes
the parts, each an object handed the others it uses): ``requests`` (every request taken, by
stage, and how each ends), ``admission`` (a request into the batch: sampling, grammars, the
prompt cache's hit, first tokens from ``prompt_ends`` without a pass), ``stepper`` (one step of
each batch: pacing, logprobs, prompts cached) and ``residency`` (which models are loaded);
``prompt_cache``, ``lifecycle`` (the memory budget, idle unload), ``loaded`` (per-request and
per-model state), ``weights``/``packed``/``kernels`` (lmspd's packed 4-bit CPU kernels, with
``upstream/decode_block`` for the decode step's attention) and ``blas``.
``upstream/`` holds every use of MLX's or mlx-lm's internals.

May import :mod:`lmspd.models` and the ground floor. The server process imports only
``process`` and ``protocol``; MLX is loaded in the engine process alone."""

"""The model's output text, parsed as it streams: ``output_parser`` (messages, reasoning, tool
calls), ``call_formats`` (the tool-call formats lmspd knows, one scanner each) and
``qwen3_coder_call``. mlx-lm's own parsers are reached through :mod:`lmspd.engine.upstream`."""

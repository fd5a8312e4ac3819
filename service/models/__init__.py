"""Models: the built-in ``catalog``, the ``registry`` that resolves a request's model name to a
directory, ``pull`` and ``gguf`` (the built-in model, converted once from its GGUF), ``slots``
(which models may be resident) and the ``tokenizer`` (chat templates, incremental detokenizing).

May import :mod:`lmspd.store` and the ground floor; loads no MLX."""

"""Every use of MLX's and mlx-lm's internals, in one place (``README.md`` here lists each
private name and the versions checked): ``lean`` (importing mlx-lm without transformers),
``parsers`` (mlx-lm's tool parsers without MLX), ``cache`` (the prompt-cache trie), ``blas``
(OpenBLAS symbols), ``stepping`` and ``logsumexp`` (mlx-lm's decode step), ``batch_cache`` and
``prompt_batch`` (how mlx-lm's batches take prompts in), ``decode_block``
(mlx-lm's Llama attention at decode, in lmspd's kernels). An mlx-lm upgrade is checked here first.

Imports nothing of lmspd's; importing this package loads no MLX."""

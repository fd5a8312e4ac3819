"""What each process loads: the engine imports mlx-lm without transformers or huggingface_hub
and keeps no freed buffers on the CPU; the server process loads neither MLX nor NumPy."""

from __future__ import annotations

import subprocess
import sys

from lmspd.models.registry import ResolvedModel

SCRIPT = """
import sys
from lmspd.engine.upstream.lean import import_mlx_lm
assert import_mlx_lm() is True
assert "transformers" not in sys.modules, "transformers was imported"
assert "huggingface_hub" not in sys.modules, "huggingface_hub was imported"
from mlx_lm.generate import BatchGenerator
from mlx_lm.utils import load_model
import mlx.core as mx
from pathlib import Path
model, _ = load_model(Path(sys.argv[1]))
batch = BatchGenerator(model, completion_batch_size=2)
batch.insert([[1, 2, 3], [4, 5]], max_tokens=[3, 3])
produced = 0
while produced < 6:
    produced += len(batch.next()[1])
batch.close()
assert "transformers" not in sys.modules and "huggingface_hub" not in sys.modules
import transformers  # the placeholders are gone: this is the real package
assert hasattr(transformers, "PreTrainedTokenizerFast") and transformers.__file__
import huggingface_hub
assert hasattr(huggingface_hub, "HfApi") and huggingface_hub.__file__
print("ok")
"""


def run_python(script: str, *args: str) -> str:
    """Run ``script`` in a fresh interpreter (what a process loads is the point); its stdout."""
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_engine_imports_mlx_lm_without_transformers(tiny: ResolvedModel) -> None:
    assert run_python(SCRIPT, str(tiny.path)).strip() == "ok"


def test_a_process_that_has_transformers_imports_as_usual() -> None:
    script = (
        "import transformers\nfrom lmspd.engine.upstream.lean import import_mlx_lm\nassert import_mlx_lm() is False\n"
    )
    run_python(script)


def test_a_process_that_has_huggingface_hub_keeps_it() -> None:
    script = (
        "import huggingface_hub, sys\n"
        "from lmspd.engine.upstream.lean import import_mlx_lm\n"
        "assert import_mlx_lm() is True\n"
        "import mlx_lm.utils\n"
        "assert mlx_lm.utils.snapshot_download is huggingface_hub.snapshot_download\n"
    )
    run_python(script)


def test_the_cpu_engine_keeps_a_bounded_few_freed_buffers() -> None:
    script = (
        "import mlx.core as mx\n"
        "from lmspd.engine.loaded import BUFFER_CACHE_BYTES, bound_buffer_cache\n"
        "bound_buffer_cache()\n"
        "for n in (1, 8, 64):  # freed buffers of 4 MB to 256 MB\n"
        "    mx.eval(mx.ones((n, 1024, 1024)) * 2)\n"
        "    assert mx.get_cache_memory() <= BUFFER_CACHE_BYTES, mx.get_cache_memory()\n"
        "mx.eval(mx.ones((1024, 1024)) * 2)\n"
        "assert mx.get_cache_memory() > 0  # small ones are kept for reuse\n"
    )
    run_python(script)


def test_the_server_process_loads_neither_mlx_nor_numpy() -> None:
    script = (
        "import sys\n"
        "from lmspd.config import load_config\n"
        "from lmspd.api.app import create_app\n"
        "create_app(load_config())\n"
        "import lmspd.engine.worker, lmspd.prompting.grammar\n"
        "loaded = [m for m in ('mlx.core', 'numpy', 'transformers') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    run_python(script)

"""lmspd: a local MLX model server (the OpenAI Responses API and LMSP durable tasks)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("lmspd")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

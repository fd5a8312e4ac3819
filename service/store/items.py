"""The item index: which stored response holds an item id, per owner (``item_reference``).

Written by a job that rides in the transaction finishing a stored response (as the reasoning
echo's does), so indexing costs no commit of its own; rows go with their task.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lmspd.store.conn import Conn
from lmspd.store.db import Database
from lmspd.store.task_store import TaskRecord


class ItemIndex:
    def __init__(self, db: Database) -> None:
        self.db = db

    def job(self, owner: str, task_id: str, item_ids: Sequence[str]) -> Callable[[Conn], None]:
        rows = [{"owner": owner, "item_id": item_id, "task_id": task_id} for item_id in dict.fromkeys(item_ids)]

        def run(conn: Conn) -> None:
            conn.run_many("item_put", rows)

        return run

    async def task_of(self, owner: str, item_id: str) -> TaskRecord | None:
        """The owner's task whose response holds ``item_id``, if any."""
        row = await self.db.one("item_task", {"owner": owner, "item_id": item_id})
        return None if row is None else TaskRecord.from_row(row)

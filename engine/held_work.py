"""Work on a thread of its own over memory it holds while it runs: the KV pool faulting in (pool_memory.py), the
weights moving into huge pages (huge_pages.py). Both start as an engine becomes ready and may still run when it
stops (a model unloaded), and both once kept an unloaded model's memory that way: the thread faulted in, or
collapsed, memory nothing used any more (bench/unload_memory.py kept 0.45-1.2 GB after an unload). So stop() ends
the work between items and waits for the thread, and the thread lets go of every item once it ends.
"""
from __future__ import annotations

import threading


class HeldWork:
    """Runs self.work(items) on a thread named `name`; work() takes items off the list it is given (the thread's
    only hold on them) and returns early once self.stopping."""

    def __init__(self, items: list, name: str) -> None:
        self._ended = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(list(items),), name=name, daemon=True)
        self._thread.start()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def is_set(self) -> bool:
        """Whether the work has ended (done, or stopped)."""
        return self._ended.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the work has ended (done, or stopped); True once it has."""
        return self._ended.wait(timeout_s)

    def stop(self, timeout_s: float = 30) -> None:
        self._stopping.set()
        self._thread.join(timeout_s)

    def work(self, items: list) -> None:
        raise NotImplementedError

    def _run(self, items: list) -> None:
        try:
            self.work(items)
        finally:
            items.clear()  # the thread holds none of them once it ends
            self._ended.set()

"""The event loop a python model's coroutines run on (``async def execute``/``initialize``).

One loop per worker, for the worker's whole life, on a thread of its own, as Triton's stub keeps
one: a task the model starts (a response sent after a delay) outlives the execute() that
started it, and a decoupled model's executions run concurrently on it, each answering through
its response senders while the worker takes the next batch (Triton's async_execute test: four
2 s requests on one instance answer after 2 s, not 8).
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any, Callable, Coroutine

# how long close() waits for the loop's thread to end
CLOSE_S = 5.0


class ModelLoop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="model event loop", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine) -> Any:
        """Run ``coro`` on the loop and wait for its result (or its exception)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def start(self, coro: Coroutine, done: Callable[[Future], None]) -> None:
        """Run ``coro`` on the loop without waiting; ``done(future)`` once it has ended."""
        asyncio.run_coroutine_threadsafe(coro, self.loop).add_done_callback(done)

    def close(self) -> None:
        """Cancel what still runs and end the loop's thread."""
        def stop() -> None:
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            self.loop.stop()
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(stop)
        self.thread.join(CLOSE_S)
        if not self.thread.is_alive():
            self.loop.close()

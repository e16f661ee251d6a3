"""The engine loop: ONE worker thread runs every model call of a service. gRPC handlers never
touch the model; they hand work to a batcher (or submit a one-off item such as loading the
weights) and await an asyncio future.

Between one-off items, the thread asks the batcher to run one batched step whenever it has
work: that step takes the pending steps of all sessions and runs them as one forward. torch
releases the GIL inside kernels, so the asyncio side stays responsive meanwhile."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

import structlog

log = structlog.get_logger(__name__)


class Batcher(Protocol):
    def has_work(self) -> bool: ...
    def step(self) -> None: ...


@dataclass
class WorkItem:
    kind: str
    fn: Callable
    future: asyncio.Future | None
    loop: asyncio.AbstractEventLoop | None


def settle(fut: asyncio.Future, result, error) -> None:
    """Give `fut` its result or error unless it is done already (on the future's own loop)."""
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result=None, error=None) -> None:
    """Complete `fut` from the engine thread (no-op if it is done or its event loop is gone)."""
    try:
        loop.call_soon_threadsafe(settle, fut, result, error)
    except RuntimeError:
        pass            # the event loop has closed (shutdown); nobody is waiting


class Deliveries:
    """The results of one batched step, handed to their event loops with ONE wake-up per loop:
    with 16 sessions in a forward, 16 separate wake-ups cost the server more than the forward
    saves."""

    def __init__(self):
        self._calls: dict[asyncio.AbstractEventLoop, list] = {}

    def resolve(self, loop, fut: asyncio.Future, result=None, error=None) -> None:
        self._calls.setdefault(loop, []).append((settle, fut, result, error))

    def put(self, loop, q: asyncio.Queue, item) -> None:
        self._calls.setdefault(loop, []).append((q.put_nowait, item))

    def flush(self) -> None:
        for loop, calls in self._calls.items():
            try:
                loop.call_soon_threadsafe(_run_all, calls)
            except RuntimeError:
                pass
        self._calls = {}


def _run_all(calls) -> None:
    for fn, *args in calls:
        fn(*args)


class EngineLoop:
    def __init__(self, name: str = "engine-loop"):
        self._items: deque[WorkItem] = deque()
        self._cv = threading.Condition()
        self._batcher: Batcher | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def attach(self, batcher: Batcher) -> None:
        with self._cv:
            self._batcher = batcher
            self._cv.notify()

    def wake(self) -> None:
        """The batcher has new work."""
        with self._cv:
            self._cv.notify()

    def submit(self, kind: str, fn: Callable) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._put(WorkItem(kind, fn, fut, loop))
        return fut

    def post(self, kind: str, fn: Callable) -> None:
        """Fire and forget."""
        self._put(WorkItem(kind, fn, None, None))

    def _put(self, item: WorkItem) -> None:
        with self._cv:
            self._items.append(item)
            self._cv.notify()

    def stop(self, timeout: float | None = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    def _has_batch(self) -> bool:
        return self._batcher is not None and self._batcher.has_work()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._stopping or self._items or self._has_batch()):
                    self._cv.wait()
                if self._stopping:
                    return
                item = self._items.popleft() if self._items else None
            if item is None:
                try:
                    self._batcher.step()
                except Exception:  # noqa: BLE001 - a bug in one step must not stop the service's engine
                    log.exception("engine_step_failed")
                    time.sleep(0.01)
                continue
            if item.future is not None and item.future.cancelled():
                continue
            try:
                result, error = item.fn(), None
            except BaseException as exc:  # noqa: BLE001 - delivered to the awaiting handler
                result, error = None, exc
            if item.future is not None:
                resolve(item.loop, item.future, result, error)

"""The listeners of something that changes on several threads (the life-cycle state, the start-up timeline).

The owner keeps its own lock for its state; it takes `snapshot()` while holding it, so that the listeners it
calls are the ones subscribed when the change happened, and calls them after releasing it (a listener may read the
state again). This lock guards only the list and never waits on another one, so taking it under the owner's lock
cannot deadlock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

Listener = TypeVar("Listener", bound=Callable[..., Any])


class Subscribers(Generic[Listener]):
    """`subscribe(listener)` returns the function that unsubscribes it; `snapshot()` lists those subscribed now."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            # Idempotent: a second call (or one after the owner dropped the listener) does nothing.
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    def snapshot(self) -> tuple[Listener, ...]:
        with self._lock:
            return tuple(self._listeners)

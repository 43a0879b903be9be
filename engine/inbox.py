"""Inbox: what other threads hand the engine thread (requests to admit, requests to abort, an order to end them all,
a failure to inject) and whether it runs, under the one condition variable the engine thread sleeps on while it
has nothing to do. Callers never touch the scheduler, the KV cache or the model; they only leave mail here."""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.errors import DrainingError, QueueFullError
from engine.request import Request
from engine.stream import RequestStream


@dataclass
class Mail:
    arrivals: list[tuple[Request, RequestStream]]
    aborts: list[str]
    abort_all: bool


class Inbox:
    def __init__(self, max_waiting: int) -> None:
        self.lock = threading.Condition()
        self._max_waiting = max_waiting
        self._arrivals: deque[tuple[Request, RequestStream]] = deque()
        self._aborts: deque[str] = deque()
        self._is_aborting_all = False  # abort_all() asked; the engine thread ends every request at its next turn
        self._injected_failure: Exception | None = None
        self.is_running = False  # the loop takes mail; False before start() and after stop()
        self.is_stopped = False
        self.is_draining = False  # drain(): put() refuses from now on

    # Any thread.
    def put(self, request: Request, stream: RequestStream, num_waiting: int) -> None:
        """Queue a request for admission, unless the engine drains or `num_waiting` (the scheduler's) and the
        arrivals not yet admitted reach max_waiting."""
        with self.lock:
            if self.is_draining:
                raise DrainingError("the engine is shutting down and takes no new requests")
            if len(self._arrivals) + num_waiting >= self._max_waiting:
                raise QueueFullError("too many requests are waiting; retry shortly")
            self._arrivals.append((request, stream))
            self.lock.notify()

    @property
    def num_arrivals(self) -> int:
        return len(self._arrivals)

    def abort(self, request_id: str) -> None:
        with self.lock:
            self._aborts.append(request_id)
            self.lock.notify_all()

    def abort_all(self) -> None:
        with self.lock:
            self._is_aborting_all = True
            self.lock.notify_all()

    def fail_next_step(self, exc: Exception) -> None:
        with self.lock:
            self._injected_failure = exc

    def drain(self) -> None:
        with self.lock:
            self.is_draining = True

    def set_running(self, is_running: bool) -> None:
        """start() (True) or stop() (False): the engine thread wakes up either way."""
        with self.lock:
            self.is_running, self.is_stopped = is_running, not is_running
            self.lock.notify_all()

    def wake(self) -> None:
        """Have the engine thread look at its work again (something outside the inbox has changed)."""
        with self.lock:
            self.lock.notify_all()

    # Engine thread.
    def wait_for_start(self) -> bool:
        """Block until start() or stop(); True when started."""
        with self.lock:
            while not (self.is_running or self.is_stopped):
                self.lock.wait()
            return self.is_running

    def take(self, has_work: Callable[[], bool], admit: Callable[[Request, RequestStream], None]) -> Mail | None:
        """Block until there is mail or `has_work()` (asked under the lock, after every wake-up); admit the arrivals
        under the lock, so that one in transit is always either here or admitted. None once stopped."""
        with self.lock:
            while self.is_running and not (self._arrivals or self._aborts or self._is_aborting_all or has_work()):
                self.lock.wait()
            if not self.is_running:
                return None
            mail = Mail(list(self._arrivals), list(self._aborts), self._is_aborting_all)
            self._arrivals.clear()
            self._aborts.clear()
            self._is_aborting_all = False
            for request, stream in mail.arrivals:
                admit(request, stream)
            return mail

    def raise_injected_failure(self) -> None:
        """Raise what fail_next_step() left, once (for tests: a model step failing as a kernel bug would)."""
        if self._injected_failure is not None:
            with self.lock:
                failure, self._injected_failure = self._injected_failure, None
            raise failure

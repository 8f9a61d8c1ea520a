"""Supervised long-running tasks of the node daemon, so none dies silently.

`Supervisor.spawn(name, run)` runs the coroutine function `run` as a task; when it raises,
the exception is logged and counted (``hearthnet_task_failures_total{task}``) and `run` is
started again after an exponential backoff (``min_backoff_s`` doubling to
``max_backoff_s``). A task that returns is done (one-shot tasks pass ``restart=False``).
`health()` reports every task: ``running``, ``failing`` (it failed within the last
``failing_window_s``), ``done`` or ``dead`` (cancelled from outside or a bug in the
supervisor itself); the node's ``/health`` is unhealthy while any task is failing or dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from hearthnet.background import cancel_and_wait
from hearthnet.observability import Metrics, get_logger

log = get_logger("node.supervise")


@dataclass
class TaskState:
    """What the supervisor knows of one task."""

    name: str
    restart: bool
    state: str = "running"
    failures: int = 0
    last_error: str = ""
    last_failure_at: float = 0.0


class Supervisor:
    """Runs, restarts and reports the node's long-running tasks; see the module docstring."""

    def __init__(self, metrics: Metrics, *, min_backoff_s: float = 0.5,
                 max_backoff_s: float = 30.0, failing_window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.min_backoff_s, self.max_backoff_s = min_backoff_s, max_backoff_s
        self.failing_window_s = failing_window_s
        self.clock = clock
        self.tasks: dict[str, TaskState] = {}
        self._handles: dict[str, asyncio.Task[None]] = {}

    def spawn(self, name: str, run: Callable[[], Awaitable[Any]], *,
              restart: bool = True) -> asyncio.Task[None]:
        """Start `run` under supervision as task `name`."""
        st = self.tasks[name] = TaskState(name, restart)
        task = asyncio.create_task(self._supervise(st, run), name=name)
        task.add_done_callback(lambda t: self._ended(st, t))
        self._handles[name] = task
        return task

    async def _supervise(self, st: TaskState, run: Callable[[], Awaitable[Any]]) -> None:
        delay = self.min_backoff_s
        while True:
            st.state = "running"
            try:
                await run()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a task's failure is logged, counted and retried
                self._failed(st, e, delay)
                if not st.restart:
                    st.state = "dead"
                    return
                await asyncio.sleep(delay)
                delay = min(self.max_backoff_s, delay * 2)
                continue
            st.state = "done"
            return

    def _failed(self, st: TaskState, e: Exception, delay: float) -> None:
        st.failures += 1
        st.state = "failing"
        st.last_error = f"{type(e).__name__}: {e}"[:300]
        st.last_failure_at = self.clock()
        self.metrics.task_failures_total.labels(st.name).inc()
        with contextlib.suppress(Exception):  # logging itself may fail (a full disk)
            log.error("task_failed", task=st.name, error=st.last_error,
                      failures=st.failures, restart_in_s=round(delay, 2) if st.restart else None)

    def _ended(self, st: TaskState, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            st.state = "stopped" if st.state != "dead" else st.state
        elif task.exception() is not None:  # the supervisor's own bug: never silent
            st.state = "dead"
            st.last_error = repr(task.exception())[:300]

    def health(self) -> dict[str, dict[str, Any]]:
        """Per task: state (running | failing | done | dead | stopped), failures, last error."""
        now = self.clock()
        out: dict[str, dict[str, Any]] = {}
        for st in self.tasks.values():
            state = st.state
            if state == "running" and st.failures and \
                    now - st.last_failure_at < self.failing_window_s:
                state = "failing"
            out[st.name] = {"state": state, "failures": st.failures,
                            "last_error": st.last_error}
        return out

    def healthy(self) -> bool:
        """False while a task is failing or dead."""
        return all(t["state"] not in ("failing", "dead") for t in self.health().values())

    async def stop(self, timeout_s: float = 5.0) -> list[str]:
        """Cancel every task and wait up to `timeout_s` for them; returns (and logs) the
        names of those still running — a task that swallowed its cancellation must not keep
        the node from exiting (shutdown is bounded by the drain timeout)."""
        stuck = await cancel_and_wait(self._handles.values(), timeout_s)
        names = [t.get_name() for t in stuck]
        if names:
            log.warning("tasks_ignored_stop", tasks=names, waited_s=timeout_s)
        return names

"""Processes a test starts (a `hearthnet demo`, a launcher) and the nodes they leave.

`alive` tells a running process from a gone or zombie one; `interrupt` stops a command as
Ctrl-C would and collects its output; `wait_all_gone` waits (on state, issue 10 §7) until
every listed process has exited.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterable
from pathlib import Path

from tests.helpers.waiting import wait_for


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie is not running)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


INTERRUPTIBLE = {"preexec_fn": _default_sigint}
"""`subprocess.Popen` keywords for a command a test stops with Ctrl-C (`interrupt`): SIGINT
at its default in the child, as in a terminal's foreground, whatever this process inherited —
a suite started in the background by a non-interactive shell (`make test &`) ignores SIGINT,
and a Python started with it ignored never turns it into KeyboardInterrupt."""


def interrupt(p: subprocess.Popen[str], timeout: float = 120.0) -> tuple[str, str]:
    """SIGINT `p` (Ctrl-C) and return its (stdout, stderr); killed if it outlives
    `timeout`, so no test leaves it behind."""
    try:
        state = _signal_state(p.pid)
        p.send_signal(signal.SIGINT)
        try:
            return p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"{p.args} outlived SIGINT by {timeout} s; its signal "
                                 f"state when sent: {state}") from e
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _signal_state(pid: int) -> str:
    """The ignored, blocked and caught signal masks of `pid` (what a Ctrl-C meets)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return "gone"
    return ", ".join(ln.replace("\t", " ") for ln in lines
                     if ln.startswith(("SigBlk", "SigIgn", "SigCgt", "State")))


def wait_all_gone(pids: Iterable[int], what: str, timeout: float = 30.0) -> None:
    """Wait until none of `pids` runs; `TimeoutError` naming `what` and the survivors."""
    pids = list(pids)
    try:
        wait_for(lambda: not any(alive(x) for x in pids), what, timeout=timeout)
    except TimeoutError as e:
        raise TimeoutError(f"{e}: still running {[x for x in pids if alive(x)]}") from None

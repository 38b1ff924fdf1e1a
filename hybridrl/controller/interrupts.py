"""SIGINT / SIGTERM of the driver as an `Interrupted` raised where the driver waits on its workers.

Why not raise from the signal handler: the driver spends its time inside `ray.get`, and an exception raised
by a handler there comes out as a SystemError ("GetTimeoutError returned a result with an exception set")
that polling code takes for a timeout. Ray's `init` also replaces the SIGTERM handler with `sys.exit(15)`,
which tears the process down mid-call (exit 134 and a C++ stack dump). So `stop_on_signals()`'s handler (put back over
Ray's once Ray is up) only records the signal; the controller's wait loop (`raise_if_requested`, every 0.5 s) raises
it. The same stop often arrives twice within milliseconds (Slurm signals every process of the job, and the
batch script forwards its own copy to the trainer; a group signal and a supervisor's): a repeat within
REPEAT_WINDOW_S of the first is that same stop and is ignored (before, it killed the driver before its one
line). A signal after that gets the default behaviour, so a stuck shutdown can still be forced.

The handler stays ours until the run's last line: `hybridrl train` enters `stop_on_signals()` before Ray starts,
puts it back with `rearm()` once Ray's init has replaced it, and closes its workers inside it, so a copy of the stop
that comes while the workers close is still recognised as the same stop (under Ray's handler it was a
sys.exit(15) before the one line).

`stop_on_signals(defer_s=S)` (trainer.save_on_signal) holds the signal back for up to S seconds: the wait loop
lets the calls in flight finish, and the trainer, between steps, sees `pending()` and saves one more checkpoint
before it raises; past S seconds the loop raises wherever it is (the scheduler's SIGKILL follows soon).
"""
from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager
from typing import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)
REPEAT_WINDOW_S = 2.0  # a signal this soon after the first is the same stop delivered twice
_requested: list[tuple[int, float]] = []  # the signal received and not yet raised, and when
_first_at: list[float] = []  # when this run's first signal came (kept after it is raised)
_defer_s: list[float] = []  # while set: how long a received signal may wait for the step and its save
_handler: list = []  # while stop_on_signals is entered: its signal handler


class Interrupted(BaseException):
    """The driver got SIGINT or SIGTERM; `exit_code` is the shell's 128 + signal number. A BaseException, like
    KeyboardInterrupt, so the `except Exception` of code it interrupts passes it on."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.exit_code = 128 + signum
        super().__init__(self.name)


def raise_if_requested() -> None:
    """Raise a received signal, unless it is deferred (save_on_signal) and its time is not up yet."""
    if _requested and (not _defer_s or time.monotonic() - _requested[-1][1] >= _defer_s[0]):
        raise Interrupted(_requested.pop()[0])


def pending() -> Interrupted | None:
    """A deferred signal not raised yet (the trainer saves, then raises it), else None."""
    return Interrupted(_requested[-1][0]) if _requested else None


def seconds_left() -> float:
    """Of a deferred signal's time: what remains (inf when no signal is waiting or none is deferred)."""
    if not (_requested and _defer_s):
        return float("inf")
    return _defer_s[0] - (time.monotonic() - _requested[-1][1])


def raise_pending() -> None:
    if _requested:
        raise Interrupted(_requested.pop()[0])


@contextmanager
def stop_on_signals(defer_s: float | None = None) -> Iterator[None]:
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}

    def on_signal(signum, frame):
        now = time.monotonic()
        if _first_at and now - _first_at[0] < REPEAT_WINDOW_S:
            return  # the same stop, delivered twice
        if _first_at:  # a later one forces a hung shutdown: what the signal does by default
            for sig in SIGNALS:
                signal.signal(sig, signal.SIG_DFL if sig == signal.SIGTERM else signal.default_int_handler)
            if signum == signal.SIGINT:
                signal.default_int_handler(signum, frame)
            os.kill(os.getpid(), signum)
            return
        _first_at.append(now)
        _requested.append((signum, now))

    _handler.append(on_signal)
    rearm()
    if defer_s is not None:
        _defer_s.append(max(0.0, defer_s))
    try:
        yield  # a signal not raised by the end stays unraised: the caller says where its run may still stop
    finally:
        _requested.clear()
        _defer_s.clear()
        _first_at.clear()
        _handler.clear()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def rearm() -> None:
    """Inside `stop_on_signals`: make its handler current again (Ray's init installs a SIGTERM handler of its own,
    `sys.exit(15)`, over whatever was there)."""
    for sig in SIGNALS:
        signal.signal(sig, _handler[0])

"""SIGINT / SIGTERM of the driver as an `Interrupted` raised where the driver waits on its workers.

Why not raise from the signal handler: the driver spends its time inside `ray.get`, and an exception raised
by a handler there comes out as a SystemError ("GetTimeoutError returned a result with an exception set")
that polling code takes for a timeout. Ray's `init` also replaces the SIGTERM handler with `sys.exit(15)`,
which tears the process down mid-call (exit 134 and a C++ stack dump). So `stop_on_signals()`, entered after
Ray is up, only records the signal; the controller's wait loop (`raise_if_requested`, every 0.5 s) raises
it. A second signal gets the default behaviour, so a stuck shutdown can still be forced.
"""
from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_requested: list[int] = []  # the signal received and not yet raised


class Interrupted(BaseException):
    """The driver got SIGINT or SIGTERM; `exit_code` is the shell's 128 + signal number. A BaseException, like
    KeyboardInterrupt, so the `except Exception` of code it interrupts passes it on."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.exit_code = 128 + signum
        super().__init__(self.name)


def raise_if_requested() -> None:
    if _requested:
        raise Interrupted(_requested.pop())


@contextmanager
def stop_on_signals() -> Iterator[None]:
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}

    def on_signal(signum, _frame):
        for sig in SIGNALS:  # the next one is not caught: a hung shutdown can be forced
            signal.signal(sig, signal.SIG_DFL if sig == signal.SIGTERM else signal.default_int_handler)
        _requested.append(signum)

    for sig in SIGNALS:
        signal.signal(sig, on_signal)
    try:
        yield
        raise_if_requested()  # a signal during the last step's bookkeeping
    finally:
        _requested.clear()
        for sig, handler in previous.items():
            signal.signal(sig, handler)

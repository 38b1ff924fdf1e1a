"""SIGINT / SIGTERM of the driver as an exception, so a run stops cleanly instead of dying in a traceback.

Ray's `init` replaces the driver's SIGTERM handler with `sys.exit(15)`, which tears the process down mid-call
(exit 134 and a C++ stack dump). `stop_on_signals()` is entered after Ray is up: the first SIGINT or SIGTERM
raises `Interrupted` in the main thread (out of whatever `ray.get` it waits in), the caller closes the
workers and reports; a second signal while closing gets the default behaviour, so a stuck shutdown can
still be forced.
"""
from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """The driver got SIGINT or SIGTERM; `exit_code` is the shell's 128 + signal number. A BaseException, like
    KeyboardInterrupt, so the `except Exception` of code it interrupts (polling loops, cleanup) passes it on."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.exit_code = 128 + signum
        super().__init__(self.name)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}

    def on_signal(signum, _frame):
        for sig in SIGNALS:  # the next one is not caught: a hung shutdown can be forced
            signal.signal(sig, signal.SIG_DFL if sig == signal.SIGTERM else signal.default_int_handler)
        raise Interrupted(signum)

    for sig in SIGNALS:
        signal.signal(sig, on_signal)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

"""One `hybridrl train` per run folder: an exclusive lock on RUN/.lock, held while the process lives.

Two runs writing the same metrics.jsonl and ckpt/ would interleave records and prune each other's
checkpoints. The lock is an OS file lock (fcntl.flock), so it is released when the holder exits, however it
exits (SIGKILL included): there is no stale lock to clean up. The file records the holder's host and pid for
the message. On a shared filesystem without flock support the lock is skipped with a warning.
"""
from __future__ import annotations

import fcntl
import logging
import os
import socket
from pathlib import Path
from typing import IO

from hybridrl.config import ConfigError, MachineError

logger = logging.getLogger(__name__)

LOCK_FILE = ".lock"
_held: list[IO] = []  # open lock files of this process: closing one would release its lock


def lock_run_dir(run_dir: str | Path) -> None:
    path = Path(run_dir) / LOCK_FILE
    try:
        handle = open(path, "a+")
    except OSError as exc:
        raise MachineError.writing(path, exc) from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ConfigError(f"trainer.run_dir={run_dir} is in use by a running hybridrl train ({holder}); wait for it "
                          f"to finish or choose another trainer.run_dir") from None
    except OSError as exc:  # e.g. a filesystem without flock
        logger.warning("could not lock %s (%s); make sure no other run uses this folder", path, exc)
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"host {socket.gethostname()} pid {os.getpid()}\n")
        handle.flush()
    except OSError as exc:  # a full disk, found before any worker starts
        try:
            handle.close()  # flushes what the disk refused once more
        except OSError:
            pass
        raise MachineError.writing(path, exc) from None
    _held.append(handle)

"""Hung calls: a group call whose ranks make no progress is stopped long before call_timeout_s.

A rank stuck in a collective (a peer that stopped, a wedged device) never fails on its own; the call would
wait for call_timeout_s (15 min by default) and the gloo/NCCL timeout (10 min). The driver's `WATCHDOG`
gives each call a limit scaled to what the run has seen: max(trainer.hang_timeout_s, 10 x the slowest
finished call of the same method, 3 x the slowest call of any method), so a slow first step of a big model
is not taken for a hang once a step has been timed. Past the limit it dumps every rank's Python stack
(`py-spy dump --nonblocking`, which also reads a stopped process) into the run folder and the call raises
`WorkerHungError`, a WorkerDiedError: the trainer recovers as from a dead worker (pool killed, roles
restarted from the last checkpoint, up to trainer.max_restarts).
"""
from __future__ import annotations

import logging
import shutil
import subprocess
import time
from pathlib import Path

logger = logging.getLogger(__name__)

SAME_METHOD_FACTOR = 10.0
ANY_METHOD_FACTOR = 3.0


class HangWatchdog:
    def __init__(self) -> None:
        self.timeout_s: float | None = None  # None / 0: off (only call_timeout_s applies)
        self.dump_dir: Path | None = None
        self.slowest: dict[str, float] = {}

    def configure(self, timeout_s: float | None, dump_dir: str | Path | None) -> None:
        self.timeout_s = timeout_s or None
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        self.slowest = {}

    def limit(self, key: str) -> float | None:
        """Seconds a call of `key` ("role.method") may take before it counts as hung."""
        if self.timeout_s is None:
            return None
        any_method = max(self.slowest.values(), default=0.0)
        return max(self.timeout_s, SAME_METHOD_FACTOR * self.slowest.get(key, 0.0), ANY_METHOD_FACTOR * any_method)

    def record(self, key: str, seconds: float) -> None:
        self.slowest[key] = max(seconds, self.slowest.get(key, 0.0))

    def dump_stacks(self, key: str, pids: dict[int, int]) -> Path | None:
        """Every rank's Python stack (rank -> pid on this node) into DUMP_DIR/hang-<key>-<time>.txt."""
        if self.dump_dir is None:
            return None
        path = self.dump_dir / f"hang-{key}-{time.strftime('%Y%m%d-%H%M%S')}.txt"
        spy = shutil.which("py-spy")
        parts = []
        for rank, pid in sorted(pids.items()):
            if spy is None:
                text = "py-spy not installed (pip install py-spy)"
            else:
                try:
                    done = subprocess.run([spy, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True,
                                          text=True, timeout=30)
                    text = done.stdout or done.stderr
                except (OSError, subprocess.TimeoutExpired) as exc:
                    text = f"py-spy failed: {exc}"
            parts.append(f"===== rank {rank} (pid {pid}) =====\n{text.rstrip()}\n")
        path.write_text("\n".join(parts))
        return path


WATCHDOG = HangWatchdog()  # one per driver: a driver runs one trainer

"""Fate-sharing for a local Ray cluster: when the driver dies (even by SIGKILL), its Ray processes go too.

Ray's workers follow a dead raylet within seconds, but its dashboard and runtime-env agents wait out a GCS
reconnect (about a minute), holding memory and ports. `start_reaper(pid)` launches this module as a small
process of its own session: every second it records the driver's descendants (pid + start time, so a reused
pid is never hit); once the driver is gone it kills those still running and exits.

    python -m hybridrl.controller.reaper DRIVER_PID
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

POLL_S = 1.0


def start_reaper(driver_pid: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hybridrl.controller.reaper", str(driver_pid)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # not in the driver's process group: Ctrl-C spares it


def reap(driver_pid: int) -> None:
    import psutil

    try:
        driver = psutil.Process(driver_pid)
    except psutil.NoSuchProcess:
        return
    seen: dict[int, float] = {}
    while driver.is_running() and driver.status() != psutil.STATUS_ZOMBIE:
        try:
            for child in driver.children(recursive=True):
                if child.pid != os.getpid():
                    seen.setdefault(child.pid, child.create_time())
        except psutil.Error:
            pass
        time.sleep(POLL_S)
    for pid, started in seen.items():
        try:
            process = psutil.Process(pid)
            if process.create_time() == started:
                process.kill()
        except psutil.Error:
            continue


if __name__ == "__main__":
    reap(int(sys.argv[1]))

"""Fate-sharing for a local Ray cluster: when the driver dies (even by SIGKILL), its Ray processes go too.

Ray's workers follow a dead raylet within seconds, but its dashboard and runtime-env agents wait out a GCS
reconnect (about a minute), holding memory and ports. `start_reaper(pid)` launches a small process of its own
session (plain Python + psutil, no hybridrl import: ~20 MB): every second it records the driver's descendants
(pid + start time, so a reused pid is never hit); once the driver is gone it kills those still running and
exits; then it removes the workers' temp folder. `stop_reaper()` ends it when the driver shuts its cluster down
itself.
"""
from __future__ import annotations

import subprocess
import sys

_SOURCE = r'''
import os, shutil, sys, time
import psutil
try:
    driver = psutil.Process(int(sys.argv[1]))
except psutil.NoSuchProcess:
    sys.exit(0)
seen = {}
while driver.is_running() and driver.status() != psutil.STATUS_ZOMBIE:
    try:
        for child in driver.children(recursive=True):
            if child.pid != os.getpid():
                seen.setdefault(child.pid, child.create_time())
    except psutil.Error:
        pass
    time.sleep(1.0)
killed = []
for pid, started in seen.items():
    try:
        process = psutil.Process(pid)
        if process.create_time() == started:
            process.kill()
            killed.append(process)
    except psutil.Error:
        pass
if len(sys.argv) > 2:  # the workers' temp folder, once its writers are gone
    psutil.wait_procs(killed, timeout=5)
    shutil.rmtree(sys.argv[2], ignore_errors=True)
'''
_running: list[subprocess.Popen] = []


def start_reaper(driver_pid: int, temp_dir: str | None = None) -> None:
    folder = [temp_dir] if temp_dir else []
    _running.append(subprocess.Popen([sys.executable, "-I", "-c", _SOURCE, str(driver_pid), *folder],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True))  # not in the driver's process group: Ctrl-C spares it


def reaper_pids() -> list[int]:
    return [reaper.pid for reaper in _running]


def stop_reaper() -> None:
    while _running:
        reaper = _running.pop()
        reaper.kill()
        reaper.wait()

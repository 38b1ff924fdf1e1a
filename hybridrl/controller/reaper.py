"""Fate-sharing for a local Ray cluster: when the driver dies (even by SIGKILL), its Ray processes go too.

Ray's workers follow a dead raylet within seconds, but its dashboard and runtime-env agents wait out a GCS
reconnect (about a minute), holding memory and ports. `start_reaper(pid)` launches a small process of its own
session (plain Python + psutil, no hybridrl import: ~20 MB): every second it records the driver's descendants
(pid + start time, so a reused pid is never hit); once the driver is gone it kills those still running and
exits. `stop_reaper()` ends it when the driver shuts its cluster down itself.
"""
from __future__ import annotations

import subprocess
import sys

_SOURCE = r'''
import os, sys, time
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
for pid, started in seen.items():
    try:
        process = psutil.Process(pid)
        if process.create_time() == started:
            process.kill()
    except psutil.Error:
        pass
'''
_running: list[subprocess.Popen] = []


def start_reaper(driver_pid: int) -> None:
    _running.append(subprocess.Popen([sys.executable, "-I", "-c", _SOURCE, str(driver_pid)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True))  # not in the driver's process group: Ctrl-C spares it


def stop_reaper() -> None:
    while _running:
        reaper = _running.pop()
        reaper.kill()
        reaper.wait()

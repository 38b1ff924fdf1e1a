"""What every tool sandbox shares: the limits, the result, the base class and its registry, and the parent's side of
a local sandbox (`run_process`: the deadline, the output cap, the whole process tree killed). The sandboxes
themselves are sandbox_bwrap.py, sandbox_remote.py and sandbox_guard.py; sandbox.py chooses among them.
"""
from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

from hybridrl.registry import Registry

SANDBOXES = Registry("tool sandbox", "@register_sandbox('name') on a Sandbox subclass")


class SandboxUnavailable(RuntimeError):
    """The chosen (or every automatic) sandbox cannot start on this machine; the message says why and what to do."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one call of tool code may use; the kernel (resource limits, a sized tmpfs) or the parent enforces each."""

    timeout_s: float = 5.0  # wall clock; the whole process tree is killed at the deadline
    memory_mb: int = 512  # address space of each process (RLIMIT_AS)
    file_mb: int = 16  # the largest file a process may write (RLIMIT_FSIZE)
    disk_mb: int = 64  # all files of the call together (the scratch tmpfs's size; bwrap)
    processes: int = 16  # processes and threads of the call (RLIMIT_NPROC; bwrap: counted for the sandbox alone)
    files: int = 4096  # files and folders in the scratch tmpfs (bwrap: the parent counts them, stops the call)
    max_output_bytes: int = 1 << 20  # stdout + stderr read from the call; more stops it

    @property
    def cpu_s(self) -> int:
        return max(1, int(self.timeout_s) + 1)


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None: killed for the time limit
    timed_out: bool
    output_limited: bool = False  # stopped for printing more than max_output_bytes
    stopped: str = ""  # another limit the parent stopped it for (e.g. "file count limit exceeded")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.output_limited and not self.stopped

    def observation(self, max_chars: int = 4000) -> str:
        """What the model sees: the output, or one line saying why the run stopped (then the output so far)."""
        stdout = self.stdout[:max_chars]
        if self.timed_out:
            return f"error: time limit exceeded\n{stdout}".rstrip()
        if self.output_limited:
            return f"error: output limit exceeded\n{stdout}".rstrip()
        if self.stopped:
            return f"error: {self.stopped}\n{stdout}".rstrip()
        if self.exit_code != 0:
            last = self.stderr.strip().splitlines()[-1] if self.stderr.strip() else f"exit code {self.exit_code}"
            if self.exit_code is not None and self.exit_code < 0:
                last = f"killed by signal {signal.Signals(-self.exit_code).name} (a resource limit)"
            return f"error: {last[:max_chars]}\n{stdout}".rstrip()
        return stdout


class Sandbox(ABC):
    """Runs Python source under SandboxLimits. `unavailable()` says why it cannot start here (None: it can)."""

    name = "?"

    def __init__(self, url: str | None = None) -> None:
        self.url = url  # where a remote sandbox is (rollout.tool_sandbox_url); local ones ignore it

    @classmethod
    def unavailable(cls) -> str | None:
        return None

    @abstractmethod
    def run(self, code: str, limits: SandboxLimits) -> SandboxResult:
        """Run `code` (a Python program reading nothing from stdin) and return what it printed."""


def register_sandbox(name: str) -> Callable[[type[Sandbox]], type[Sandbox]]:
    def add(cls: type[Sandbox]) -> type[Sandbox]:
        cls.name = name
        SANDBOXES.add(name, cls, cls)
        return cls
    return add


# ---- the parent's side of a local sandbox: deadline, output cap, the whole tree killed ---------------------
@dataclass
class ProcessOutcome:
    stdout: bytes
    stderr: bytes
    returncode: int | None
    timed_out: bool
    output_limited: bool
    stopped: str = ""

    def result(self) -> SandboxResult:
        return SandboxResult(self.stdout.decode(errors="replace"), self.stderr.decode(errors="replace"),
                             None if self.timed_out else self.returncode, self.timed_out, self.output_limited,
                             self.stopped)


def run_process(argv: list[str], stdin: bytes, limits: SandboxLimits, *, env: dict[str, str], cwd: str | None = None,
                preexec_fn: Callable[[], None] | None = None, pass_fds: tuple[int, ...] = (),
                watch: Callable[[subprocess.Popen], str] | None = None) -> ProcessOutcome:
    """Start `argv` in a session of its own, feed it `stdin`, read at most limits.max_output_bytes of its output,
    and kill its whole tree at the deadline, when it prints too much, or when `watch(proc)` (called every
    quarter second) names another limit it broke. Returns at the deadline even when a descendant keeps the
    pipes open."""
    deadline = time.monotonic() + limits.timeout_s
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            cwd=cwd, start_new_session=True, preexec_fn=preexec_fn, pass_fds=pass_fds, close_fds=True)
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    out = {out_fd: bytearray(), err_fd: bytearray()}
    timed_out = limited = False
    stopped, watched = "", time.monotonic()
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        selector.register(proc.stderr, selectors.EVENT_READ)
        pending = memoryview(stdin)
        if pending:
            os.set_blocking(proc.stdin.fileno(), False)
            selector.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        while _reading(selector, out_fd, err_fd):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in selector.select(timeout=min(remaining, 0.25)):
                if key.fileobj is proc.stdin:
                    pending = _feed(proc, selector, pending)
                    continue
                chunk = os.read(key.fd, 65536)
                if chunk:
                    out[key.fd] += chunk
                else:
                    selector.unregister(key.fileobj)
            if len(out[out_fd]) + len(out[err_fd]) > limits.max_output_bytes:
                limited = True
                break
            if watch is not None and time.monotonic() - watched >= 0.25:
                stopped, watched = watch(proc), time.monotonic()
                if stopped:
                    break
    if not timed_out and not limited and not stopped:  # both pipes closed: the program is ending
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    kill_tree(proc)  # also after a normal exit: a background child left in its process group goes too
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        try:
            stream.close()
        except OSError:
            pass
    cap = limits.max_output_bytes
    return ProcessOutcome(bytes(out[out_fd][:cap]), bytes(out[err_fd][-cap:]), proc.returncode, timed_out, limited,
                          stopped)


def _reading(selector: selectors.BaseSelector, *fds: int) -> bool:
    return any(key.fd in fds for key in selector.get_map().values())


def _feed(proc: subprocess.Popen, selector: selectors.BaseSelector, pending: memoryview) -> memoryview:
    """Write what the pipe takes of `pending`; close stdin once all is written (or the reader is gone)."""
    try:
        pending = pending[os.write(proc.stdin.fileno(), pending[:65536]):]
    except BlockingIOError:
        return pending
    except BrokenPipeError:
        pending = pending[:0]
    if not pending:
        selector.unregister(proc.stdin)
        proc.stdin.close()
    return pending


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the process, its session's process group and every descendant still attached to it, then reap it.
    (A bwrap sandbox dies whole with its first process: its PID namespace goes with it.)"""
    import psutil  # already a dependency (the reaper); only needed here

    descendants = []
    if proc.poll() is None:  # not reaped: its pid is still its own
        try:
            descendants = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group outlives its leader while members remain: never reused
    except (ProcessLookupError, PermissionError):
        pass
    proc.kill()
    for child in descendants:
        try:
            child.kill()
        except psutil.Error:
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass

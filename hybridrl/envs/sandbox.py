"""Run model-written Python in a child process with limits: the Python execution tool's engine.

What it enforces, and how:
- time: wall-clock `timeout_s` (the whole process group is killed) and RLIMIT_CPU;
- memory: RLIMIT_AS (address space), so a runaway allocation fails with MemoryError;
- processes: fork / exec / spawn / subprocess / os.system are refused by an audit hook (RLIMIT_NPROC does not
  bind root, so the hook is what stops a fork bomb); RLIMIT_NPROC is set as well for non-root users;
- network: socket creation, connect and bind are refused by the audit hook;
- files: the code runs in a scratch directory that is removed afterwards; opening a file for writing,
  creating, removing or renaming anything outside it is refused by the audit hook; RLIMIT_FSIZE caps file size;
- native escapes: importing ctypes / cffi is refused (they would bypass the hooks).
The child is `python -I` (isolated: no user site, no PYTHONPATH) with an empty environment.

Audit hooks act on Python-level operations; they are a guard rail for a model's mistakes and casual
misbehaviour, not a security boundary against a determined attacker. Run untrusted production workloads in a
container or gVisor sandbox as well.
"""
from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Runs in the child before the user's code; RuntimeError messages name the rule that was broken.
_GUARD = r'''
import os, sys
_SCRATCH = os.path.realpath(os.getcwd())
_REFUSED_IMPORTS = {"ctypes", "_ctypes", "cffi"}
_PROCESS_EVENTS = {"os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
                   "subprocess.Popen", "pty.spawn", "os.startfile", "os.kill", "os.killpg"}
_PATH_EVENTS = {"os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.symlink", "os.link", "os.chmod",
                "os.chown", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile"}

def _inside(path):
    try:
        real = os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return True  # a file descriptor: opened earlier, already checked
    return real == _SCRATCH or real.startswith(_SCRATCH + os.sep)

def _guard(event, args):
    if event in _PROCESS_EVENTS:
        raise RuntimeError("sandbox: starting or signalling processes is not allowed")
    if event.startswith("socket.") and event != "socket.gethostname":
        raise RuntimeError("sandbox: network access is not allowed")
    if event == "import" and args[0].split(".")[0] in _REFUSED_IMPORTS:
        raise RuntimeError(f"sandbox: importing {args[0]} is not allowed")
    if event == "open":
        path, mode, flags = args
        writing = (mode is not None and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))
        if writing and not _inside(path):
            raise PermissionError(f"sandbox: writing outside the scratch directory is not allowed: {path}")
    if event in _PATH_EVENTS:
        for arg in args[:2]:
            if isinstance(arg, (str, bytes, os.PathLike)) and not _inside(arg):
                raise PermissionError(f"sandbox: changing files outside the scratch directory is not allowed: {arg}")

sys.addaudithook(_guard)
del _guard
_source = sys.stdin.read()
exec(compile(_source, "<tool code>", "exec"), {"__name__": "__main__"})
'''


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None: killed for the time limit
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def observation(self) -> str:
        """What the model sees: the output, or one line saying why the run stopped."""
        if self.timed_out:
            return f"error: time limit exceeded\n{self.stdout}".rstrip()
        if self.exit_code != 0:
            last = self.stderr.strip().splitlines()[-1] if self.stderr.strip() else f"exit code {self.exit_code}"
            if self.exit_code is not None and self.exit_code < 0:
                last = f"killed by signal {signal.Signals(-self.exit_code).name} (a resource limit)"
            return f"error: {last}\n{self.stdout}".rstrip()
        return self.stdout


def _limits(memory_mb: int, cpu_s: int, file_mb: int, processes: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20, file_mb << 20))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if os.getuid() != 0:  # root ignores it; the audit hook refuses forks anyway
            resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    return apply


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, file_mb: int = 16,
               max_output_chars: int = 4000) -> SandboxResult:
    """Run `code` in a fresh sandboxed interpreter inside a scratch directory removed afterwards."""
    scratch = Path(tempfile.mkdtemp(prefix="hybridrl-tool-"))
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-c", _GUARD], cwd=scratch, env={"PATH": "/usr/bin:/bin"},
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True,  # its own process group, killed as a whole
                                preexec_fn=_limits(memory_mb, max(1, int(timeout_s) + 1), file_mb, 16))
        try:
            out, err = proc.communicate(code, timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            timed_out = True
        return SandboxResult(out[:max_output_chars], err[-max_output_chars:], None if timed_out else proc.returncode,
                             timed_out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

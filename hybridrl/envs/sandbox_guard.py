"""The weak sandboxes, each an explicit choice: `guard` (a child interpreter with audit hooks) and `none`.

Both run `python -I` in a scratch folder removed afterwards, with an empty environment and resource limits
(RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_NPROC where it binds), in a session of their own
that the parent kills whole at the deadline (sandbox.run_process). `guard` adds an audit hook that refuses
processes, signals, sockets, ctypes / cffi, reads of other processes' /proc entries and writes outside the
scratch folder, each with a one-line error. Audit hooks act on Python-level operations only: code that goes
around them (`_posixsubprocess`, a native library loaded under another name) is not stopped, and nothing
separates the child from the machine (same user, same network, same files). Use `bwrap` or `remote` for
untrusted code; `guard` suits a model's mistakes on a machine where neither can run.
"""
from __future__ import annotations

import os
import resource
import shutil
import sys
import tempfile

from hybridrl.envs.sandbox_base import Sandbox, SandboxLimits, SandboxResult, register_sandbox, run_process

# Runs in the child before the code; its names live in a function's closure, not in __main__'s globals.
_GUARD = r'''
import os, sys
def _install():
    scratch = os.path.realpath(os.getcwd())
    me = str(os.getpid())
    refused_imports = frozenset({"ctypes", "_ctypes", "cffi", "_cffi_backend"})
    process_events = frozenset({"os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
                                "subprocess.Popen", "pty.spawn", "os.startfile", "os.kill", "os.killpg",
                                "os.setsid", "signal.pthread_kill"})
    path_events = frozenset({"os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.symlink", "os.link", "os.chmod",
                             "os.chown", "os.truncate", "os.utime", "os.mkfifo", "os.mknod", "shutil.rmtree",
                             "shutil.move", "shutil.copyfile"})

    def inside(path):
        try:
            real = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return False  # a descriptor or dir_fd-relative name cannot be checked: refused
        return real == scratch or real.startswith(scratch + os.sep)

    def other_process(path):
        try:
            parts = os.path.realpath(os.fsdecode(path)).split(os.sep)
        except (TypeError, ValueError):
            return False
        return len(parts) > 2 and parts[1] == "proc" and parts[2] not in ("self", "thread-self", me)

    def guard(event, args):
        if event in process_events:
            raise RuntimeError("sandbox: starting or signalling processes is not allowed")
        if event.startswith("socket.") and event != "socket.gethostname":
            raise RuntimeError("sandbox: network access is not allowed")
        if event == "import" and args[0].split(".")[0] in refused_imports:
            raise RuntimeError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            if isinstance(path, (str, bytes)) and other_process(path):
                raise PermissionError(f"sandbox: reading other processes is not allowed: {path}")
            writing = (mode is not None and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))
            if writing and not inside(path):
                raise PermissionError(f"sandbox: writing outside the scratch directory is not allowed: {path}")
        if event in path_events:
            for arg in args[:2]:
                if isinstance(arg, (str, bytes, os.PathLike)) and not inside(arg):
                    raise PermissionError(f"sandbox: changing files outside the scratch directory is not allowed: {arg}")

    sys.addaudithook(guard)
_install()
del _install
_source = sys.stdin.read()
sys.stdin.close()
exec(compile(_source, "<tool code>", "exec"), {"__name__": "__main__"})
'''
_RUN = r'''
import sys
_source = sys.stdin.read()
sys.stdin.close()
exec(compile(_source, "<tool code>", "exec"), {"__name__": "__main__"})
'''


def _limits(limits: SandboxLimits):
    def apply() -> None:
        memory, fsize = limits.memory_mb << 20, limits.file_mb << 20
        for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, limits.cpu_s),
                             (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(limit, (value, value))
        if os.getuid() != 0:  # counts every process of this user (root is exempt)
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
    return apply


def _run_child(program: str, code: str, limits: SandboxLimits) -> SandboxResult:
    scratch = tempfile.mkdtemp(prefix="hybridrl-tool-")
    try:
        outcome = run_process([sys.executable, "-I", "-c", program], code.encode(), limits,
                              env={"PATH": "/usr/bin:/bin"}, cwd=scratch, preexec_fn=_limits(limits))
        return outcome.result()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@register_sandbox("guard")
class GuardSandbox(Sandbox):
    def run(self, code: str, limits: SandboxLimits) -> SandboxResult:
        return _run_child(_GUARD, code, limits)


@register_sandbox("none")
class NoSandbox(Sandbox):
    def run(self, code: str, limits: SandboxLimits) -> SandboxResult:
        return _run_child(_RUN, code, limits)

"""The OS-level tool sandbox: bubblewrap (`bwrap`, Debian package `bubblewrap`).

One call = one `bwrap` process tree that dies whole (its PID namespace goes with its first process):
- namespaces: PID (no view of any process outside), network (only its own loopback), mount, IPC, UTS, cgroup;
  a user namespace as well when hybridrl does not run as root (unprivileged bubblewrap), with nested user
  namespaces disabled;
- user: an unprivileged uid with no capabilities. Run as root, bwrap keeps only CAP_SETUID/SETGID for the
  launcher, which sets the limits and drops to a uid of its own (a fresh one per call, so RLIMIT_NPROC counts
  this call's processes alone) before the code is read; no_new_privs is set (setuid binaries do not elevate);
- filesystem: a read-only minimal tree (/usr, the Python installation, the dynamic loader's cache) on a root
  that is remounted read-only; /proc of its own PID namespace, a minimal /dev; the only writable place is
  /tmp, a tmpfs of `disk_mb` (the scratch folder, also the working directory), gone with the sandbox;
- environment: empty except PATH, HOME and LANG;
- seccomp: hybridrl/envs/seccomp.py's filter where its numbers are known (x86_64);
- limits: RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_NPROC (processes), no core
  files, set by the launcher inside; the parent (sandbox.run_process) enforces the deadline and the output cap.
"""
from __future__ import annotations

import dataclasses
import os
import random
import shutil
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

from hybridrl.envs import seccomp
from hybridrl.envs.sandbox_base import Sandbox, SandboxLimits, SandboxResult, register_sandbox, run_process

# The first process inside: set the limits, drop to the call's uid (root only), read the code, run it. Its own
# names are gone before the code runs; nothing it leaves behind grants anything (the kernel holds the limits).
_LAUNCHER = r'''
import os, resource, sys
def _enter(memory, cpu, fsize, nproc, uid):
    for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize),
                         (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, nproc)):
        resource.setrlimit(limit, (value, value))
    if uid:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
def _count_files(most, report):
    # a burst of files made and left within one of the parent's polls: counted before the sandbox (and its
    # tmpfs) is gone; written to the parent's report pipe (code that skips this by os._exit took its tmpfs along)
    stats = os.statvfs("/tmp")
    used = stats.f_files - stats.f_ffree
    if used > most:
        os.write(report, f"file count limit exceeded ({used} > {most} files)".encode())
_enter(*map(int, sys.argv[1:6]))
_most, _report = map(int, sys.argv[6:8])
del _enter
_source = sys.stdin.read()
sys.stdin.close()
sys.argv = ["<tool code>"]
try:
    exec(compile(_source, "<tool code>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
finally:
    _count_files(_most, _report)
'''
_UID_RANGE = (2_000_000_000, 2_100_000_000)  # fresh uids for root's calls: no account, no file owned by them
_SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"


def _read_only_tree() -> list[str]:
    """bwrap arguments for the read-only part of the filesystem: /usr, the top-level links into it (or the
    folders themselves on a system without merged /usr), the Python installation and the loader's cache."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/lib", "/lib64", "/lib32", "/bin", "/sbin"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    python_dirs = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, os.path.dirname(sys.executable))}
    made: set[str] = set()
    for folder in sorted(python_dirs):
        if folder.startswith("/usr/") or folder == "/usr":
            continue
        # the folders above it, traversable (bwrap would copy their modes: /root is 0700, closed to the code's uid)
        for parent in reversed(Path(folder).parents[:-1]):
            if str(parent) not in made:
                made.add(str(parent))
                args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", folder, folder]
    for file in ("/etc/ld.so.cache", "/etc/localtime"):
        if os.path.exists(file):
            args += ["--ro-bind", file, file]
    return args


def bwrap_command(limits: SandboxLimits, seccomp_fd: int | None, as_root: bool,
                  report_fd: int) -> tuple[list[str], int]:
    """The bwrap command line for one call and the uid the code runs as (0: bwrap's own user namespace); the
    launcher reports a limit broken at the end on `report_fd`."""
    bwrap = shutil.which("bwrap")
    uid = random.randrange(*_UID_RANGE) if as_root else 0
    args = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv",
            "--setenv", "PATH", _SANDBOX_PATH, "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8"]
    if as_root:  # privileged bwrap: no user namespace; the launcher drops to `uid` with these two capabilities
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:  # unprivileged bwrap: a user namespace of its own, mapped to nobody, no nested ones
        args += ["--unshare-user", "--uid", "65534", "--gid", "65534", "--disable-userns"]
    args += _read_only_tree()
    size = str(limits.disk_mb << 20)
    args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", size, "--tmpfs", "/dev/shm",
             "--perms", "1777", "--size", size, "--tmpfs", "/tmp", "--chdir", "/tmp", "--remount-ro", "/"]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    args += [sys.executable, "-I", "-c", _LAUNCHER, str(limits.memory_mb << 20),
             str(limits.cpu_s), str(limits.file_mb << 20), str(limits.processes), str(uid), str(limits.files),
             str(report_fd)]
    return args, uid


@register_sandbox("bwrap")
class BwrapSandbox(Sandbox):
    @classmethod
    def unavailable(cls) -> str | None:
        return _probe()

    def run(self, code: str, limits: SandboxLimits) -> SandboxResult:
        return _run(code, limits)


def _run(code: str, limits: SandboxLimits) -> SandboxResult:
    program = seccomp.program()
    report_read, report_write = os.pipe()
    try:
        with tempfile.TemporaryFile() as filter_file:  # bwrap reads the filter from an inherited descriptor
            seccomp_fd = None
            if program is not None:
                filter_file.write(program)
                filter_file.flush()
                filter_file.seek(0)
                seccomp_fd = filter_file.fileno()
            argv, _ = bwrap_command(limits, seccomp_fd, as_root=os.geteuid() == 0, report_fd=report_write)
            pass_fds = (report_write,) if seccomp_fd is None else (seccomp_fd, report_write)
            outcome = run_process(argv, code.encode(), limits, env={"PATH": _SANDBOX_PATH}, pass_fds=pass_fds,
                                  watch=lambda proc: _count_files(proc, limits.files))
        os.close(report_write)
        report_write = -1
        if not outcome.stopped:  # the launcher's own count at the end (its sandbox is gone: nothing more comes)
            os.set_blocking(report_read, False)
            try:
                report = os.read(report_read, 4096).decode(errors="replace")
            except BlockingIOError:
                report = ""
            outcome = dataclasses.replace(outcome, stopped=report)
    finally:
        for fd in (report_read, report_write):
            if fd >= 0:
                os.close(fd)
    return outcome.result()


def _count_files(proc, most: int) -> str:
    """Stop a call whose scratch tmpfs holds more than `most` files (each costs the machine kernel memory that the
    tmpfs size does not count); read from outside through the sandbox's /proc/<pid>/root."""
    import psutil  # already a dependency (the reaper)

    try:
        inside = psutil.Process(proc.pid).children()
        if not inside:
            return ""
        stats = os.statvfs(f"/proc/{inside[0].pid}/root/tmp")
    except (psutil.Error, OSError):
        return ""
    used = stats.f_files - stats.f_ffree
    return f"file count limit exceeded ({used} > {most} files)" if used > most else ""


@lru_cache(maxsize=1)
def _probe() -> str | None:
    """Why bwrap cannot run a sandboxed Python here (None: it can), checked once per process."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    limits = SandboxLimits(timeout_s=30.0)
    result = _run("import os; print(os.getpid(), len(os.listdir('/proc')) > 0)", limits)
    if result.ok and result.stdout.split()[:1] == ["2"]:  # its own PID namespace: pid 1 is bwrap's init
        return None
    why = (result.stderr.strip().splitlines() or [f"exit code {result.exit_code}"])[-1]
    return f"bwrap could not start a sandbox here ({why})"


"""Where model-written code runs: the sandbox registry, the limits every sandbox enforces, and `run_python`.

A sandbox is registered by name (`@register_sandbox`) and chosen with `rollout.tool_sandbox`:

    bwrap   an OS-level sandbox (bubblewrap, hybridrl/envs/sandbox_bwrap.py): its own PID, network, mount, IPC and
            UTS namespaces, an unprivileged user, a read-only minimal filesystem with only a size-capped scratch
            folder writable, an empty environment, a seccomp filter (x86_64), kernel resource limits
    remote  an HTTP sandbox service (SandboxFusion's `/run_code` API, sandbox_remote.py) for clusters whose nodes
            cannot run bubblewrap
    guard   the in-process guard (sandbox_guard.py): a child interpreter with audit hooks and resource limits. It
            stops a model's mistakes, not a determined attacker (code can switch the hooks off); opt-in only
    none    a child interpreter with the resource limits and an empty environment, no isolation at all: only for
            code you trust or a run that is already inside a sandbox (a gVisor / Firecracker container)
    auto    the strongest one that can start here: bwrap, else the tools are refused (SandboxUnavailable)

Every local sandbox runs through `run_process`: the parent enforces the wall-clock deadline and the total output
(it reads the pipes itself, up to `max_output_bytes`, and never waits for an end of file that a child holding the
pipes could withhold), and kills the whole process tree at the deadline.
"""
from __future__ import annotations

from hybridrl.envs import sandbox_bwrap, sandbox_guard, sandbox_remote  # noqa: F401  (register the sandboxes)
from hybridrl.envs.sandbox_base import (SANDBOXES, Sandbox, SandboxLimits, SandboxResult, SandboxUnavailable,
                                        register_sandbox)

__all__ = ["SANDBOXES", "Sandbox", "SandboxLimits", "SandboxResult", "SandboxUnavailable", "register_sandbox",
           "resolve_sandbox", "set_default_sandbox", "default_sandbox", "run_python"]

STRONGEST_FIRST = ("bwrap",)  # what `auto` may pick, in order; remote needs a URL, guard and none an explicit choice


def resolve_sandbox(kind: str = "auto", url: str | None = None) -> Sandbox:
    """The sandbox `rollout.tool_sandbox=kind` names, started once to check that it can; SandboxUnavailable (one
    line: why, and the options) when it cannot."""
    if kind == "auto":
        reasons = []
        for name in STRONGEST_FIRST:
            reason = SANDBOXES[name].unavailable()
            if reason is None:
                return SANDBOXES[name]()
            reasons.append(f"{name}: {reason}")
        raise SandboxUnavailable(f"rollout.tool_sandbox=auto: no OS-level sandbox can start here "
                                 f"({'; '.join(reasons)}); {_ALTERNATIVES}")
    cls = SANDBOXES.lookup(kind, f"rollout.tool_sandbox={kind!r}")
    reason = cls.unavailable()
    if reason is not None:
        raise SandboxUnavailable(f"rollout.tool_sandbox={kind}: {reason}; {_ALTERNATIVES}")
    return cls(url)


_ALTERNATIVES = ("install bubblewrap (apt-get install bubblewrap), or use an HTTP sandbox service "
                 "(rollout.tool_sandbox=remote rollout.tool_sandbox_url=URL), or opt in to the in-process guard, "
                 "which does not stop a determined attacker (rollout.tool_sandbox=guard)")


_default: list[Sandbox] = []  # the run's sandbox (set by the trainer from rollout.tool_sandbox), else auto


def set_default_sandbox(sandbox: Sandbox | None) -> None:
    """The sandbox tools use when they name none (the trainer sets the run's, resolved by its plan)."""
    _default.clear()
    if sandbox is not None:
        _default.append(sandbox)


def default_sandbox() -> Sandbox:
    if not _default:
        _default.append(resolve_sandbox("auto"))
    return _default[0]


def run_python(code: str, *, sandbox: Sandbox | str | None = None, timeout_s: float = 5.0, memory_mb: int = 512,
               file_mb: int = 16, disk_mb: int = 64, processes: int = 16, files: int = 4096,
               max_output_bytes: int = 1 << 20) -> SandboxResult:
    """Run `code` in `sandbox` (an object, a registered name, or None: the run's default, else the strongest
    available) with a fresh scratch folder that is gone afterwards."""
    if sandbox is None:
        sandbox = default_sandbox()
    elif isinstance(sandbox, str):
        sandbox = resolve_sandbox(sandbox)
    limits = SandboxLimits(timeout_s, memory_mb, file_mb, disk_mb, processes, files, max_output_bytes)
    return sandbox.run(code, limits)



"""A remote sandbox service: tool code runs on another machine, behind an HTTP endpoint (`rollout.tool_sandbox=remote`,
`rollout.tool_sandbox_url`), for clusters whose nodes cannot run bubblewrap (no user namespaces, no root).

The request and answer follow SandboxFusion's `POST /run_code` (github.com/bytedance/SandboxFusion):

    {"code": ..., "language": "python", "run_timeout": s, "memory_limit_MB": m}
 -> {"status": "Success" | "Failed" | "SandboxError", "message": ..., "run_result":
     {"status": "Finished" | "TimeLimitExceeded" | "Error", "return_code": int, "stdout": ..., "stderr": ...}}

The service owns the isolation; hybridrl caps what it reads back (`max_output_bytes`) and waits at most the time
limit plus `_SLACK_S` for an answer. A service that cannot be reached or answers something else gives the
model an `error: ...` observation, never a crashed rollout.
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request

from hybridrl.envs.sandbox_base import Sandbox, SandboxLimits, SandboxResult, register_sandbox

_SLACK_S = 30.0  # queueing and start-up on the service's side


def check_url(url: str | None) -> str | None:
    """Why `url` is no sandbox endpoint (None: it looks like one)."""
    if not url:
        return "rollout.tool_sandbox=remote needs rollout.tool_sandbox_url=http(s)://HOST:PORT/run_code"
    if not url.startswith(("http://", "https://")):
        return f"rollout.tool_sandbox_url={url!r} is not an http(s):// URL"
    return None


@register_sandbox("remote")
class RemoteSandbox(Sandbox):
    def __init__(self, url: str | None = None) -> None:
        problem = check_url(url)
        if problem is not None:
            raise ValueError(problem)
        super().__init__(url)

    def run(self, code: str, limits: SandboxLimits) -> SandboxResult:
        body = json.dumps({"code": code, "language": "python", "run_timeout": limits.timeout_s,
                           "memory_limit_MB": limits.memory_mb}).encode()
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=limits.timeout_s + _SLACK_S) as response:
                raw = response.read(limits.max_output_bytes * 2 + 65536)
            answer = json.loads(raw)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            return SandboxResult("", f"sandbox service {self.url} failed: {exc}", 1, False)
        return _result(answer, limits)


def _result(answer: dict, limits: SandboxLimits) -> SandboxResult:
    run = answer.get("run_result") or {}
    if not isinstance(run, dict) or answer.get("status") == "SandboxError":
        return SandboxResult("", f"sandbox service error: {answer.get('message') or answer.get('status')}", 1, False)
    stdout, stderr = str(run.get("stdout") or ""), str(run.get("stderr") or "")
    limited = len(stdout) + len(stderr) > limits.max_output_bytes
    if run.get("status") == "TimeLimitExceeded":
        return SandboxResult(stdout[:limits.max_output_bytes], stderr, None, True, limited)
    code = run.get("return_code")
    return SandboxResult(stdout[:limits.max_output_bytes], stderr[-limits.max_output_bytes:],
                         code if isinstance(code, int) else 1, False, limited)

"""The tool sandbox (hybridrl/envs/sandbox*.py): bubblewrap is a boundary. Every escape found against the old
audit-hook sandbox (issue 35) runs here as tool code and must stay inside: each test checks the machine's side
(a file that must not appear, a process that must live, a secret that must not be read), not only the message.
The weak sandboxes keep their limits; `auto` refuses tools with one line where no OS-level sandbox starts; the
remote service's answers map onto the same result."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import psutil
import pytest

from hybridrl.envs import ToolRegistry, python_tool, resolve_sandbox, run_python, sandbox_bwrap
from hybridrl.envs.sandbox import SandboxUnavailable

pytestmark = pytest.mark.skipif(sandbox_bwrap.BwrapSandbox.unavailable() is not None,
                                reason=f"bubblewrap cannot start here: {sandbox_bwrap.BwrapSandbox.unavailable()}")


def bwrap(code: str, **limits) -> str:
    limits.setdefault("timeout_s", 60)  # generous: a loaded CI machine starts Python slowly
    return run_python(code, sandbox="bwrap", **limits).observation()


def _sandbox_processes() -> set[int]:
    """Processes running tool code (the launcher's command line names it) on this machine."""
    found = set()
    for proc in psutil.process_iter(["cmdline"]):
        if any("<tool code>" in part for part in proc.info.get("cmdline") or []):
            found.add(proc.pid)
    return found


def test_auto_picks_bwrap_and_the_code_sees_nothing_of_the_machine():
    assert resolve_sandbox("auto").name == "bwrap"
    os.environ["HYBRIDRL_SECRET_FOR_TEST"] = "leaked"
    try:
        out = bwrap(f"""import json, os
status = dict(line.split(':', 1) for line in open('/proc/self/status').read().splitlines())
seen = {{}}
for path in ('/proc/{os.getpid()}/environ', '/proc/1/environ'):
    try:
        seen[path] = open(path, 'rb').read().decode()
    except OSError as exc:
        seen[path] = type(exc).__name__
print(json.dumps([os.getuid(), os.getpid(), sorted(os.environ), status['NoNewPrivs'].strip(),
                  status['Seccomp'].strip(), status['CapEff'].strip(),
                  sorted(line.split(':')[0].strip() for line in open('/proc/net/dev').readlines()[2:]),
                  seen, sorted(os.listdir('/')), os.path.exists('{Path.home()}/.cache')]))
""")
    finally:
        del os.environ["HYBRIDRL_SECRET_FOR_TEST"]
    uid, pid, env, no_new_privs, seccomp_mode, caps, interfaces, environs, top, home = json.loads(out)
    assert uid != 0 and pid == 2  # an unprivileged user in a PID namespace of its own
    assert env == ["HOME", "LANG", "PATH", "PWD"]
    assert (no_new_privs, seccomp_mode, caps) == ("1", "2", "0000000000000000")  # seccomp filter on x86_64
    assert interfaces == ["lo"]  # no network but its own loopback
    assert list(environs.values()) == ["FileNotFoundError", "PermissionError"]  # the driver is not there
    assert "leaked" not in out
    assert {"dev", "proc", "tmp", "usr"} <= set(top) and not {"home", "work", "var", "srv"} & set(top)
    assert not home  # the user's home (tokens, caches) is not there


# The escapes of issue 35, each trying to reach the machine (HOST: a path outside the sandbox that must not
# appear). They are written against the old guard (whose hooks they switch off or go around); under bwrap there
# is nothing to switch off, so each runs and must find the machine out of reach.
ESCAPES = {
    "guard switched off, then os.system": "import os\nos.system('id; touch {host}')",
    "_posixsubprocess.fork_exec": (
        "import _posixsubprocess, os\nr, w = os.pipe()\n"
        "_posixsubprocess.fork_exec([b'/usr/bin/touch', b'{host}'], [b'/usr/bin/touch'], True, (w,), None, None, "
        "-1, -1, -1, -1, -1, -1, r, w, True, False, None, None, None, -1, None, False)\nos.wait()"),
    "_ctypes loaded by file path under another name": (
        "import importlib.machinery, importlib.util, glob, sys\n"
        "path = glob.glob(sys.base_prefix + '/lib/python3*/lib-dynload/_ctypes*.so')[0]\n"
        "spec = importlib.util.spec_from_file_location('_ctypes', path, loader=importlib.machinery.ExtensionFileLoader("
        "'_ctypes', path))\nmodule = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(module)\n"
        "sys.modules['_ctypes'] = module\nimport ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print('unshare', libc.unshare(0x10000000), ctypes.get_errno())\n"
        "print('mount', libc.mount(b'none', b'/usr', b'tmpfs', 0, None), ctypes.get_errno())\n"
        "print('setuid', libc.setuid(0), ctypes.get_errno())\n"
        "print('creat', libc.creat(b'{host}', 0o644), ctypes.get_errno())"),
    "multiprocessing spawn": (
        "import multiprocessing as mp, pathlib\nif __name__ == '__main__':\n"
        "    child = mp.get_context('spawn').Process(target=pathlib.Path('{host}').touch)\n"
        "    child.start(); child.join(); print('exit', child.exitcode)"),
    "os.open with dir_fd": "import os\nfd = os.open('/', os.O_RDONLY)\nos.open('{host}'.lstrip('/'), os.O_WRONLY | os.O_CREAT, dir_fd=fd)",
    "os.mkfifo outside the scratch folder": "import os\nos.mkfifo('{host}')",
}


@pytest.mark.parametrize("name", list(ESCAPES))
def test_escape_stays_inside(name, tmp_path):
    host = tmp_path / "escaped"
    out = bwrap(ESCAPES[name].format(host=host))
    assert not host.exists(), out
    if name == "guard switched off, then os.system":
        assert "uid=" in out and "uid=0(" not in out, out  # it ran, as nobody of the machine's
    if name == "_ctypes loaded by file path under another name":  # loaded, and every call refused
        assert [line.split()[1:] for line in out.splitlines()] == [["-1", "1"]] * 3 + [["-1", "2"]], out
    if name == "multiprocessing spawn":
        assert out.strip().endswith("exit 1"), out  # the child ran, and could not touch the machine


def test_signals_reach_no_process_outside(tmp_path):
    """pidfd_send_signal / kill of a process of the machine (its pid is not in the sandbox's PID namespace)."""
    victim = subprocess.Popen(["sleep", "300"])
    try:
        out = bwrap(f"import os, signal\nfor pid in ({victim.pid}, {os.getpid()}, 1):\n    try:\n"
                    f"        signal.pidfd_send_signal(os.pidfd_open(pid), signal.SIGKILL); print('sent', pid)\n"
                    f"    except OSError as exc:\n        print(pid, exc.errno)\n"
                    f"try:\n    os.kill({victim.pid}, 9)\nexcept OSError as exc:\n    print('kill', exc.errno)")
        assert victim.poll() is None, out  # still alive
        assert "sent" not in out, out
    finally:
        victim.kill()
        victim.wait()


def test_a_child_holding_the_pipes_does_not_hold_the_call():
    """A setsid child that outlives the code, keeping stdout open: the call returns at its deadline and no process of
    it is left (the PID namespace dies with its first process)."""
    before = _sandbox_processes()
    results = []
    code = ("import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3600)\n"
            "print('parent', flush=True)\ntime.sleep(3600)")
    call = threading.Thread(target=lambda: results.append(run_python(code, sandbox="bwrap", timeout_s=3)))
    call.start()
    call.join(120)  # a hang would be the old behaviour: the call waited for the pipes' end
    assert not call.is_alive() and results[0].timed_out and results[0].stdout == "parent\n"
    assert _sandbox_processes() <= before


def test_network_is_out_of_reach():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.5)
    try:
        out = bwrap(f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), "
                    f"timeout=5)\n    print('connected')\nexcept OSError as exc:\n    print(exc.errno)")
        assert out.strip() == "111", out  # refused: its own loopback has no such listener
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()


@pytest.mark.parametrize("code, expected", [
    ("import sys\nb = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(b)", "error: output limit exceeded"),
    ("for i in range(20000):\n    open(f'f{i}', 'w').close()", "error: file count limit exceeded"),
    ("with open('big', 'wb') as f:\n    for _ in range(400):\n        f.write(b'x' * (1 << 20))",
     "error: OSError: [Errno 27] File too large"),
    ("import os\nfor i in range(8):\n    with open(f'part{i}', 'wb') as f:\n        f.write(b'x' * (15 << 20))",
     "error: OSError: [Errno 28] No space left on device"),
    ("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(30)\n"
     "            os._exit(0)\n        n += 1\nexcept OSError as exc:\n    print(n, exc.errno)", "15 11"),
    ("x = bytearray(4 << 30)", "error: MemoryError"),
    ("while True:\n    pass", "error: time limit exceeded"),
])
def test_limits_hold(code, expected):
    result = run_python(code, sandbox="bwrap", timeout_s=3 if "while True:\n    pass" in code else 60)
    assert result.observation().startswith(expected), result.observation()[:300]
    assert len(result.stdout) + len(result.stderr) <= 2 << 20  # the driver read no more than the cap


def test_files_made_faster_than_the_parent_polls_are_still_counted(monkeypatch):
    """The parent counts the scratch files every quarter second; a call that makes its files and ends between
    two counts (here: no count at all) is counted by its launcher before the sandbox goes; under the limit it
    passes."""
    monkeypatch.setattr(sandbox_bwrap, "_count_files", lambda proc, most: "")
    flood = "import os\nfor i in range(300):\n    open(f'f{i}', 'w').close()\nprint(len(os.listdir()))"
    result = run_python(flood, sandbox="bwrap", timeout_s=60, files=100)
    assert result.stdout == "300\n" and result.observation().startswith(
        "error: file count limit exceeded (301 > 100 files)"), result
    assert run_python(flood, sandbox="bwrap", timeout_s=60, files=400).observation() == "300\n"


def test_writes_outside_the_scratch_folder_fail():
    out = bwrap("import os\nfor path in ('/usr/x', '/x', '/etc/x', '/proc/x'):\n    try:\n        open(path, 'w')\n"
                "    except OSError as exc:\n        print(exc.errno)\nopen('here', 'w').write('kept')\n"
                "print(open('/tmp/here').read(), os.getcwd())")
    assert out.split() == ["30", "30", "13", "2", "kept", "/tmp"], out


def test_tool_calls_run_in_the_sandbox():
    tools = ToolRegistry()
    tools.register(python_tool(timeout_s=60))
    [(text, ok)] = tools.respond('<tool_call>{"name": "python", "arguments": {"code": '
                                 '"import os; print(os.getpid(), 2 ** 20)"}}</tool_call>')
    assert ok and text == "2 1048576\n" and tools.runs_code()


# ---- choosing a sandbox ------------------------------------------------------------------------------------
def test_auto_refuses_tools_with_one_line_where_no_sandbox_starts(monkeypatch):
    monkeypatch.setattr(sandbox_bwrap.BwrapSandbox, "unavailable", classmethod(lambda cls: "bwrap is not installed"))
    with pytest.raises(SandboxUnavailable) as caught:
        resolve_sandbox("auto")
    message = str(caught.value)
    assert "\n" not in message and message.startswith("rollout.tool_sandbox=auto: no OS-level sandbox can start here "
                                                      "(bwrap: bwrap is not installed)")
    assert "rollout.tool_sandbox=guard" in message and "rollout.tool_sandbox=remote" in message
    assert resolve_sandbox("guard").name == "guard"  # an explicit opt-in still works


def test_guard_and_none_keep_their_limits():
    assert run_python("import os\nos.system('id')", sandbox="guard", timeout_s=60).observation() \
        == "error: RuntimeError: sandbox: starting or signalling processes is not allowed"
    for kind in ("guard", "none"):
        printed = run_python("import sys\nb = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(b)",
                             sandbox=kind, timeout_s=60)
        assert printed.output_limited and len(printed.stdout) <= 1 << 20
        assert run_python("while True:\n    pass", sandbox=kind, timeout_s=2).timed_out


class _FakeSandboxService(BaseHTTPRequestHandler):
    """SandboxFusion's /run_code as far as hybridrl uses it: runs nothing, answers by the code it gets."""
    requests: list[dict] = []

    def do_POST(self):  # noqa: N802 - the http.server name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.requests.append(body)
        answers = {"print(1)": {"status": "Success", "run_result": {"status": "Finished", "return_code": 0,
                                                                    "stdout": "1\n", "stderr": ""}},
                   "loop": {"status": "Failed", "run_result": {"status": "TimeLimitExceeded", "stdout": "",
                                                               "stderr": ""}},
                   "raise": {"status": "Failed", "run_result": {"status": "Finished", "return_code": 1, "stdout": "",
                                                                "stderr": "Traceback\nValueError: x\n"}},
                   "broken": {"status": "SandboxError", "message": "no executor"}}
        payload = json.dumps(answers[body["code"]]).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


def test_remote_sandbox_service():
    server = HTTPServer(("127.0.0.1", 0), _FakeSandboxService)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        remote = resolve_sandbox("remote", f"http://127.0.0.1:{server.server_port}/run_code")
        seen = [run_python(code, sandbox=remote, timeout_s=7, memory_mb=256).observation()
                for code in ("print(1)", "loop", "raise", "broken")]
        assert seen == ["1\n", "error: time limit exceeded", "error: ValueError: x",
                        "error: sandbox service error: no executor"]
        assert _FakeSandboxService.requests[0] == {"code": "print(1)", "language": "python", "run_timeout": 7,
                                                   "memory_limit_MB": 256}
    finally:
        server.shutdown()
        server.server_close()
    unreachable = run_python("print(1)", sandbox=remote, timeout_s=1).observation()
    assert unreachable.startswith(f"error: sandbox service http://127.0.0.1:{server.server_port}/run_code failed:")
    with pytest.raises(ValueError, match="rollout.tool_sandbox=remote needs rollout.tool_sandbox_url"):
        resolve_sandbox("remote")


def test_the_run_plan_resolves_or_refuses_the_tool_sandbox(monkeypatch):
    """`hybridrl train` (its plan, before Ray starts) with an environment whose tools run code."""
    from hybridrl.config import ConfigError, load_config
    from hybridrl.trainer.plan import plan_run

    def plan(*overrides):
        return plan_run(load_config(None, ["rollout.env=tool_answer", "rollout.engine=native", *overrides]))

    assert plan().rollout.tool_sandbox == "bwrap"  # auto, resolved
    assert plan_run(load_config(None, ["rollout.engine=native"])).rollout.tool_sandbox == "auto"  # no tools: untouched
    monkeypatch.setattr(sandbox_bwrap.BwrapSandbox, "unavailable", classmethod(lambda cls: "bwrap is not installed"))
    with pytest.raises(ConfigError, match=r"^rollout.tool_sandbox=auto: no OS-level sandbox can start here"):
        plan()
    with pytest.raises(ConfigError, match=r"^rollout.tool_sandbox=bwrap: bwrap is not installed; install"):
        plan("rollout.tool_sandbox=bwrap")
    assert plan("rollout.tool_sandbox=guard").rollout.tool_sandbox == "guard"  # the explicit opt-in
    with pytest.raises(ConfigError, match="^rollout.tool_sandbox='docker': is not a registered tool sandbox"):
        plan("rollout.tool_sandbox=docker")
    with pytest.raises(ConfigError, match="needs rollout.tool_sandbox_url"):
        plan("rollout.tool_sandbox=remote")

"""Run one Ray node of a multi-node job, wait for a whole cluster, and stop a node without `ray stop`.

Used on every node by launch/slurm/hybridrl.sbatch and launch/ray/*.sh:

    python -m hybridrl.launch.ray_node ip    --ip-mode auto --node-index 0
    python -m hybridrl.launch.ray_node start --role head|worker --node-name n1 --node-index 0 ...
    python -m hybridrl.launch.ray_node wait  --address IP:PORT --nodes n1,n2 --gpus-per-node 8
    python -m hybridrl.launch.ray_node stop  --temp-dir /tmp/hr-ray-123/n0

Why not `ray stop`: it kills every Ray process on the machine (other jobs', other fake nodes'), so
this module stops exactly the processes that belong to one node's Ray temp dir, and their children.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridrl.launch.cluster_wait import ClusterNotReady, tcp_reachable, wait_for_cluster

logger = logging.getLogger("hybridrl.launch.ray_node")

PORT_BLOCK = 400  # ports reserved per node: fixed services first, then the worker port range
FIRST_WORKER_PORT_OFFSET = 20
PORT_RANGE_START, PORT_RANGE_END = 20000, 32000  # below Linux's ephemeral range (32768-60999)


@dataclass(frozen=True)
class RayNodePorts:
    """Every port one Ray node listens on, so two nodes sharing a host never collide."""
    gcs: int
    node_manager: int
    object_manager: int
    runtime_env_agent: int
    dashboard_agent_grpc: int
    dashboard_agent_listen: int
    metrics_export: int
    ray_client_server: int
    dashboard: int
    min_worker: int
    max_worker: int


def default_port_base(job_id: int, num_nodes: int, loopback: bool) -> int:
    """A port base derived from the job id, so concurrent jobs on shared hosts get disjoint ports."""
    span = PORT_BLOCK * (num_nodes if loopback else 1)
    slots = (PORT_RANGE_END - PORT_RANGE_START) // span
    if slots < 1:
        raise ValueError(f"{num_nodes} loopback nodes need {span} ports; at most "
                         f"{(PORT_RANGE_END - PORT_RANGE_START) // PORT_BLOCK} nodes fit on one host")
    return PORT_RANGE_START + (job_id % slots) * span


def node_ports(port_base: int, node_index: int, loopback: bool) -> RayNodePorts:
    """Ports of node `node_index`. Real nodes are separate hosts and share one block; loopback
    nodes all live on this host, so each gets its own block."""
    base = port_base + (node_index * PORT_BLOCK if loopback else 0)
    if base < 1024 or base + PORT_BLOCK > 65536:
        raise ValueError(f"Ray port block {base}..{base + PORT_BLOCK - 1} is outside 1024..65535: "
                         f"pick another --ray-port-base")
    return RayNodePorts(gcs=base, node_manager=base + 1, object_manager=base + 2,
                        runtime_env_agent=base + 3, dashboard_agent_grpc=base + 4,
                        dashboard_agent_listen=base + 5, metrics_export=base + 6,
                        ray_client_server=base + 7, dashboard=base + 8,
                        min_worker=base + FIRST_WORKER_PORT_OFFSET, max_worker=base + PORT_BLOCK - 1)


def slurm_cpus_per_node(spec: str) -> list[int]:
    """Expand SLURM_JOB_CPUS_PER_NODE ("4(x2),2" -> [4, 4, 2])."""
    counts = []
    for item in spec.split(","):
        value, _, repeat = item.partition("(x")
        counts += [int(value)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts


def node_ip(ip_mode: str, node_index: int) -> str:
    """This node's address for Ray and collectives.

    ip_mode: `loopback` (all nodes on this host for tests: 127.0.0.<2+index>; Ray rewrites only
    127.0.0.1/localhost to the routable address, other 127.x addresses stay on loopback),
    `auto` (what the hostname resolves to, else the first non-loopback IPv4 address),
    `iface:NAME` (the IPv4 address of interface NAME, e.g. iface:ib0), or a literal IPv4 address.
    """
    if ip_mode == "loopback":
        if not 0 <= node_index < 250:
            raise ValueError(f"loopback mode supports node indices 0..249, got {node_index}")
        return f"127.0.0.{2 + node_index}"
    if ip_mode.startswith("iface:"):
        import psutil

        name = ip_mode.split(":", 1)[1]
        addrs = psutil.net_if_addrs()
        if name not in addrs:
            raise ValueError(f"--ip-mode {ip_mode}: no interface {name!r} here (have {sorted(addrs)})")
        for addr in addrs[name]:
            if addr.family == socket.AF_INET:
                return addr.address
        raise ValueError(f"--ip-mode {ip_mode}: interface {name!r} has no IPv4 address")
    if ip_mode == "auto":
        try:
            resolved = socket.gethostbyname(socket.gethostname())
        except OSError:
            resolved = "127.0.0.1"
        if not resolved.startswith("127."):
            return resolved
        import psutil

        for name, addrs in sorted(psutil.net_if_addrs().items()):
            for addr in addrs:
                if addr.family == socket.AF_INET and not addr.address.startswith("127."):
                    return addr.address
        raise ValueError("--ip-mode auto found no non-loopback IPv4 address; use --ip-mode iface:NAME")
    try:
        socket.inet_aton(ip_mode)
    except OSError:
        raise ValueError(f"--ip-mode must be loopback, auto, iface:NAME or an IPv4 address, got {ip_mode!r}")
    return ip_mode


def ray_start_command(role: str, node_name: str, ip: str, ports: RayNodePorts, temp_dir: str,
                      head_address: str | None, num_cpus: int | None, num_gpus: int | None,
                      object_store_bytes: int | None) -> list[str]:
    """`ray start --block` for one node, with every port and the temp dir pinned."""
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
           "--node-ip-address", ip, "--node-name", node_name, "--temp-dir", temp_dir,
           "--node-manager-port", str(ports.node_manager),
           "--object-manager-port", str(ports.object_manager),
           "--runtime-env-agent-port", str(ports.runtime_env_agent),
           "--dashboard-agent-grpc-port", str(ports.dashboard_agent_grpc),
           "--dashboard-agent-listen-port", str(ports.dashboard_agent_listen),
           "--metrics-export-port", str(ports.metrics_export),
           "--min-worker-port", str(ports.min_worker), "--max-worker-port", str(ports.max_worker),
           "--disable-usage-stats"]
    if role == "head":
        cmd += ["--head", "--port", str(ports.gcs), "--ray-client-server-port", str(ports.ray_client_server),
                "--include-dashboard", "false", "--dashboard-port", str(ports.dashboard),
                "--dashboard-host", ip]
    elif role == "worker":
        if not head_address:
            raise ValueError("a worker node needs --head-address IP:PORT")
        cmd += ["--address", head_address]
    else:
        raise ValueError(f"--role must be head or worker, got {role!r}")
    if num_cpus is not None:
        cmd += ["--num-cpus", str(num_cpus)]
    if num_gpus is not None:
        cmd += ["--num-gpus", str(num_gpus)]
    if object_store_bytes:
        cmd += ["--object-store-memory", str(object_store_bytes)]
    return cmd


def ray_processes(temp_dir: str) -> list:
    """This node's Ray processes: those whose command line names a path inside `temp_dir`
    (raylet, gcs_server, agents, log monitor, dashboard), plus all their descendants (workers rename
    themselves `ray::...`, so they are found through their raylet)."""
    import psutil

    marker = temp_dir.rstrip("/") + "/"
    me = os.getpid()
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if proc.pid != me and any(marker in part for part in cmdline):
            found[proc.pid] = proc
            try:
                for child in proc.children(recursive=True):
                    if child.pid != me:
                        found[child.pid] = child
            except psutil.Error:
                pass
    return list(found.values())


def stop_ray_processes(temp_dir: str, grace_s: float = 10.0, also: list | None = None) -> int:
    """SIGTERM this node's Ray processes (raylet first, GCS last, like `ray stop`), SIGKILL what is
    left after `grace_s`. `also`: more psutil.Process objects known to belong to this node (e.g.
    workers orphaned by a raylet that already died). Returns how many were found."""
    import psutil

    procs = {p.pid: p for p in ray_processes(temp_dir)}
    for proc in also or []:
        if proc.is_running():  # psutil checks the create time: a reused pid is not ours
            procs.setdefault(proc.pid, proc)
    procs = list(procs.values())
    if not procs:
        return 0

    def bucket(proc) -> int:
        try:
            name = proc.name()
        except psutil.Error:
            return 1
        return 0 if name == "raylet" else 2 if name == "gcs_server" else 1

    # raylet first (its workers follow it), the GCS last: agents that lose the GCS first retry
    # for a long time instead of exiting (same order as `ray stop`)
    killed = 0
    for which in (0, 1, 2):
        group = [p for p in procs if bucket(p) == which]
        for proc in group:
            try:
                proc.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(group, timeout=grace_s)
        for proc in alive:
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5)
        killed += len(alive)
    logger.info("stopped %d Ray processes of %s (%d needed SIGKILL)", len(procs), temp_dir, killed)
    return len(procs)


def ports_in_use(ports: RayNodePorts, role: str) -> list[int]:
    """The fixed ports of this node that something else already holds. Ray itself notices only
    after a minute of retries; checking first lets the job fail in seconds, naming the port."""
    fixed = [ports.node_manager, ports.object_manager, ports.runtime_env_agent, ports.dashboard_agent_grpc,
             ports.dashboard_agent_listen, ports.metrics_export]
    if role == "head":
        fixed = [ports.gcs, ports.ray_client_server, ports.dashboard] + fixed
    taken = []
    for port in fixed:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("0.0.0.0", port))  # the GCS and the raylet listen on all addresses
            except OSError:
                taken.append(port)
    return taken


def _log_tail(temp_dir: str, lines: int = 15) -> str:
    """The end of the Ray daemon error logs, to say why a node did not start."""
    out = []
    for log in sorted(Path(temp_dir).glob("session_2*/logs/*")):  # not session_latest (a link)
        if log.name.startswith(("raylet", "gcs_server")) and log.suffix in (".err", ".out") and log.is_file():
            text = [line for line in log.read_text(errors="replace").strip().splitlines()
                    if "(+0x" not in line and "__libc_start_main" not in line][-lines:]  # no backtraces
            if text:
                out.append(f"--- {log}\n" + "\n".join(text))
    return "\n".join(out)


def run_node(args: argparse.Namespace) -> int:
    """Start this node's Ray (`ray start --block`) and keep it up until a signal (TERM, INT, HUP,
    USR1: srun forwards only USR1/USR2 to its task without killing the step), then stop
    exactly its processes and delete its temp dir. Exits non-zero when Ray dies on its own."""
    ip = node_ip(args.ip_mode, args.node_index)
    ports = node_ports(args.port_base, args.node_index, args.ip_mode == "loopback")
    stop_requested: list[int] = []

    def on_signal(signum, _frame):
        stop_requested.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, on_signal)

    taken = ports_in_use(ports, args.role)
    if taken:
        logger.error("node %s: Ray %s cannot start: port(s) %s already in use (pick another --ray-port-base)",
                     args.node_name, args.role, taken)
        return 5
    if args.role == "worker":
        waited = _wait_for_head(args, stop_requested)
        if waited is not None:
            return waited
    Path(args.temp_dir).mkdir(parents=True, exist_ok=True)
    cmd = ray_start_command(args.role, args.node_name, ip, ports, args.temp_dir,
                            args.head_address, _num_cpus(args), args.num_gpus, args.object_store_bytes)
    logger.info("node %s (%s) starting Ray %s at %s: %s", args.node_name, args.node_index, args.role, ip,
                " ".join(cmd))
    import psutil  # node helper: only once Ray is to be started

    me = psutil.Process()
    known: dict[int, psutil.Process] = {}  # every process Ray started here, even after reparenting
    child, rc = _supervise(args, cmd, _ray_env(args, ip), stop_requested, me, known)
    if stop_requested:
        logger.info("node %s: signal %d, stopping Ray", args.node_name, stop_requested[0])
    return _stop_node(args, child, me, known, rc)


def _ray_env(args: argparse.Namespace, ip: str) -> dict[str, str]:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", HYBRIDRL_NODE_NAME=args.node_name,
               HYBRIDRL_NODE_IP=ip)
    env.setdefault("RAY_AUTH_MODE", "disabled")  # every node and the driver must agree (a mismatch: minutes of retries)
    # Ray's startup waits (agent port files, node registration) are tight for busy nodes
    env.setdefault("RAY_agent_register_timeout_ms", "120000")
    env.setdefault("RAY_worker_niceness", "0")  # workers are the compute: not below Ray's own daemons
    env.setdefault("RAY_raylet_start_wait_time_s", "120")
    if args.ip_mode == "loopback":
        env["GLOO_SOCKET_IFNAME"] = "lo"  # collectives between the fake nodes stay on loopback
    return env


def _wait_for_head(args: argparse.Namespace, stop_requested: list[int]) -> int | None:
    """A worker node waits for the head's port: None once reachable, else the exit code (0 when stopped)."""
    deadline = time.monotonic() + args.head_timeout
    while not tcp_reachable(args.head_address):
        if stop_requested:
            return 0
        if time.monotonic() > deadline:
            logger.error("node %s: Ray head at %s not reachable after %.0f s; not joining",
                         args.node_name, args.head_address, args.head_timeout)
            return 3
        time.sleep(0.5)
    return None


def _num_cpus(args: argparse.Namespace) -> int | None:
    if args.num_cpus is None and os.environ.get("SLURM_JOB_CPUS_PER_NODE"):
        # what Slurm gave this job on this node, not the whole machine (Ray's own guess)
        per_node = slurm_cpus_per_node(os.environ["SLURM_JOB_CPUS_PER_NODE"])
        return per_node[min(args.node_index, len(per_node) - 1)]
    return args.num_cpus


def _supervise(args: argparse.Namespace, cmd: list[str], env: dict[str, str], stop_requested: list[int], me: Any,
               known: dict) -> tuple[subprocess.Popen, int]:
    """Run `ray start --block` until a signal; when Ray dies on its own, start it again up to
    --start-attempts times. Returns the last child and the exit code so far."""
    rc = 0
    for attempt in range(1, args.start_attempts + 1):
        child = subprocess.Popen(cmd, env=env)
        rc = _watch(child, stop_requested, me, known)
        if stop_requested:
            break
        # Ray died on its own. On a crowded node its start can time out (an agent that imports
        # too slowly); one more try usually succeeds, and a worker can rejoin a live head.
        logger.log(logging.ERROR if attempt == args.start_attempts else logging.WARNING,
                   "node %s: Ray %s exited on its own (rc %s, attempt %d/%d)\n%s", args.node_name, args.role,
                   rc, attempt, args.start_attempts, _log_tail(args.temp_dir))
        if attempt == args.start_attempts:
            break
        stop_ray_processes(args.temp_dir, grace_s=args.grace, also=list(known.values()))
        subprocess.run(["rm", "-rf", args.temp_dir], check=False)
        Path(args.temp_dir).mkdir(parents=True, exist_ok=True)
        logger.info("node %s: starting Ray %s again", args.node_name, args.role)
    return child, rc


def _watch(child: subprocess.Popen, stop_requested: list[int], me: Any, known: dict) -> int:
    """Wait for a signal or the child's exit, recording every process Ray starts; the child's code or 0."""
    import psutil  # node helper: only once Ray is to be started

    while not stop_requested:
        try:
            known.update((p.pid, p) for p in me.children(recursive=True))
        except psutil.Error:
            pass
        rc_child = child.poll()
        if rc_child is not None and not stop_requested:
            return rc_child or 1
        time.sleep(0.5)
    return 0


def _stop_node(args: argparse.Namespace, child: subprocess.Popen, me: Any, known: dict, rc: int) -> int:
    """Stop exactly this node's Ray processes and delete its temp dir; non-zero when any survived."""
    stopped = stop_ray_processes(args.temp_dir, grace_s=args.grace,
                                 also=list(known.values()) + me.children(recursive=True))
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(timeout=args.grace)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    left = ray_processes(args.temp_dir)
    if left:
        logger.error("node %s: %d Ray processes survived the stop: %s", args.node_name, len(left),
                     [p.pid for p in left])
        rc = rc or 4
    if not args.keep_temp_dir:
        subprocess.run(["rm", "-rf", args.temp_dir], check=False)
        try:
            Path(args.temp_dir).parent.rmdir()  # the job's dir, once the last node on this host is done
        except OSError:
            pass
    logger.info("node %s: Ray stopped (%d processes were still running), %d left", args.node_name,
                stopped, len(left))
    return rc


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ip-mode", default="auto",
                        help="loopback | auto | iface:NAME | an IPv4 address (see node_ip)")
    parser.add_argument("--node-index", type=int, default=0, help="0 for the head node")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hybridrl.launch.ray_node", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="action", required=True)

    ip = sub.add_parser("ip", help="print this node's address")
    add_common(ip)

    ports = sub.add_parser("port-base", help="print the default Ray port base for a job")
    ports.add_argument("--job-id", type=int, required=True)
    ports.add_argument("--nodes", type=int, required=True)
    ports.add_argument("--loopback", action="store_true")

    start = sub.add_parser("start", help="run this node's Ray until SIGTERM")
    add_common(start)
    start.add_argument("--role", choices=["head", "worker"], required=True)
    start.add_argument("--node-name", required=True)
    start.add_argument("--port-base", type=int, required=True)
    start.add_argument("--temp-dir", required=True, help="this node's own Ray temp dir (keep it short)")
    start.add_argument("--head-address", help="IP:PORT of the head's GCS (workers)")
    start.add_argument("--head-timeout", type=float, default=120.0, help="seconds a worker waits for the head")
    start.add_argument("--num-cpus", type=int)
    start.add_argument("--num-gpus", type=int)
    start.add_argument("--object-store-bytes", type=int)
    start.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    start.add_argument("--start-attempts", type=int, default=2, help="tries when Ray dies on its own")
    start.add_argument("--keep-temp-dir", action="store_true", help="keep Ray's logs after the stop")

    stop = sub.add_parser("stop", help="stop the Ray processes of one temp dir")
    stop.add_argument("--temp-dir", required=True)
    stop.add_argument("--grace", type=float, default=10.0)

    wait = sub.add_parser("wait", help="wait until every node joined the cluster, or fail saying which")
    wait.add_argument("--address", required=True, help="IP:PORT of the head's GCS")
    wait.add_argument("--nodes", required=True, help="comma-separated node names, head first")
    wait.add_argument("--gpus-per-node", type=int, default=0)
    wait.add_argument("--timeout", type=float, default=180.0)
    wait.add_argument("--watch", action="append", default=[], metavar="NODE=PID",
                      help="fail at once when this node's start process (e.g. its srun) has exited")
    wait.add_argument("--log-hint", default="", help="where the node logs are, for error messages")
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        if args.action == "ip":
            print(node_ip(args.ip_mode, args.node_index))
        elif args.action == "port-base":
            print(default_port_base(args.job_id, args.nodes, args.loopback))
        elif args.action == "start":
            return run_node(args)
        elif args.action == "stop":
            stop_ray_processes(args.temp_dir, grace_s=args.grace)
            return 1 if ray_processes(args.temp_dir) else 0
        elif args.action == "wait":
            watch = {}
            for item in args.watch:
                name, _, pid = item.partition("=")
                watch[name] = int(pid)
            try:
                wait_for_cluster(args.address, args.nodes.split(","), args.gpus_per_node, args.timeout,
                                 watch, args.log_hint)
            except ClusterNotReady as exc:
                logger.error("%s", exc)
                return 3
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

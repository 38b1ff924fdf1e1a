"""WorkerGroup: a role (actor, ref, critic, reward, ...) on a ResourcePool, called like one object.

Each @register-ed method of the role's Worker class becomes a group method: calling it dispatches
the arguments to the ranks (see dispatch.py), and either waits for the collected result
(blocking) or returns a GroupFuture. `.remote(...)` always returns a future, so calls on
different pools overlap and the driver waits on them together (`wait_all`).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import cloudpickle

from hybridrl.controller.dispatch import CallPlan, Dispatch, MethodSpec, plan_call, registered_methods
from hybridrl.controller.interrupts import Interrupted, raise_if_requested
from hybridrl.controller.resource_pool import ResourcePool
from hybridrl.controller.watchdog import WATCHDOG
from hybridrl.controller.worker import RemoteFailure, Worker, WorkerHost
from hybridrl.parallel.layout import ParallelLayout
from hybridrl.protocol import Batch

logger = logging.getLogger(__name__)

DEFAULT_CALL_TIMEOUT_S = 3600.0
DEFAULT_START_TIMEOUT_S = 300.0
START_SECONDS_PER_BILLION_PARAMS = 30.0  # a cold start reads the weights, builds models, starts vLLM


def start_timeout_for(parameters: int) -> float:
    """How long a role of a model with this many parameters may take to start (trainer.start_timeout_s unset)."""
    return DEFAULT_START_TIMEOUT_S + START_SECONDS_PER_BILLION_PARAMS * parameters / 1e9
_POLL_S = 0.5  # how often a waiting driver checks for a failed rank while others still run


class WorkerError(RuntimeError):
    """An exception inside a worker: names the role, rank and method and carries the remote traceback."""

    def __init__(self, role: str, rank: int | None, method: str, cause: str, remote_traceback: str = "") -> None:
        self.role, self.rank, self.method, self.cause = role, rank, method, cause
        self.remote_traceback = remote_traceback
        where = f"role {role!r} rank {rank}" if rank is not None else f"role {role!r}"
        text = f"{where}: {method} failed: {cause}"
        super().__init__(text + (f"\n--- remote traceback (rank {rank}) ---\n{remote_traceback}" if remote_traceback else ""))


class WorkerDiedError(WorkerError):
    """A worker process died (killed, OOM, crashed) during or before the call."""


class WorkerTimeoutError(WorkerError, TimeoutError):
    """A call did not finish within its timeout (ranks still pending are in .rank / the message)."""


class WorkerHungError(WorkerDiedError):
    """A call made no progress within the hang watchdog's limit (controller/watchdog.py); recovered like a
    dead worker."""


PEER_DEATH_GRACE_S = 5.0  # how long a rank's error waits for a peer's death to show (_raise_if_a_peer_dies)


def _poll_ranks(refs: dict[int, Any], results: dict[int, Any], role: str, method: str, wait_s: float) -> bool:
    """Wait up to wait_s for the ranks not yet in `results`; store what finished. Raises at the FIRST
    failed or dead rank instead of waiting for the others (which may hang in a collective with it).
    Returns True when every rank has a result."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    raise_if_requested()  # SIGINT / SIGTERM of the driver (controller/interrupts.py)
    pending = {ref: rank for rank, ref in refs.items() if rank not in results}
    if not pending:
        return True
    pending_refs = list(pending)
    try:  # the common case in one round trip: everything finishes within wait_s
        values = dict(zip(pending_refs, ray.get(pending_refs, timeout=wait_s)))
        ready = pending_refs
    except Exception:  # noqa: BLE001 - not all done, or one failed: take what is ready, rank by rank
        ready, _ = ray.wait(pending_refs, num_returns=len(pending_refs), timeout=0)
        values = {}
    failures = []
    for ref in ready:  # every ready rank first: a dead one outranks another's error
        rank = pending.pop(ref)
        try:
            value = values[ref] if ref in values else ray.get(ref, timeout=60)
        except RayActorError as exc:
            raise WorkerDiedError(role, rank, method, f"worker process died ({death_summary(exc)})") from exc
        except RayTaskError as exc:  # the host itself failed (not the role's code)
            raise WorkerError(role, rank, method, str(exc).splitlines()[0], str(exc)) from exc
        except GetTimeoutError as exc:
            raise WorkerTimeoutError(role, rank, method, f"result of rank {rank} could not be fetched") from exc
        if isinstance(value, RemoteFailure):
            failures.append(value)
        else:
            results[rank] = value
    if failures:
        _raise_if_a_peer_dies(pending, role, method)
        first = failures[0]
        raise WorkerError(first.role, first.rank, first.method, f"{first.exc_type}: {first.message}", first.traceback)
    return not pending


def death_summary(exc: BaseException) -> str:
    """Ray's multi-line ActorDiedError as one line: the process (pid, address) and Ray's reason for its death."""
    fields, reason = {}, []
    for line in str(exc).splitlines()[1:]:
        key, sep, value = line.strip().partition(": ")
        if line.startswith("\t") and sep and key in ("pid", "ip"):
            fields[key] = value
        elif line.strip() and not line.startswith("\t"):
            reason.append(line.strip())
    where = " ".join(f"{k} {v}" for k, v in fields.items())
    text = " ".join(reason) or (str(exc).splitlines() or [type(exc).__name__])[0]
    text = text.split(" Some common causes include")[0]  # Ray's advice paragraph; the cause stays
    return f"{where}: {text}" if where else text


def _raise_if_a_peer_dies(pending: dict[Any, int], role: str, method: str) -> None:
    """A rank's collective fails ("Connection reset by peer") when a peer process dies, often before Ray has
    noticed the death. If a rank still pending dies within PEER_DEATH_GRACE_S, that death is the error to report
    (a WorkerDiedError, which the trainer recovers from), not its symptom on the living rank."""
    import ray
    from ray.exceptions import RayActorError

    waiting = list(pending)
    deadline = time.monotonic() + PEER_DEATH_GRACE_S
    while waiting and time.monotonic() < deadline:
        done, waiting = ray.wait(waiting, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        for ref in done:
            try:
                ray.get(ref, timeout=0)
            except RayActorError as exc:
                raise WorkerDiedError(role, pending[ref], method, f"worker process died ({death_summary(exc)})") \
                    from exc
            except Exception:  # noqa: BLE001 - another failure or a result: the first error stands
                pass


def _raise_timeout(refs: dict[int, Any], results: dict[int, Any], role: str, method: str, timeout_s: float):
    ranks = sorted(set(refs) - set(results))
    raise WorkerTimeoutError(role, ranks[0], method, f"ranks {ranks} did not finish within {timeout_s:g}s "
                             "(raise call_timeout_s / the method's timeout_s if that is expected)")


def _wait_ranks(refs: dict[int, Any], role: str, method: str, timeout_s: float | None,
                results: dict[int, Any] | None = None) -> dict[int, Any]:
    """All ranks' results (rank -> value), failing fast on an error, a dead worker or the timeout."""
    results = {} if results is None else results
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            _raise_timeout(refs, results, role, method, timeout_s)
        if _poll_ranks(refs, results, role, method, _POLL_S if remaining is None else min(_POLL_S, remaining)):
            return results


class GroupFuture:
    """The pending result of one group call; `result()` waits, collects and caches it."""

    def __init__(self, role: str, method: str, refs: dict[int, Any], collect: Callable[[dict[int, Any]], Any],
                 timeout_s: float | None, on_failure: Callable[[], None] = lambda: None,
                 pids: dict[int, int] | None = None) -> None:
        self.role, self.method, self.refs, self._collect, self.timeout_s = role, method, refs, collect, timeout_s
        self._on_failure, self._pids = on_failure, pids or {}
        self.hang_s = WATCHDOG.limit(self._key)
        self._results: dict[int, Any] = {}
        self._done = False
        self._value: Any = None
        self._started = time.monotonic()

    @property
    def _key(self) -> str:
        return f"{self.role}.{self.method}"

    def result(self, timeout_s: float | None = None) -> Any:
        if not self._done:
            limit = timeout_s or self.timeout_s
            watched = self.hang_s is not None and (limit is None or self.hang_s < limit)
            try:
                try:
                    if watched:  # the hang limit counts from submission
                        limit = max(0.1, self.hang_s - (time.monotonic() - self._started))
                    _wait_ranks(self.refs, self.role, self.method, limit, self._results)
                except WorkerTimeoutError:
                    if watched:
                        self._hung()
                    raise
            except (WorkerError, Interrupted):  # a call may still run: closing must not queue behind it
                self._on_failure()
                raise
            self._finish()
        return self._value

    def _finish(self) -> None:
        self._value, self._done = self._collect(self._results), True
        WATCHDOG.record(self._key, time.monotonic() - self._started)

    def _hung(self) -> None:
        pending = sorted(set(self.refs) - set(self._results))
        stacks = WATCHDOG.dump_stacks(self._key, self._pids)
        self._on_failure()
        raise WorkerHungError(self.role, pending[0], self.method,
                              f"ranks {pending} made no progress for {self.hang_s:.0f}s (trainer.hang_timeout_s, "
                              f"scaled to the slowest calls so far)" + (f"; every rank's stack in {stacks}" if stacks
                                                                        else ""))

    def done(self) -> bool:
        """True when every rank has finished (failures raise here too)."""
        try:
            if not self._done and _poll_ranks(self.refs, self._results, self.role, self.method, 0):
                self._finish()
        except (WorkerError, Interrupted):  # a call may still run: closing must not queue behind it
            self._on_failure()
            raise
        return self._done

    def __repr__(self) -> str:
        return f"GroupFuture({self.role}.{self.method}, ranks={sorted(self.refs)})"


def wait_all(futures: list[GroupFuture], timeout_s: float | None = None) -> list[Any]:
    """Results of several futures (e.g. on different pools) waited on together; any failure raises at once.

    Each future also keeps its own timeout (the call's timeout_s), counted from its submission."""
    import ray

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        pending = [f for f in futures if not f.done()]
        if not pending:
            return [f.result() for f in futures]
        now = time.monotonic()
        for future in pending:
            if future.timeout_s is not None and now - future._started > future.timeout_s:
                _raise_timeout(future.refs, future._results, future.role, future.method, future.timeout_s)
            if future.hang_s is not None and now - future._started > future.hang_s:
                future._hung()
        if deadline is not None and now > deadline:
            raise WorkerTimeoutError(pending[0].role, None, "wait_all", f"{pending} not done within {timeout_s:g}s")
        refs = [ref for f in pending for rank, ref in f.refs.items() if rank not in f._results]
        ray.wait(refs, num_returns=len(refs), timeout=_POLL_S)


class _PoolHosts:
    """The per-device host actors of one pool, joined in one process group (created on first use)."""

    def __init__(self, pool: ResourcePool, start_timeout_s: float, process_group_timeout_s: float) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.pool = pool
        host_cls = ray.remote(WorkerHost)
        self.actors = []
        for rank, (group, bundle, local_rank) in enumerate(pool.bundles()):
            strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=bundle)
            # named for the cluster's actor table (launch/actor_report.py: which pool ran where)
            name = f"hybridrl:{pool.name}:rank{rank}:{id(self):x}"
            self.actors.append(host_cls.options(num_cpus=0, num_gpus=1, scheduling_strategy=strategy,
                                                max_restarts=0, name=name).remote(
                pool.name, rank, pool.world_size, local_rank, pool.local_world_size(rank)))
        what = f"pool {pool.name!r} start"
        try:
            self.info = _wait_ranks({r: a.info.remote() for r, a in enumerate(self.actors)}, pool.name, what,
                                    start_timeout_s)
            address, port = _wait_ranks({0: self.actors[0].open_rendezvous.remote(one_node_cluster())}, pool.name,
                                        what, start_timeout_s)[0]
            _wait_ranks({r: a.init_process_group.remote(address, port, process_group_timeout_s)
                         for r, a in enumerate(self.actors)}, pool.name, "init_process_group", start_timeout_s)
        except BaseException:
            self.kill()  # no half-started pool keeps devices
            raise
        self.master = (address, port)
        here = ray.util.get_node_ip_address()
        self.local_pids = {rank: i["pid"] for rank, i in self.info.items() if i["node_ip"] == here}  # stack dumps
        self.layout: ParallelLayout | None = None
        self.roles: set[str] = set()
        # a call failed on some rank: its peers may be blocked in a collective with it for the process-group
        # timeout, and any call queued behind that would wait as long; the processes are killed instead
        self.failed = False
        logger.info("pool %r: %d workers in one %s:%d process group", pool.name, len(self.actors), address, port)

    def mark_failed(self) -> None:
        self.failed = True

    def kill(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        # ray.kill only asks; waiting for this node's hosts to be gone keeps Ray's own shutdown, right after,
        # from SIGTERMing them half-way through their exit
        _wait_exited(getattr(self, "local_pids", {}).values(), timeout_s=10)


def one_node_cluster() -> bool:
    """Whether the Ray cluster is one machine: then every rendezvous and collective listens on loopback only."""
    import ray

    return sum(1 for node in ray.nodes() if node.get("Alive")) == 1


def _wait_exited(pids, timeout_s: float) -> None:
    import psutil

    processes = []
    for pid in pids:
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=timeout_s)


class WorkerGroup:
    """One role on a pool: a Worker object on every device, its @register methods as group calls.

    Roles on the same pool share its host processes (devices, process group, Megatron state), so
    they must share one layout. The layout defaults to pure data parallelism over the pool.
    """

    def __init__(self, pool: ResourcePool, worker_cls: type[Worker], layout: ParallelLayout | None = None,
                 role: str | None = None, init_args: tuple = (), init_kwargs: dict | None = None,
                 call_timeout_s: float | None = DEFAULT_CALL_TIMEOUT_S, init_megatron: bool = True,
                 seed: int = 1234, start_timeout_s: float | None = None,
                 process_group_timeout_s: float = 600.0) -> None:
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
            raise TypeError(f"WorkerGroup: worker_cls must subclass hybridrl.controller.Worker, got {worker_cls!r}")
        layout = layout or ParallelLayout(dp=pool.world_size)
        layout.check_world_size(pool.world_size)
        role = role or worker_cls.__name__
        hosts = pool._hosts
        if hosts is not None:
            if role in hosts.roles:
                raise ValueError(f"pool {pool.name!r} already has a role named {role!r}; pass role=<another name>")
            if init_megatron and hosts.layout is not None and hosts.layout != layout:
                raise ValueError(f"role {role!r}: pool {pool.name!r} holds Megatron state for layout "
                                 f"({hosts.layout.describe()}), not ({layout.describe()}); colocated roles share "
                                 "one layout: use the same layout or put this role on its own ResourcePool")
        self.methods = registered_methods(worker_cls)
        clash = [name for name in self.methods if hasattr(WorkerGroup, name)]
        if clash:
            raise ValueError(f"{worker_cls.__name__}: registered method(s) {clash} clash with WorkerGroup attributes; rename them")
        self.pool, self.layout, self.role, self.call_timeout_s = pool, layout, role, call_timeout_s
        start_timeout_s = pool.start_timeout_s if start_timeout_s is None else start_timeout_s
        if hosts is None:
            hosts = pool._hosts = _PoolHosts(pool, start_timeout_s, process_group_timeout_s)
        self._hosts = hosts
        actors = hosts.actors
        if init_megatron and hosts.layout is None:
            _wait_ranks({r: a.init_model_parallel.remote(layout, seed) for r, a in enumerate(actors)}, role,
                        "init_model_parallel", start_timeout_s)
            hosts.layout = layout
        cls_bytes = cloudpickle.dumps(worker_cls)
        _wait_ranks({r: a.add_role.remote(role, cls_bytes, layout, tuple(init_args), dict(init_kwargs or {}))
                     for r, a in enumerate(actors)}, role, "__init__", start_timeout_s)
        hosts.roles.add(role)
        for name, spec in self.methods.items():
            setattr(self, name, GroupMethod(self, name, spec))

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def rendezvous_address(self) -> tuple[str, int]:
        """A free (host, port) on rank 0's node: where a group spanning this pool and another one meets."""
        return _wait_ranks({0: self._hosts.actors[0].publish_master_address.remote(one_node_cluster())}, self.role,
                           "rendezvous_address", self.call_timeout_s)[0]

    @property
    def worker_info(self) -> list[dict]:
        """Per rank: pid, node ip, CUDA_VISIBLE_DEVICES, Ray GPU ids, thread count."""
        return [self._hosts.info[rank] for rank in range(len(self._hosts.info))]

    def close(self) -> None:
        """Remove this role from the pool's processes (the processes and process group stay for other roles)."""
        hosts = self._hosts
        if hosts.failed and hosts.actors:  # no graceful removal: ranks may hang in a collective (see failed)
            hosts.kill()
        if self.role in hosts.roles and hosts.actors:
            _wait_ranks({r: a.remove_role.remote(self.role) for r, a in enumerate(hosts.actors)}, self.role,
                        "close", self.call_timeout_s)
            hosts.roles.discard(self.role)
            if not hosts.roles:
                hosts.layout = None

    def call(self, method: str, *args: Any, dispatch: Dispatch | str = Dispatch.ONE_TO_ALL,
             timeout_s: float | None = None, **kwargs: Any) -> GroupFuture:
        """Call any worker method with an explicit dispatch mode; returns a future."""
        return self._submit(method, MethodSpec(dispatch, False, timeout_s), args, kwargs)

    def _submit(self, method: str, spec: MethodSpec, args: tuple, kwargs: dict) -> GroupFuture:
        import ray

        if self.role not in self._hosts.roles:
            raise WorkerError(self.role, None, method, "this WorkerGroup was closed")
        if not self._hosts.actors:
            raise WorkerDiedError(self.role, None, method, f"pool {self.pool.name!r} was shut down")
        plan: CallPlan = plan_call(spec, self.layout, f"{self.role}.{method}", args, kwargs)
        # Put each distinct payload once: ranks that get the same shard read one object-store copy.
        stored: dict[int, Any] = {}

        def stored_ref(value: Any) -> Any:
            if isinstance(value, Batch):
                if id(value) not in stored:
                    stored[id(value)] = ray.put(value)
                return stored[id(value)]
            return value

        refs = {}
        for rank, (rank_args, rank_kwargs) in plan.rank_args.items():
            keep = plan.keep_ranks is None or rank in plan.keep_ranks
            refs[rank] = self._hosts.actors[rank].call.remote(
                self.role, method, keep, *[stored_ref(a) for a in rank_args],
                **{k: stored_ref(v) for k, v in rank_kwargs.items()})
        return GroupFuture(self.role, method, refs, plan.collect, spec.timeout_s or self.call_timeout_s,
                           self._hosts.mark_failed, self._hosts.local_pids)

    def __repr__(self) -> str:
        return f"WorkerGroup(role={self.role!r}, pool={self.pool.name!r}, layout=({self.layout.describe()}))"


class GroupMethod:
    """A registered worker method seen from the driver. Call it, or `.remote(...)` for a future."""

    def __init__(self, group: WorkerGroup, name: str, spec: MethodSpec) -> None:
        self.group, self.name, self.spec = group, name, spec

    def remote(self, *args: Any, **kwargs: Any) -> GroupFuture:
        return self.group._submit(self.name, self.spec, args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        future = self.remote(*args, **kwargs)
        return future.result() if self.spec.blocking else future


def create_colocated_worker_group(pool: ResourcePool, roles: dict[str, type[Worker] | tuple],
                                  layout: ParallelLayout | None = None, **group_kwargs: Any) -> dict[str, WorkerGroup]:
    """Several roles in the same processes of one pool (HybridFlow's default placement).

    roles maps a name to a Worker class or (class, init_args[, init_kwargs]). Returns one group per role.
    """
    groups = {}
    for name, spec in roles.items():
        cls, init_args, init_kwargs = (spec, (), {}) if isinstance(spec, type) else (*spec, {})[:3]
        groups[name] = WorkerGroup(pool, cls, layout=layout, role=name, init_args=init_args,
                                   init_kwargs=init_kwargs, **group_kwargs)
    return groups

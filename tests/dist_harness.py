"""Long-lived pools of real torch.distributed (gloo) processes for multi-process tests.

A pool starts `world_size` spawned processes once (one default process group), then runs many
test functions on every rank. Each call has a timeout: on expiry every rank dumps its Python stacks
(faulthandler), the pool is torn down and the test fails with those stacks, so a deadlock fails fast.
"""
from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import cloudpickle

ROOT = Path(__file__).resolve().parent.parent


def _worker_main(rank: int, world_size: int, port: int, conn, stack_file: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    with open(stack_file, "w") as dump:
        faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
        import torch

        torch.set_num_threads(1)
        from hybridrl.parallel.distributed import init_distributed

        try:
            init_distributed(rank, world_size, "127.0.0.1", port)
            conn.send(("ok", None))
        except BaseException:  # noqa: BLE001 - report any start failure to the parent
            conn.send(("error", traceback.format_exc()))
            return
        while True:
            message = conn.recv()
            if message is None:
                break
            fn, args, kwargs = cloudpickle.loads(message)
            try:
                result = fn(*args, **kwargs)
                conn.send(("ok", cloudpickle.dumps(result)))
            except BaseException:  # noqa: BLE001 - the parent re-raises with rank and traceback
                conn.send(("error", traceback.format_exc()))
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class DistPool:
    def __init__(self, world_size: int, timeout_s: float = 180.0):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._procs: list = []
        self._conns: list = []
        self._stack_files: list[str] = []
        self._start()

    def _start(self) -> None:
        from hybridrl.parallel.distributed import free_port

        ctx = mp.get_context("spawn")
        port = free_port()
        tmp = tempfile.mkdtemp(prefix="distpool-")
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe()
            stack_file = os.path.join(tmp, f"stack-{rank}.txt")
            proc = ctx.Process(target=_worker_main, args=(rank, self.world_size, port, child_conn, stack_file),
                               daemon=True)
            proc.start()
            self._procs.append(proc)
            self._conns.append(parent_conn)
            self._stack_files.append(stack_file)
        self._collect(timeout_s=self.timeout_s, what="process-group start")

    def run(self, fn, *args, timeout_s: float | None = None, **kwargs) -> list:
        """Run fn(*args, **kwargs) on every rank; return the per-rank results in rank order."""
        if not self._procs:
            self._start()
        payload = cloudpickle.dumps((fn, args, kwargs))
        for conn in self._conns:
            conn.send(payload)
        return self._collect(timeout_s or self.timeout_s, what=getattr(fn, "__name__", str(fn)))

    def _collect(self, timeout_s: float, what: str) -> list:
        deadline = time.monotonic() + timeout_s
        results: list = [None] * self.world_size
        errors: list[str] = []
        pending = set(range(self.world_size))
        while pending:
            for rank in sorted(pending):
                conn = self._conns[rank]
                if conn.poll(0.05):
                    status, value = conn.recv()
                    pending.discard(rank)
                    if status == "ok":
                        results[rank] = cloudpickle.loads(value) if value is not None else None
                    else:
                        errors.append(f"--- rank {rank} raised ---\n{value}")
                elif not self._procs[rank].is_alive():
                    pending.discard(rank)
                    errors.append(f"--- rank {rank} died (exit code {self._procs[rank].exitcode}) ---")
            if errors and pending:
                # The others are probably stuck in a collective with the failed rank: give them a moment.
                deadline = min(deadline, time.monotonic() + 5.0)
            if pending and time.monotonic() > deadline:
                stacks = self._dump_stacks(pending)
                self.close()
                raise TimeoutError(f"{what}: ranks {sorted(pending)} did not finish within {timeout_s:.0f}s\n"
                                   + "\n".join(errors) + stacks)
        if errors:
            self.close()  # a failed collective leaves the group unusable: start afresh next call
            raise RuntimeError(f"{what} failed:\n" + "\n".join(errors))
        return results

    def _dump_stacks(self, ranks) -> str:
        for rank in ranks:
            if self._procs[rank].is_alive():
                os.kill(self._procs[rank].pid, signal.SIGUSR1)
        time.sleep(1.0)
        out = []
        for rank in ranks:
            try:
                out.append(f"--- rank {rank} stacks ---\n" + Path(self._stack_files[rank]).read_text()[-6000:])
            except OSError:
                pass
        return "\n" + "\n".join(out)

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs, self._conns, self._stack_files = [], [], []

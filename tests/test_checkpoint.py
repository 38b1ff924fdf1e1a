"""Checkpoints, exact resume, worker-failure recovery, the NaN policy and checkpoint -> HF export, through
the real trainer: a local Ray cluster, Megatron workers over gloo (actor at TP=2 or TP=1), the hybrid engine,
the native rollout engine and Megatron distributed checkpoints of the weights and the distributed optimizer.

One uninterrupted 6-step run (checkpoints at steps 3 and 6) is the reference the other runs are compared with.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridrl.cli.train import _outcome
from hybridrl.trainer import checkpoint as ckpt
from hybridrl.trainer.run import run_training

pytestmark = pytest.mark.slow

COMMON = ["data.batch_size=4", "rollout.n=2", "rollout.max_new_tokens=8", "actor.micro_batch_size=4",
          "ref.micro_batch_size=4", "trainer.progress_bar=false", "trainer.trackers=[]", "trainer.keep_last=3",
          "actor.parallel.tp=2", "rollout.tp=1"]
ROWS_PER_STEP = 4 * 2 + 4  # sampled responses + greedy baselines scored per step (reward calls)
HOOK_REWARD = "test_checkpoint:hooked_reward"
UNTIMED = ("time/", "tokens_per_s")  # wall-clock metrics differ between runs


# ---- a reward function with a test hook (runs on the driver: reward.num_workers=0) ---------------------------
_HOOK: dict = {"calls": 0, "nan_calls": range(0), "on_call": None, "fire_at": -1}


def hooked_reward(prompt: str, response: str, **meta) -> float:
    """The bundled task reward; NaN for the calls in _HOOK["nan_calls"]; runs _HOOK["on_call"] once at
    call number _HOOK["fire_at"] (used to kill a worker in the middle of a step)."""
    from hybridrl.data.tasks import charset_reward

    call = _HOOK["calls"]
    _HOOK["calls"] += 1
    if call == _HOOK["fire_at"] and _HOOK["on_call"] is not None:
        action, _HOOK["on_call"] = _HOOK["on_call"], None
        action()
    if call in _HOOK["nan_calls"]:
        return float("nan")
    return charset_reward(prompt, response, **meta)


def _hook() -> dict:
    """The _HOOK the trainer's reward function sees (the module as load_reward_fn imports it)."""
    from hybridrl.workers.rule_reward import load_reward_fn

    module = sys.modules[load_reward_fn(HOOK_REWARD).__module__]
    module._HOOK.update(calls=0, nan_calls=range(0), on_call=None, fire_at=-1)
    return module._HOOK


# ---- helpers -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    from hybridrl.controller import init_local_ray, shutdown_ray

    shutdown_ray()
    init_local_ray(2)
    yield
    shutdown_ray()


def _trainer(overrides: list[str]):
    from hybridrl.config import load_config
    from hybridrl.cli.train import DEFAULT_CONFIG
    from hybridrl.trainer.loop import RLTrainer
    from hybridrl.trainer.plan import plan_run

    cfg = load_config(DEFAULT_CONFIG, COMMON + overrides)  # what `hybridrl train` runs (_cli), made small
    return RLTrainer(cfg, plan_run(cfg))


def _tracker(run_dir: Path):
    from hybridrl.trainer.tracking import MetricsTracker

    return MetricsTracker(run_dir, backends=[], total_steps=6, progress_bar=False)


def _cli(overrides: list[str], capsys=None) -> tuple[int, str]:
    from hybridrl.cli.train import run

    rc = run(argparse.Namespace(config=None, overrides=COMMON + overrides, print_config=False))
    return rc, (capsys.readouterr().err if capsys is not None else "")


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(UNTIMED)}


def _assert_same_metrics(got: list[dict], want: list[dict], rel: float = 1e-5, skip: tuple = ()) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want):
        a, b = _comparable(a), _comparable(b)
        a, b = ({k: v for k, v in r.items() if k not in skip} for r in (a, b))
        assert a.keys() == b.keys(), (a.keys(), b.keys())
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=rel, abs=1e-6), (a["step"], key, a[key], b[key])


@pytest.fixture(scope="module")
def reference_run(ray_cluster, tmp_path_factory):
    """6 uninterrupted steps at actor TP=2, checkpoints at steps 3 and 6; then, from the live actor, its HF
    export and the log-probs of a fresh rollout (for the checkpoint -> HF test)."""
    run_dir = tmp_path_factory.mktemp("reference")
    trainer = _trainer(["trainer.steps=6", "trainer.save_every=3", f"trainer.run_dir={run_dir}"])
    tracker = _tracker(run_dir)
    try:
        run_training(trainer, tracker, run_dir)
        actor = trainer.roles["actor"]
        rollout = actor.generate_sequences(trainer.loader.next_batch(), seed=7)
        log_probs = actor.compute_log_probs(rollout)
        actor.save_hf(str(run_dir / "live_hf"))
    finally:
        trainer.close()
        tracker.close()
    return {"dir": run_dir, "records": _records(run_dir), "rollout": rollout.sequences, "log_probs": log_probs}


# ---- tests -----------------------------------------------------------------------------------------------------
def test_checkpoints_are_written_atomically_and_pruned(reference_run):
    run_dir = reference_run["dir"]
    assert [r["step"] for r in reference_run["records"]] == [1, 2, 3, 4, 5, 6]
    manager = ckpt.CheckpointManager(run_dir, keep_last=3)
    assert [step for step, _ in manager.steps()] == [3, 6]
    assert (run_dir / "ckpt" / "latest").read_text().strip() == "step_6"
    assert not list((run_dir / "ckpt").glob("*.tmp-*"))
    step3 = run_dir / "ckpt" / "step_3"
    for part in ("actor/model/metadata.json", "actor/model/hybridrl_model.json", "actor/optimizer/metadata.json",
                 "actor/rng/rank_00000.pt", "actor/rng/rank_00001.pt", "driver.pt"):
        assert (step3 / part).is_file(), part
    state = ckpt.load_driver_state(step3)
    assert state["step"] == 3 and state["loader"]["batch_in_epoch"] == 3 and state["algorithm"] == "remax"
    assert {"torch", "python", "numpy"} <= set(state["rng"]) and state["actor_sampling_seed"] is not None
    # keep_last prunes: only the newest one survives with keep_last=1
    pruned = run_dir.parent / "pruned"
    shutil.copytree(run_dir / "ckpt", pruned / "ckpt")
    small = ckpt.CheckpointManager(pruned, keep_last=1)
    tmp = small.begin(7)
    shutil.copytree(step3, tmp, dirs_exist_ok=True)
    small.commit(tmp, 7)
    assert [step for step, _ in small.steps()] == [7] and small.latest().name == "step_7"


def test_resume_after_step_3_matches_uninterrupted_run(reference_run, tmp_path, capsys):
    """A run stopped after step 3 (its folder as it was then, plus a save of step 6 killed midway) resumed
    with `hybridrl train trainer.resume=auto` gives the uninterrupted run's metrics at steps 4-6."""
    ref_dir = reference_run["dir"]
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir / "ckpt" / "step_3", run_dir / "ckpt" / "step_3")
    (run_dir / "ckpt" / "latest").write_text("step_3\n")
    # lines of steps 4-5 that the stopped run logged after its checkpoint: resume must drop them
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reference_run["records"][:5]))
    # a save of step 6 killed midway: shards written, no driver state, never renamed
    killed = run_dir / "ckpt" / "step_6.tmp-killed"
    shutil.copytree(ref_dir / "ckpt" / "step_6" / "actor", killed / "actor")
    (killed / "actor" / "optimizer" / "metadata.json").unlink()
    assert ckpt.CheckpointManager(run_dir).latest() == run_dir / "ckpt" / "step_3"

    rc, _ = _cli(["trainer.steps=6", "trainer.save_every=3", f"trainer.run_dir={run_dir}", "trainer.resume=auto"],
                 capsys)
    assert rc == 0
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # one line per step, none repeated
    _assert_same_metrics(records, reference_run["records"])
    # same prompts: the loader position and the driver state at step 6 equal the uninterrupted run's
    resumed, reference = (ckpt.load_driver_state(d / "ckpt" / "step_6") for d in (run_dir, ref_dir))
    assert resumed["loader"] == reference["loader"] and resumed["kl_ctrl"] == reference["kl_ctrl"]
    assert resumed["actor_sampling_seed"] == reference["actor_sampling_seed"]
    assert not killed.exists()  # the next save cleared the interrupted one


def test_tp2_checkpoint_resumes_at_tp1(reference_run, tmp_path):
    """The step-3 checkpoint written at actor TP=2 (dp=1) loads at TP=1 (dp=2): weights and optimizer state
    reshard, and step 4 equals the TP=2 run's step 4 up to float rounding."""
    run_dir = tmp_path / "tp1"
    trainer = _trainer(["trainer.steps=4", "actor.parallel.tp=1", f"trainer.run_dir={run_dir}"])
    tracker = _tracker(run_dir)
    try:
        run_training(trainer, tracker, run_dir, ckpt.resolve_resume(str(reference_run["dir"] / "ckpt" / "step_3"), run_dir))
        assert trainer.roles["actor"].layout.tp == 1
    finally:
        trainer.close()
        tracker.close()
    records = _records(run_dir)
    assert [r["step"] for r in records] == [4]
    # per-token metrics are averaged per DP rank before the driver averages the ranks: at dp=2 they are not the
    # same statistic as at dp=1 (the update is: its loss is the global token mean, see grad_norm); token_fill is
    # the padding of each rank's own micro-batches, which change with the DP split
    _assert_same_metrics(records, reference_run["records"][3:4], rel=1e-4,
                         skip=("actor/pg_loss", "actor/entropy", "actor/clipfrac", "actor/approx_kl",
                               "actor/token_fill"))


def test_killed_worker_is_recovered_and_run_finishes(reference_run, tmp_path):
    """The actor's rank-0 process is killed in the middle of step 5: the driver tears the roles down,
    restarts them, reloads step 3 and finishes; steps 4-6 equal the uninterrupted run's."""
    hook = _hook()
    run_dir = tmp_path / "killed"
    trainer = _trainer(["trainer.steps=6", "trainer.save_every=3", "trainer.max_restarts=1",
                        f"trainer.run_dir={run_dir}", f"reward.fn={HOOK_REWARD}"])
    killed: list[int] = []

    def kill_actor() -> None:
        pid = trainer.roles["actor"].group.worker_info[0]["pid"]
        killed.append(pid)
        os.kill(pid, signal.SIGKILL)

    hook.update(on_call=kill_actor, fire_at=4 * ROWS_PER_STEP + 3)  # during step 5's scoring
    tracker = _tracker(run_dir)
    try:
        run_training(trainer, tracker, run_dir)
        new_pid = trainer.roles["actor"].group.worker_info[0]["pid"]
    finally:
        trainer.close()
        tracker.close()
    assert killed and new_pid != killed[0]
    records = _records(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    _assert_same_metrics(records, reference_run["records"])


def test_hung_rank_is_detected_dumped_and_recovered(ray_cluster, tmp_path):
    """Actor rank 1 is stopped (SIGSTOP) during step 3: its peer blocks in a collective with it. The watchdog
    (trainer.hang_timeout_s, far below call_timeout_s) dumps both ranks' stacks into the run folder, the pool is
    killed and the run recovers from the step-2 checkpoint and finishes."""
    hook = _hook()
    run_dir = tmp_path / "hung"
    trainer = _trainer(["trainer.steps=4", "trainer.save_every=1", "trainer.max_restarts=1", "trainer.hang_timeout_s=15",
                        "trainer.call_timeout_s=600", f"trainer.run_dir={run_dir}", f"reward.fn={HOOK_REWARD}"])
    stopped = []

    def stop_rank_1():
        stopped.append(trainer.roles["actor"].group.worker_info[1]["pid"])
        os.kill(stopped[0], signal.SIGSTOP)

    hook.update(on_call=stop_rank_1, fire_at=2 * ROWS_PER_STEP + 3)  # during step 3's scoring
    tracker = _tracker(run_dir)
    try:
        run_training(trainer, tracker, run_dir)
    finally:
        trainer.close()
        tracker.close()
        for pid in stopped:  # never leave a stopped process behind, whatever happened
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert stopped and [r["step"] for r in _records(run_dir)] == [1, 2, 3, 4]
    dumps = list(run_dir.glob("hang-*.txt"))  # named after the call that hung (the actor's pool hosts ref too)
    assert len(dumps) == 1, dumps
    text = dumps[0].read_text()
    assert f"===== rank 1 (pid {stopped[0]}) =====" in text and "===== rank 0 (pid" in text
    assert text.count("Thread ") >= 2  # a Python stack for each rank, the stopped one included


def test_a_rank_that_raises_mid_update_ends_the_run_at_once(ray_cluster, tmp_path):
    """Actor rank 1 raises inside its update while rank 0 waits for it in the gradient collectives: the run
    ends with that error (role, rank, cause), and closing kills the pool instead of queueing behind rank 0's
    collective (call_timeout_s is 10 minutes here)."""
    import psutil

    from hybridrl.controller import Dispatch, Worker, WorkerDiedError, WorkerError, WorkerGroup, register

    class Saboteur(Worker):  # shares the actor's processes: patches rank 1's training step to raise
        @register(Dispatch.ONE_TO_ALL)
        def arm(self, rank: int) -> None:
            if self.rank == rank:
                from hybridrl.workers import megatron_model

                def broken(*args, **kwargs):
                    raise RuntimeError("injected failure in rank 1's update")

                megatron_model.MegatronModel.train_step = broken

    hook = _hook()
    run_dir = tmp_path / "raises"
    trainer = _trainer(["trainer.steps=3", "trainer.call_timeout_s=600", f"trainer.run_dir={run_dir}",
                        f"reward.fn={HOOK_REWARD}"])
    pids = []

    def arm_rank_1():
        group = trainer.roles["actor"].group
        pids.extend(info["pid"] for info in group.worker_info)
        WorkerGroup(group.pool, Saboteur, role="saboteur", init_megatron=False).arm(1)

    hook.update(on_call=arm_rank_1, fire_at=ROWS_PER_STEP + 1)  # during step 2's scoring, before its update
    tracker = _tracker(run_dir)
    try:
        with pytest.raises(WorkerError, match="role 'actor' rank 1: update failed: RuntimeError: injected") as raised:
            run_training(trainer, tracker, run_dir)
        assert not isinstance(raised.value, WorkerDiedError)
    finally:
        trainer.close()
        tracker.close()
    _, alive = psutil.wait_procs([psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)], timeout=30)
    assert pids and not alive  # rank 0, blocked in the collective, was killed rather than waited out
    assert [r["step"] for r in _records(run_dir)] == [1]


def test_worker_deaths_beyond_max_restarts_stop_with_a_message(ray_cluster, tmp_path):
    from hybridrl.trainer.run import RestartsExhaustedError

    hook = _hook()
    run_dir = tmp_path / "exhausted"
    trainer = _trainer(["trainer.steps=2", "trainer.max_restarts=0", f"trainer.run_dir={run_dir}",
                        f"reward.fn={HOOK_REWARD}"])
    hook.update(on_call=lambda: os.kill(trainer.roles["actor"].group.worker_info[1]["pid"], signal.SIGKILL),
                fire_at=0)
    tracker = _tracker(run_dir)
    try:
        with pytest.raises(RestartsExhaustedError, match=r"trainer.max_restarts=0") as raised:
            run_training(trainer, tracker, run_dir)
    finally:
        trainer.close()
        tracker.close()
    code, line = _outcome(raised.value, trainer.step, run_dir)  # what `hybridrl train` ends with
    assert code == 4 and "\n" not in line, line  # one line, not Ray's multi-line ActorDiedError
    assert re.match(r"stopped: a worker died at step 1 \((actor|ref) rank 1: worker process died \(pid \d+ ip [\d.]+: "
                    r"The actor is dead because its worker process has died\. [^()]*\)\) and trainer.max_restarts=0 "
                    r"restart\(s\) are used up", line), line


@pytest.fixture
def small_disk(tmp_path):
    """A 2.6 MB tmpfs: room for one checkpoint of the tiny actor (1.7 MB), not two."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2600k", "tmpfs", str(disk)], check=True)
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_stops_the_run_with_one_line_and_keeps_the_last_checkpoint(ray_cluster, small_disk, capsys):
    run_dir = small_disk / "run"
    rc, err = _cli(["trainer.steps=4", "trainer.save_every=1", f"trainer.run_dir={run_dir}"], capsys)
    last = err.strip().splitlines()[-1]
    latest = ckpt.CheckpointManager(run_dir).latest()
    assert rc == 5 and latest is not None and ckpt.is_complete(latest), err[-2000:]
    assert last == (f"hybridrl train: {run_dir}/ckpt: no space left on device while saving step "
                    f"{int(latest.name.split('_')[1]) + 1}; the last complete checkpoint, {latest}, is intact; free "
                    f"space or point trainer.run_dir at a larger disk, then trainer.resume=auto"), last
    assert not list((run_dir / "ckpt").glob("step_*.tmp-*")) and ckpt.resolve_resume("auto", run_dir) == latest

    # at start: the disk is full before anything is written (the run lock is the first file)
    with open(small_disk / "filler", "wb", buffering=0) as filler:
        with pytest.raises(OSError, match="No space left"):
            while True:
                filler.write(b"x" * (1 << 16))
    rc, err = _cli(["trainer.steps=1", f"trainer.run_dir={small_disk / 'second'}"], capsys)
    assert rc == 5 and err.strip() == (f"hybridrl train: {small_disk / 'second'}/.lock: no space left on device; "
                                       f"free space or point trainer.run_dir at a larger disk, then "
                                       f"trainer.resume=auto"), err


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_nan_reward_policy_and_no_poisoned_checkpoint(ray_cluster, tmp_path, capsys, policy):
    """Rewards are NaN on step 2. stop: exit code 3 with the message, checkpoint of step 1 only. skip: the
    step is skipped (no update), the run goes on, steps 1 and 3 are checkpointed but not step 2."""
    hook = _hook()
    hook.update(nan_calls=range(ROWS_PER_STEP, ROWS_PER_STEP + 4))  # some of step 2's sampled responses
    run_dir = tmp_path / policy
    rc, err = _cli(["trainer.steps=3", "trainer.save_every=1", f"trainer.run_dir={run_dir}",
                    f"trainer.on_nan={policy}", f"reward.fn={HOOK_REWARD}"], capsys)
    saved = [step for step, _ in ckpt.CheckpointManager(run_dir).steps()]
    records = _records(run_dir)
    if policy == "stop":
        assert rc == 3
        assert "non-finite rewards or costs" in err and "trainer.on_nan=stop" in err
        assert saved == [1] and [r["step"] for r in records] == [1]
    else:
        assert rc == 0
        assert saved == [1, 3]
        assert [r["step"] for r in records] == [1, 2, 3] and records[1] == {"step": 2, "skipped": 1.0}
        assert all(math.isfinite(v) for r in (records[0], records[2]) for v in r.values())
        assert ckpt.load_driver_state(run_dir / "ckpt" / "step_3")["loader"]["batch_in_epoch"] == 3


def test_all_skipped_steps_end_the_run_nonzero(ray_cluster, tmp_path, capsys):
    """Every reward NaN with on_nan=skip: the run stops with exit code 3 after trainer.max_skipped_steps
    skipped steps in a row instead of 'finishing' without ever updating."""
    hook = _hook()
    hook.update(nan_calls=range(10 ** 6))
    run_dir = tmp_path / "all_skipped"
    rc, err = _cli(["trainer.steps=5", "trainer.on_nan=skip", "trainer.max_skipped_steps=2",
                    f"trainer.run_dir={run_dir}", f"reward.fn={HOOK_REWARD}"], capsys)
    assert rc == 3
    assert "2 steps in a row (up to step 2)" in err and "trainer.max_skipped_steps=2" in err
    assert _records(run_dir) == [{"step": 1, "skipped": 1.0}, {"step": 2, "skipped": 1.0}]


def test_reward_function_errors_name_the_function_and_the_row(ray_cluster, tmp_path, capsys):
    """A reward function that raises mid-run: exit 2 with one line naming the function, the row and the cause;
    the traceback goes to RUN/error.log. One that returns a non-number is named the same way."""
    from hybridrl.workers.rule_reward import RewardFunctionError, RuleReward

    def bad_row():
        raise ValueError("no reference answer")

    hook = _hook()
    hook.update(on_call=bad_row, fire_at=ROWS_PER_STEP + 2)  # step 2's third row
    run_dir = tmp_path / "reward_raises"
    rc, err = _cli(["trainer.steps=3", f"trainer.run_dir={run_dir}", f"reward.fn={HOOK_REWARD}"], capsys)
    lines = err.strip().splitlines()
    assert rc == 2
    assert lines[-1].startswith(f"hybridrl train: reward function {HOOK_REWARD} raised ValueError: no reference "
                                f"answer on row 2 (prompt "), lines[-1]
    assert lines[-1].endswith(f"(traceback in {run_dir / 'error.log'})")
    assert "in bad_row" in (run_dir / "error.log").read_text()
    assert [r["step"] for r in _records(run_dir)] == [1]

    with pytest.raises(RewardFunctionError, match=r"reward function .*<lambda> returned str 'high' on row 1 \("):
        RuleReward(lambda prompt, response: 1.0 if prompt == "a" else "high").score(["a", "b"], ["x", "y"])


def test_checkpoint_exports_to_hf_with_the_trained_actors_logits(reference_run, tmp_path):
    """`hybridrl convert --from ckpt --to hf RUN/ckpt/step_6 OUT`: transformers loads OUT and its log-probs
    of a rollout equal the live trained actor's; the tensors equal the live actor's own HF export."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hybridrl.cli.convert import run as convert_run

    out = tmp_path / "hf"
    rc = convert_run(argparse.Namespace(source_format="ckpt", target_format="hf", tp=1, pp=1, ep=1, dtype="auto",
                                        src=str(reference_run["dir"] / "ckpt" / "step_6"), dst=str(out)))
    assert rc == 0
    exported = {}
    for file in sorted(out.glob("*.safetensors")):
        exported.update(load_file(file))
    live = {}
    for file in sorted((reference_run["dir"] / "live_hf").glob("*.safetensors")):
        live.update(load_file(file))
    assert exported.keys() == live.keys()
    for name in live:
        assert torch.equal(exported[name], live[name]), name

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    batch = reference_run["rollout"]
    prompts, responses = batch["prompts"], batch["responses"]
    mask = batch["response_mask"].bool()
    width = prompts.shape[1]
    expected = reference_run["log_probs"]
    for row in range(len(batch)):
        prompt = prompts[row][batch["attention_mask"][row, :width].bool()]
        response = responses[row][mask[row]]
        ids = torch.cat([prompt, response]).unsqueeze(0)
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        log_probs = torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(1, response.unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(log_probs, expected[row][mask[row]], atol=2e-5, rtol=1e-5)


def test_ppo_critic_is_checkpointed_and_resumes_exactly(ray_cluster, tmp_path):
    """PPO: the critic's weights, optimizer and scheduler are in the checkpoint too (critic/); a run resumed
    from step 1 gives the uninterrupted run's step 2, actor and critic metrics alike."""
    ppo = ["algorithm.name=ppo", "rollout.n=1", "critic.micro_batch_size=4", "trainer.save_every=1",
           "trainer.steps=2", "critic.optim.lr=1e-3"]
    runs = {}
    for name, resume in (("full", None), ("resumed", "full")):
        run_dir = tmp_path / name
        trainer = _trainer(ppo + [f"trainer.run_dir={run_dir}"])
        tracker = _tracker(run_dir)
        try:
            run_training(trainer, tracker, run_dir, resume and tmp_path / resume / "ckpt" / "step_1")
        finally:
            trainer.close()
            tracker.close()
        runs[name] = _records(run_dir)
    assert (tmp_path / "full" / "ckpt" / "step_1" / "critic" / "optimizer" / "metadata.json").is_file()
    assert [r["step"] for r in runs["resumed"]] == [2]
    assert "critic/value_loss" in runs["resumed"][0]
    _assert_same_metrics(runs["resumed"], runs["full"][1:])


def test_resume_option_errors_are_clear(tmp_path):
    with pytest.raises(ckpt.CheckpointNotFoundError, match="trainer.resume"):
        ckpt.resolve_resume(str(tmp_path), tmp_path)
    assert ckpt.resolve_resume("auto", tmp_path) is None and ckpt.resolve_resume("never", tmp_path) is None
    rc, _ = _cli(["trainer.resume=auto", "trainer.steps=1"])
    assert rc == 2  # resume=auto without trainer.run_dir: refused before any worker starts


def test_bad_checkpoint_convert_requests_are_refused(tmp_path, capsys):
    from hybridrl.cli.convert import run as convert_run

    def convert(src, target="hf") -> str:
        args = argparse.Namespace(source_format="ckpt", target_format=target, tp=1, pp=1, ep=1, dtype="auto",
                                  src=str(src), dst=str(tmp_path / "out"))
        assert convert_run(args) == 2
        return capsys.readouterr().err

    (tmp_path / "step_1").mkdir()
    assert "no actor checkpoint there" in convert(tmp_path / "step_1")
    assert "does not exist" in convert(tmp_path / "missing")
    assert "--from ckpt --to hf" in convert(tmp_path / "step_1", target="mcore")

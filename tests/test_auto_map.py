"""Automatic device mapping (hybridrl/automap): cost-model values checked by hand, out-of-memory layouts
excluded, the 70B / 128-A100 search and its candidate counts, `hybridrl plan --auto --json` / --write-config,
and `hybridrl train` with resources.auto_map on 2 devices. No wall-clock assertions: estimates are modelled."""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import pytest

from hybridrl.automap.cost import ModelStats, Net, Workload, static_bytes
from hybridrl.automap.hardware import GPUS, GiB
from hybridrl.automap.pools import best_pool
from hybridrl.automap.search import Mapper, make_problem
from hybridrl.cli import plan as plan_cli
from hybridrl.hybrid_engine.model_shapes import model_shapes

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent

# Llama-2-7B by hand: h=4096, ffn=11008, 32 layers, vocab 32000, untied LM head
H, FFN, LAYERS, VOCAB = 4096, 11008, 32, 32000
LAYER = 4 * H * H + 3 * H * FFN + 2 * H          # q,k,v,o + gate,up,down + 2 RMSNorms = 202,383,360
EMBED = VOCAB * H                                # 131,072,000
OUTPUT = VOCAB * H + H                           # LM head + final norm
PARAMS_7B = LAYERS * LAYER + EMBED + OUTPUT      # 6,738,415,616
PPO_WORK = Workload(prompts=1024, prompt_len=1024, response_len=1024, mini_batches=8)


def test_model_stats_7b_by_hand():
    m = ModelStats.from_shapes(model_shapes("llama-7b"))
    assert PARAMS_7B == 6_738_415_616
    assert (m.params, m.layer_params, m.embedding, m.output) == (PARAMS_7B, LAYERS * LAYER, EMBED, OUTPUT)
    assert m.compute_params(True) == LAYERS * LAYER + VOCAB * H  # the input embedding is a lookup
    assert m.compute_params(False) == LAYERS * LAYER + H         # scalar head (critic / reward)
    # KV cache per token at t_g=2, p_g=1, bf16: 2 (K,V) x 32 layers x 16 heads x 128 x 2 B
    assert m.kv_bytes_per_token(2, 1, 2) == 2 * 32 * 16 * 128 * 2


def test_actor_memory_7b_distributed_optimizer_by_hand():
    """7B actor at (t, p, d) = (2, 2, 2), bf16 + fp32 grads + fp32 master/Adam sharded over d: the largest
    pipeline stage (16 layers + the embedding, or 16 layers + the LM head; the head is the larger) over t."""
    m = ModelStats.from_shapes(model_shapes("llama-7b"))
    a100 = GPUS["a100-80g"]
    shard = math.ceil((16 * LAYER + max(EMBED, OUTPUT)) / 2)
    assert shard == 1_684_604_928
    assert m.shard_params(2, 2) == shard
    assert static_bytes(m, True, True, 2, 2, 2, a100) == (2 + 4 + 12 / 2) * shard  # 18.83 GiB
    assert static_bytes(m, True, False, 2, 2, 2, a100) == 2 * shard               # reference: weights only
    # d = 1: Megatron's 18 B/param (bf16 weights 2, fp32 grads 4, fp32 master 4, Adam moments 8)
    assert static_bytes(m, True, True, 1, 1, 1, a100) == 18 * PARAMS_7B


def test_collective_cost_by_hand():
    """A ring all-reduce inside a node: 2 (g-1)/g x bytes / NVLink + latency; crossing nodes adds the node's
    share of the InfiniBand link."""
    a100 = GPUS["a100-80g"]
    net = Net(a100, per_node=8, pool_devices=16)
    nbytes = 1 << 30
    assert net.collective(nbytes, 8, 1, passes=2) == pytest.approx(2 * 7 / 8 * nbytes / 600e9 + 15e-6)
    # 16 ranks one apart: 8 per node over NVLink, then 2 nodes, all 8 devices of a node share 25 GB/s
    two_nodes = 7 / 8 * nbytes / 600e9 + 8 * (1 / 2) * (nbytes / 8) / 25e9 + 30e-6
    assert net.collective(nbytes, 16, 1) == pytest.approx(two_nodes)


def test_infeasible_layouts_are_excluded():
    """A 7B actor does not fit one A100 at (1, 1, 1): 18 B/param = 113 GiB > 80 GiB - 4 GiB reserve."""
    prob = make_problem("llama-7b", "ppo", GPUS["a100-80g"], 8, PPO_WORK)
    assert 18 * PARAMS_7B > GPUS["a100-80g"].memory_bytes - GPUS["a100-80g"].memory_reserve_bytes
    assert best_pool(prob, ("actor",), 1, 1) is None and prob.oom_excluded > 0
    fits = best_pool(prob, ("actor",), 8, 8, fixed=(2, 1, 2, 1))
    assert fits is not None and fits.peak_bytes <= 76 * GiB
    # 70B PPO with all four models does not fit on 8 A100s at any layout
    with pytest.raises(ValueError, match="no mapping fits"):
        Mapper(make_problem("llama-70b", "ppo", GPUS["a100-80g"], 8, PPO_WORK)).search()


def test_search_70b_on_128_a100_counts_candidates():
    prob = make_problem("llama-70b", "ppo", GPUS["a100-80g"], 128, PPO_WORK)
    result = Mapper(prob).search(top_k=5)
    counts = result.counts
    assert counts["placements"] == 15  # Bell(4): actor, ref, critic, reward
    assert counts["mappings"] > 100 and counts["simulations"] > 1000 and counts["oom_excluded"] > 0
    assert [m.step_s for m in result.top] == sorted(m.step_s for m in result.top)
    best = result.best
    assert sum(p.devices for p in best.pools) == 128
    cap = GPUS["a100-80g"].memory_bytes - GPUS["a100-80g"].memory_reserve_bytes
    for mapping in result.top:
        for pool in mapping.pools:
            assert pool.tp * pool.pp * pool.dp == pool.devices and pool.peak_bytes <= cap
            assert pool.tp <= 8  # TP inside a node
    assert {"colocate", "split", "standalone"} <= set(result.by_kind)


def test_dataflows_per_algorithm():
    """The roles of each algorithm's dataflow: ReMax generates greedy too and has no critic; GRPO no critic
    and n samples; Safe-RLHF adds a cost model and a cost critic."""
    from hybridrl.automap.search import roles_for

    assert roles_for("ppo") == ("actor", "ref", "critic", "reward")
    assert roles_for("remax") == ("actor", "ref", "reward")
    assert "critic" not in roles_for("grpo") and "critic" not in roles_for("rloo")
    assert roles_for("safe_rlhf") == ("actor", "ref", "critic", "cost_critic", "reward", "cost")


def _plan(capsys, *args: str) -> dict:
    parser = argparse.ArgumentParser(prog="hybridrl plan")
    plan_cli.add_arguments(parser)
    assert plan_cli.run(parser.parse_args(list(args) + ["--json"])) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_auto_json_keys(capsys):
    out = _plan(capsys, "--auto", "--model", "llama-13b", "--algorithm", "ppo", "--gpus", "16", "--gpu", "h100",
                "--top", "3")
    best = out["best"]
    assert set(best["placement"]) and sum(p["devices"] for p in best["placement"].values()) == 16
    for pool in best["placement"].values():
        assert pool["roles"] and pool["devices"] >= 1
    for role in ("actor", "ref", "critic", "reward"):
        par = best["roles"][role]["parallel"]
        assert set(par) == {"tp", "pp", "dp"} and par["tp"] * par["pp"] * par["dp"] >= 1
    gen = best["roles"]["actor"]["generation"]
    assert {"tp", "pp"} <= set(gen) and best["roles"]["actor"]["parallel"]["tp"] % gen["tp"] == 0
    assert best["estimate"]["step_s"] > 0
    assert set(best["estimate"]["stages"]) == {"generation", "preparation", "training"}
    assert best["estimate"]["step_s"] == pytest.approx(sum(best["estimate"]["stages"].values()), abs=1e-3)
    assert 0 < best["memory"]["peak_gb_per_gpu"] <= 80
    cand = out["candidates"]
    assert cand["simulations"] > 0 and len(cand["top"]) == 3 and cand["top"][0]["label"] == best["label"]


def test_plan_without_auto_unchanged(capsys):
    out = _plan(capsys, "--model", "llama-7b", "--train-tp", "2", "--train-pp", "1", "--train-dp", "4",
                "--gen-tp", "1", "--gen-pp", "1")
    assert "strategies" in out and "best" not in out


def test_write_config_loads(tmp_path, capsys):
    from hybridrl.config import load_config

    path = tmp_path / "auto.yaml"
    out = _plan(capsys, "--auto", "--model", "llama-7b", "--algorithm", "remax", "--gpus", "8", "--gpu", "a100-80g",
                "--batch", "256", "--prompt-len", "512", "--response-len", "512", "--write-config", str(path))
    cfg = load_config(path)
    best = out["best"]
    assert cfg.algorithm.name == "remax" and cfg.data.batch_size == 256 and cfg.rollout.max_new_tokens == 512
    assert cfg.resources.devices == best["placement"]["default"]["devices"]
    assert dict(cfg.resources.pools) == {k: v["devices"] for k, v in best["placement"].items() if k != "default"}
    actor = best["roles"]["actor"]
    assert (cfg.actor.parallel.tp, cfg.actor.parallel.pp, cfg.actor.parallel.dp) == tuple(
        actor["parallel"][k] for k in ("tp", "pp", "dp"))
    assert (cfg.rollout.tp, cfg.rollout.pp) == (actor["generation"]["tp"], actor["generation"]["pp"])
    assert cfg.ref.pool == best["roles"]["ref"]["pool"] and cfg.resources.auto_map is False


def test_write_config_places_pools_on_whole_nodes(tmp_path, capsys):
    """70B PPO on 16 nodes: the search puts training and the critic's pool on whole nodes of their own (HybridFlow's
    placement); the written config says so node by node and the trainer's plan accepts the split."""
    from hybridrl.config import load_config
    from hybridrl.parallel.placement import resolve_node_devices

    path = tmp_path / "auto.yaml"
    out = _plan(capsys, "--auto", "--model", "llama-70b", "--algorithm", "ppo", "--gpus", "128", "--gpu",
                "a100-80g", "--write-config", str(path))
    placement = out["best"]["placement"]
    assert len(placement) == 2 and all(sum(p["node_devices"]) == p["devices"] for p in placement.values())
    assert [sum(split) for split in zip(*(p["node_devices"] for p in placement.values()))] == [8] * 16  # no node
    assert all(set(p["node_devices"]) == {0, 8} for p in placement.values())  # twice, whole nodes only
    cfg = load_config(path)
    assert cfg.resources.nodes == 16
    assert {k: list(v) for k, v in cfg.resources.node_devices.items()} == {
        name: pool["node_devices"] for name, pool in placement.items()}
    pools = {"default": cfg.resources.devices, **cfg.resources.pools}
    assert resolve_node_devices(pools, 16, dict(cfg.resources.node_devices)) == {
        name: pool["node_devices"] for name, pool in placement.items()}


@pytest.mark.slow
def test_train_auto_map_two_devices(tmp_path):
    """`hybridrl train resources.auto_map=true` on the 2-device CPU box: the chosen mapping is valid for the
    trainer (plan_run accepts it) and is the one the run used (config.yaml = auto_map.json's best)."""
    from hybridrl.config import load_config
    from hybridrl.trainer.plan import plan_run

    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", "resources.auto_map=true",
                           "resources.devices=2", "trainer.steps=2", f"trainer.run_dir={run_dir}",
                           "trainer.progress_bar=false", "trainer.trackers=[]"],
                          capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "auto_map:" in proc.stdout
    report = json.loads((run_dir / "auto_map.json").read_text())
    best = report["best"]
    assert best["runnable"] and report["execution"] == "trainer" and report["candidates"]["simulations"] > 0
    cfg = load_config(run_dir / "config.yaml")
    plan = plan_run(cfg)  # the trainer's own checks accept the mapping
    assert cfg.resources.devices + sum(cfg.resources.pools.values()) == 2
    for role, info in best["roles"].items():
        layout = plan.roles[role].layout
        assert (layout.tp, layout.pp, layout.dp) == tuple(info["parallel"][k] for k in ("tp", "pp", "dp"))
        assert plan.roles[role].pool == info["pool"]
    gen = best["roles"]["actor"]["generation"]
    assert (cfg.rollout.tp, cfg.rollout.pp) == (gen["tp"], gen["pp"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["actor/update_ok"] == 1.0 and math.isfinite(r["reward_mean"]) for r in records)

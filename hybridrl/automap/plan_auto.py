"""`hybridrl plan --auto`: the device mapping the search picks, its estimates, and a config that runs it.

    hybridrl plan --auto --model llama-70b --algorithm ppo --gpus 128 --gpu a100-80g [--nodes-of 8]
        [--prompt-len 1024 --response-len 1024 --batch 1024] [--top 5] [--json] [--write-config F]

The estimates are modelled (hybridrl/automap/cost.py states the model), not measured.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hybridrl.automap.search import EXECUTIONS, Mapper, Mapping, make_problem, mapping_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hybridrl.automap.hardware import GPUS

    group = parser.add_argument_group("automatic device mapping (--auto; HybridFlow Algorithm 1)")
    group.add_argument("--auto", action="store_true", help="search placements and layouts for an RL step")
    group.add_argument("--algorithm", default="ppo", help="registered algorithm (ppo, remax, grpo, safe_rlhf, ...)")
    group.add_argument("--gpus", type=int, help="devices to map onto (required with --auto)")
    group.add_argument("--gpu", default="a100-80g", choices=sorted(GPUS), help="device type")
    group.add_argument("--nodes-of", type=int, default=8, help="GPUs per node")
    group.add_argument("--inter-node-gbps", type=float, help="inter-node link per node in Gb/s (default: the "
                                                             "GPU preset's: 200 for a100-80g, 3200 for h100/h200)")
    group.add_argument("--prompt-len", type=int, default=1024)
    group.add_argument("--response-len", type=int, default=1024)
    group.add_argument("--batch", type=int, default=1024, help="prompts per step")
    group.add_argument("--n", type=int, help="samples per prompt (default: 1, or 4 for group baselines)")
    group.add_argument("--mini-batches", type=int, default=8, help="optimizer steps per epoch (HybridFlow: 8)")
    group.add_argument("--epochs", type=int, default=1)
    group.add_argument("--critic-model", help="preset or HF folder of the critic(s) (default: the actor's)")
    group.add_argument("--reward-model", default="same",
                       help="same (the actor's size, default), none (a rule reward: no devices), or a preset / folder")
    group.add_argument("--execution", choices=sorted(EXECUTIONS), default="hybridflow",
                       help="hybridflow: pools are whole nodes and run a stage in parallel (the paper's d_cost); "
                            "trainer: what `hybridrl train` runs today (calls in sequence, pools spread over nodes)")
    group.add_argument("--rollout-pool", action="store_true",
                       help="also consider generation on a pool of its own and p_g > 1 (not yet runnable)")
    group.add_argument("--top", type=int, default=5, help="mappings to list")
    group.add_argument("--write-config", metavar="FILE", help="write the best mapping as a hybridrl train YAML")


def _workload(args: argparse.Namespace, spec):
    """The step's shape. The trainer runs a separate old-log-prob pass unless the update is exactly on-policy
    and the KL (if any) is a loss term (trainer/loop.py)."""
    from hybridrl.automap.cost import Workload

    n = args.n or (1 if spec.min_samples_per_prompt <= 1 else 4)
    off_policy = args.mini_batches * args.epochs > 1
    return Workload(prompts=args.batch, prompt_len=args.prompt_len, response_len=args.response_len, samples=n,
                    greedy=spec.needs_greedy_baseline, mini_batches=args.mini_batches, epochs=args.epochs,
                    old_log_probs=off_policy or (spec.uses_reference and spec.default_kl_mode == "reward"))


def build_report(args: argparse.Namespace) -> dict:
    """Run the search for the CLI's arguments; the report `--json` prints."""
    import hybridrl.algorithms  # noqa: F401
    from hybridrl.algorithms.registry import get_algorithm
    from hybridrl.automap.hardware import gpu

    if not args.gpus or args.gpus < 1:
        raise ValueError("--auto needs --gpus N (the devices to map onto)")
    spec = get_algorithm(args.algorithm)
    acc = gpu(args.gpu).with_network(gpus_per_node=min(args.nodes_of, args.gpus), inter_node_gbps=args.inter_node_gbps)
    work = _workload(args, spec)
    reward = None if args.reward_model == "none" else args.reward_model

    def problem(execution_allows_pp: bool):
        return make_problem(args.model, args.algorithm, acc, args.gpus, work, critic_model=args.critic_model,
                            reward_model=reward, cost_model=reward, allow_generation_pp=execution_allows_pp)

    prob = problem(args.rollout_pool)
    mapper = Mapper(prob, args.execution)
    result = mapper.search(top_k=args.top, rollout_pool=args.rollout_pool)
    best = mapping_json(result.best, prob)
    best["trainer_step_s"] = _trainer_estimate(result.best, problem(False), args.execution)
    return {
        "model": args.model, "algorithm": args.algorithm, "gpus": args.gpus, "gpu": acc.describe(),
        "execution": {"name": result.execution.name, "description": result.execution.description},
        "workload": {"prompts": work.prompts, "samples_per_prompt": work.samples, "prompt_len": work.prompt_len,
                     "response_len": work.response_len, "mini_batches": work.mini_batches, "epochs": work.epochs,
                     "greedy_baseline": work.greedy, "old_log_prob_pass": work.old_log_probs},
        "roles": list(prob.roles),
        "best": best,
        "by_placement": {kind: {"step_s": round(m.step_s, 4), "label": m.label} for kind, m in result.by_kind.items()},
        "candidates": {**result.counts, "search_s": round(result.seconds, 3),
                       "top": [mapping_json(m, prob) for m in result.top]},
        "note": "modelled estimates (hybridrl/automap/cost.py), not measurements",
    }


def _trainer_estimate(mapping: Mapping, prob, execution: str) -> float | None:
    """The same placement and layouts as `hybridrl train` runs them today (None: it cannot express them)."""
    if not mapping.runnable:
        return None
    if execution == "trainer":
        return round(mapping.step_s, 4)
    mapper = Mapper(prob, "trainer")
    if any(p.devices % mapper.nodes for p in mapping.pools):
        return None
    again = mapper.evaluate([(p.roles, p.devices, (p.tp, p.pp, p.gen_tp or p.tp, p.gen_pp or p.pp))
                             for p in mapping.pools])
    return round(again.step_s, 4) if again else None


def _print_text(report: dict) -> None:
    work = report["workload"]
    print(f"{report['algorithm']} on {report['model']}, {report['gpus']} x {report['gpu']}")
    print(f"workload: {work['prompts']} prompts x {work['samples_per_prompt']} samples, {work['prompt_len']} + "
          f"{work['response_len']} tokens, {work['epochs']} epoch(s) x {work['mini_batches']} mini-batches; roles "
          f"{', '.join(report['roles'])}")
    print(f"execution: {report['execution']['name']} ({report['execution']['description']})\n")
    print(f"{'#':>2} {'step s':>9} {'gen':>8} {'prep':>8} {'train':>8} {'peak GiB':>8}  placement (pool: roles:devices "
          f"t,p,d [gen t_g,p_g])")
    for i, m in enumerate(report["candidates"]["top"], 1):
        st = m["estimate"]["stages"]
        pools = []
        for name, pool in m["placement"].items():
            role = pool["roles"][0]
            if role == "rollout":
                gen = m["roles"]["actor"]["generation"]
                pools.append(f"{name}: rollout:{pool['devices']} [gen {gen['tp']},{gen['pp']}]")
                continue
            par = m["roles"][role]["parallel"]
            text = f"{name}: {'+'.join(pool['roles'])}:{pool['devices']} {par['tp']},{par['pp']},{par['dp']}"
            if "actor" in pool["roles"] and m["roles"]["actor"]["generation"]["pool"] == name:
                gen = m["roles"]["actor"]["generation"]
                text += f" [gen {gen['tp']},{gen['pp']}]"
            pools.append(text)
        flag = "" if m["runnable"] else "  (not yet runnable)"
        print(f"{i:>2} {m['estimate']['step_s']:9.2f} {st['generation']:8.2f} {st['preparation']:8.2f} "
              f"{st['training']:8.2f} {m['memory']['peak_gb_per_gpu']:8.1f}  {' | '.join(pools)}{flag}")
    best = report["best"]
    print(f"\nbest: {best['kind']}, {best['estimate']['tokens_per_s']:.0f} tokens/s modelled", end="")
    if report["execution"]["name"] != "trainer":
        trainer = best["trainer_step_s"]
        print(f"; as `hybridrl train` runs it today: {trainer:.2f} s/step" if trainer is not None else
              "; `hybridrl train` cannot express it today (see --execution trainer)", end="")
    print()
    print("best per placement: " + "; ".join(f"{k} {v['step_s']:.2f} s ({v['label']})"
                                             for k, v in report["by_placement"].items()))
    c = report["candidates"]
    print(f"searched {c['placements']} placements, {c['mappings']} device allocations, {c['simulations']} layout "
          f"simulations ({c['oom_excluded']} excluded: out of memory) in {c['search_s']:.2f} s. {report['note']}.")


def config_from_report(report: dict, model: str, nodes_of: int, reward_model: str = "same") -> dict:
    """A hybridrl train config (config.py's schema) that runs the best mapping; refuses what it cannot express."""
    best = report["best"]
    if not best["runnable"]:
        raise ValueError("the best mapping is not runnable by hybridrl train yet (separate rollout pool or "
                         "generation pipeline stages); rerun without --rollout-pool")
    gpus = report["gpus"]
    nodes = max(1, gpus // nodes_of) if gpus > nodes_of else 1
    if any(pool["devices"] % nodes for pool in best["placement"].values()) or (
            report["execution"]["name"] != "trainer" and nodes > 1 and len(best["placement"]) > 1):
        raise ValueError("the best mapping places pools on whole nodes, but hybridrl's ResourcePool spreads every "
                         "pool over all resources.nodes; rerun with --execution trainer to search the mappings "
                         "hybridrl train runs")
    from hybridrl.trainer.plan import ROLE_SECTIONS

    work, roles = report["workload"], best["roles"]
    tokens = work["prompt_len"] + work["response_len"]
    sequences = work["prompts"] * work["samples_per_prompt"]
    local = Path(model).is_dir()
    cfg: dict = {
        "algorithm": {"name": report["algorithm"], "ppo_epochs": work["epochs"],
                      "mini_batch_size": sequences // work["mini_batches"]},
        "rollout": {"engine": "auto", "n": work["samples_per_prompt"], "max_new_tokens": work["response_len"]},
        "data": {"batch_size": work["prompts"], "max_prompt_length": work["prompt_len"]},
        "resources": {"nodes": nodes, "auto_map": False},
    }
    pools = {}
    for name, pool in best["placement"].items():
        if name == "default":
            cfg["resources"]["devices"] = pool["devices"]
        else:
            pools[name] = pool["devices"]
    if pools:
        cfg["resources"]["pools"] = pools
    for role, info in roles.items():
        section = cfg.setdefault(ROLE_SECTIONS.get(role, role), {})
        par = info["parallel"]
        section.update(pool=info["pool"], parallel={"tp": par["tp"], "pp": par["pp"], "dp": par["dp"]},
                       micro_batch_size=info["micro_batch_size"],
                       max_tokens_per_micro_batch=info["micro_batch_size"] * tokens)
        if role in ("reward", "cost"):
            given = Path(reward_model).is_dir()
            section.update(model=str(Path(reward_model).resolve()) if given else f"/path/to/{role}-model",
                           dtype="bfloat16")
        elif role in ("actor", "ref", "critic"):
            section["model"] = {"dtype": "bfloat16", **({"path": str(Path(model).resolve()) if local else
                                                          f"/path/to/{model}"} if role == "actor" else {})}
    gen = roles["actor"]["generation"]
    cfg["rollout"].update(tp=gen["tp"], pp=gen["pp"])
    return cfg


def write_config(report: dict, model: str, nodes_of: int, path: str | Path, reward_model: str = "same") -> Path:
    import yaml

    cfg = config_from_report(report, model, nodes_of, reward_model)
    best = report["best"]
    header = [f"# Written by `hybridrl plan --auto` for {report['algorithm']} on {report['model']}, "
              f"{report['gpus']} x {report['gpu'].split(':')[0]}.",
              f"# Mapping: {best['label']} ({best['kind']}); modelled {best['estimate']['step_s']:.2f} s/step "
              f"under '{report['execution']['name']}' execution"
              + (f", {best['trainer_step_s']:.2f} s/step as hybridrl train runs it today."
                 if best["trainer_step_s"] is not None else "."),
              "# Estimates are modelled (hybridrl/automap/cost.py), not measured. Set data.train_files (default: the",
              "# bundled task) and any /path/to/ placeholders before running."]
    path = Path(path)
    path.write_text("\n".join(header) + "\n" + yaml.safe_dump(cfg, sort_keys=False))
    return path


def run(args: argparse.Namespace) -> int:
    from hybridrl.parallel.layout import LayoutError

    start = time.perf_counter()
    try:
        report = build_report(args)
        if args.write_config:
            write_config(report, args.model, args.nodes_of, args.write_config, args.reward_model)
    except (LayoutError, ValueError) as exc:
        print(f"hybridrl plan --auto: {exc}", file=sys.stderr)
        return 2
    report["candidates"]["total_s"] = round(time.perf_counter() - start, 3)
    if args.json:
        print(json.dumps(report))
    else:
        _print_text(report)
        if args.write_config:
            print(f"wrote {args.write_config}")
    return 0



"""What `hybridrl plan --auto` reports (the command is hybridrl/cli/plan.py): the device mapping the search
picks, its estimates, and a config that runs it.

The estimates are modelled (hybridrl/automap/cost.py states the model), not measured.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from hybridrl.automap.cost import Workload
from hybridrl.automap.hardware import gpu
from hybridrl.automap.judge_cost import JudgeWork
from hybridrl.automap.search import Mapper, Mapping, make_problem, mapping_json
from hybridrl.config import role_section


def _workload(args: argparse.Namespace, spec):
    """The step's shape. The trainer runs a separate old-log-prob pass unless the update is exactly on-policy
    and the KL (if any) is a loss term (trainer/loop.py)."""
    n = args.n or (1 if spec.min_samples_per_prompt <= 1 else 4)
    off_policy = args.mini_batches * args.epochs > 1
    return Workload(prompts=args.batch, prompt_len=args.prompt_len, response_len=args.response_len, samples=n,
                    greedy=spec.needs_greedy_baseline, mini_batches=args.mini_batches, epochs=args.epochs,
                    old_log_probs=off_policy or (spec.uses_reference and spec.default_kl_mode == "reward"))


def build_report(args: argparse.Namespace) -> dict:
    """Run the search for the CLI's arguments; the report `--json` prints."""
    # start-up time: the registry imports torch (its estimators); every `hybridrl` command imports this
    # module with its parser (cli/plan.py); only `plan --auto` and resources.auto_map search
    import hybridrl.algorithms  # noqa: F401  (registers the built-in algorithms)
    from hybridrl.algorithms.registry import get_algorithm

    if not args.gpus or args.gpus < 1:
        raise ValueError("--auto needs --gpus N (the devices to map onto)")
    spec = get_algorithm(args.algorithm)
    acc = gpu(args.gpu).with_network(gpus_per_node=min(args.nodes_of, args.gpus), inter_node_gbps=args.inter_node_gbps)
    work = _workload(args, spec)
    reward = _reward_model(args)
    judge = getattr(args, "judge_model", None)
    alone = ("judge",) if getattr(args, "judge_pool", False) else ()
    rank = getattr(args, "lora_rank", 0)
    targets = [t for t in getattr(args, "lora_targets", "all").split(",") if t]
    lora = {"actor": (rank, targets), "critic": (rank, targets)} if rank else None

    def problem(execution_allows_pp: bool):
        return make_problem(args.model, args.algorithm, acc, args.gpus, work, critic_model=args.critic_model,
                            reward_model=reward, cost_model=reward, allow_generation_pp=execution_allows_pp,
                            lora=lora, judge_model=judge, judge_work=JudgeWork(getattr(args, "judge_tokens", 32)),
                            teacher_model=getattr(args, "teacher_model", None), engine=_engine(args, acc),
                            offload=_offload(args))

    prob = problem(args.rollout_pool)
    mapper = Mapper(prob, args.execution)
    result = mapper.search(top_k=args.top, rollout_pool=args.rollout_pool, alone=alone)
    whole_nodes = result.execution.whole_nodes
    best = _with_nodes(mapping_json(result.best, prob), mapper.nodes, acc.gpus_per_node, whole_nodes)
    best["trainer_step_s"] = _trainer_estimate(result.best, problem(False), args.execution)
    return {
        "model": args.model, "algorithm": args.algorithm, "gpus": args.gpus, "gpu": acc.describe(),
        "execution": {"name": result.execution.name, "description": result.execution.description},
        "workload": {"prompts": work.prompts, "samples_per_prompt": work.samples, "prompt_len": work.prompt_len,
                     "response_len": work.response_len, "mini_batches": work.mini_batches, "epochs": work.epochs,
                     "greedy_baseline": work.greedy, "old_log_prob_pass": work.old_log_probs,
                     **({"judge_verdict_tokens": prob.judge.verdict_tokens} if judge else {})},
        "roles": list(prob.roles),
        "offload": [name for name, on in zip(("grads", "optimizer", "params"), prob.offload) if on],
        "lora": {"rank": rank, "target_modules": targets, "adapter_share": prob.adapters.get("actor"),
                 "reference": "the actor with its adapters off" if prob.reference_from_actor else None}
        if rank else None,
        "best": best,
        "by_placement": {kind: {"step_s": round(m.step_s, 4), "label": m.label} for kind, m in result.by_kind.items()},
        "candidates": {**result.counts, "search_s": round(result.seconds, 3),
                       "top": [_with_nodes(mapping_json(m, prob), mapper.nodes, acc.gpus_per_node, whole_nodes)
                               for m in result.top]},
        "note": "modelled estimates (hybridrl/automap/cost.py), not measurements",
    }


def _engine(args: argparse.Namespace, acc) -> str:
    """--engine: vllm on GPUs unless told otherwise (rollout.engine auto picks it there), native on CPU."""
    given = getattr(args, "engine", None)
    return given or ("native" if acc.shared_cores else "vllm")


def _offload(args: argparse.Namespace) -> tuple[bool, bool, bool]:
    """--offload grads,optimizer,params: the actor's states off the GPU while it generates (actor.offload)."""
    parts = {p for p in (getattr(args, "offload", None) or "").split(",") if p}
    unknown = parts - {"grads", "optimizer", "params"}
    if unknown:
        raise ValueError(f"--offload {','.join(sorted(unknown))}: choose from grads, optimizer, params")
    return "grads" in parts, "optimizer" in parts, "params" in parts


def _reward_model(args: argparse.Namespace) -> str | None:
    """--reward-model: none -> no device; unset -> the actor's size, or none when a judge scores instead."""
    given = args.reward_model
    if given is None:
        return None if getattr(args, "judge_model", None) else "same"
    return None if given == "none" else given


def _with_nodes(mapping: dict, nodes: int, gpus_per_node: int, whole_nodes: bool) -> dict:
    """Each pool's devices per node (`node_devices`, node 0 first): whole nodes handed out in placement order under
    the hybridflow execution, an even share of every node under trainer's."""
    start = 0
    for pool in mapping["placement"].values():
        devices = pool["devices"]
        if nodes == 1 or not whole_nodes:
            pool["node_devices"] = [devices // nodes] * nodes
            continue
        count = -(-devices // gpus_per_node)
        pool["node_devices"] = [0] * start + [gpus_per_node] * (count - 1) + [devices - gpus_per_node * (count - 1)] \
            + [0] * (nodes - start - count)
        start += count
    return mapping


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


def config_from_report(report: dict, model: str, nodes_of: int, reward_model: str | None = "same",
                       judge_model: str | None = None, teacher_model: str | None = None) -> dict:
    """A hybridrl train config (config/schema.py) that runs the best mapping; refuses what it cannot express."""
    best = report["best"]
    if not best["runnable"]:
        raise ValueError("the best mapping is not runnable by hybridrl train yet (separate rollout pool or "
                         "generation pipeline stages); rerun without --rollout-pool")
    gpus = report["gpus"]
    nodes = max(1, gpus // nodes_of) if gpus > nodes_of else 1
    work, roles = report["workload"], best["roles"]
    tokens = work["prompt_len"] + work["response_len"]
    sequences = work["prompts"] * work["samples_per_prompt"]
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
    splits = {name: pool["node_devices"] for name, pool in best["placement"].items()
              if len(set(pool["node_devices"])) > 1}  # not an even share of every node: whole nodes
    if nodes > 1 and splits:
        cfg["resources"]["node_devices"] = splits
    for role, info in roles.items():
        section = role_section(cfg, role, create=True)
        par = info["parallel"]
        section.update(pool=info["pool"], parallel={"tp": par["tp"], "pp": par["pp"], "dp": par["dp"]},
                       micro_batch_size=info["micro_batch_size"],
                       max_tokens_per_micro_batch=info["micro_batch_size"] * tokens)
        if role in ("reward", "cost"):
            section.update(model=_config_model(reward_model, f"/path/to/{role}-model"), dtype="bfloat16")
        elif role == "judge":  # it reads the template around each sequence, then writes its verdict
            verdict = work.get("judge_verdict_tokens", 32)
            section.update(_judge_section(judge_model, verdict), max_tokens_per_micro_batch=info["micro_batch_size"]
                           * (JudgeWork().prompt_len(tokens) + verdict))
        elif role == "teacher":
            section.update(teacher=_config_model(teacher_model, "/path/to/teacher-model"), dtype="bfloat16")
        elif role in ("actor", "ref", "critic"):
            section["model"] = {"dtype": "bfloat16",
                                **({"path": _config_model(model, f"/path/to/{model}")} if role == "actor" else {})}
    gen = roles["actor"]["generation"]
    cfg["rollout"].update(tp=gen["tp"], pp=gen["pp"])
    if "vllm_gpu_memory_utilization" in gen:  # vLLM's share: what the pool leaves it while generating
        cfg["rollout"]["vllm"] = {"gpu_memory_utilization": gen["vllm_gpu_memory_utilization"]}
    if report.get("offload"):
        cfg["actor"]["offload"] = {name: True for name in report["offload"]}
    if report.get("lora"):  # the actor's (and critic's) adapters; the actor is its own reference
        lora = report["lora"]
        for role in ("actor", "critic"):
            if role in cfg:
                cfg[role]["lora"] = {"rank": lora["rank"], "alpha": 2 * lora["rank"],
                                     "target_modules": lora["target_modules"]}
    return cfg


def _config_model(model: str | None, placeholder: str) -> str:
    """How the written config names a model: a local folder by its absolute path, a hub id or tiny:<name> as
    given, a preset (sizes only, no weights) by a placeholder path to fill in."""
    # start-up time: hybridrl.models imports torch; this module comes with every `hybridrl` command's parser
    from hybridrl.models.hub import parse_hub_id
    from hybridrl.models.tiny import TINY_PREFIX

    if model is None:
        return placeholder
    if Path(model).is_dir():
        return str(Path(model).resolve())
    return model if parse_hub_id(model) or model.startswith(TINY_PREFIX) else placeholder


def _judge_section(judge_model: str | None, verdict_tokens: int) -> dict:
    """A generative reward_model section: the judge, a template to write, a parser for its verdict's tokens."""
    parser = {"name": "regex", "pattern": "Score: ([0-9]+)", "score_range": [0, 10]} if verdict_tokens else \
        {"name": "choice_logprob", "choices": ["Yes", "No"], "choice_values": [1, 0]}
    return {"kind": "generative", "model": _config_model(judge_model, "/path/to/judge-model"),
            "dtype": "bfloat16", "template": "Rate the answer from 0 to 10.\nQuestion: {prompt}\nAnswer: {response}\n"
            + ("Reply 'Score: N'." if verdict_tokens else "Is the answer correct? Reply Yes or No."),
            "parser": parser, "on_parse_error": 0.0,
            "generation": {"engine": "auto", "max_new_tokens": max(verdict_tokens, 1)}}


def write_config(report: dict, model: str, nodes_of: int, path: str | Path, reward_model: str | None = "same",
                 judge_model: str | None = None, teacher_model: str | None = None) -> Path:
    import yaml

    cfg = config_from_report(report, model, nodes_of, reward_model, judge_model, teacher_model)
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

"""`hybridrl plan`: the 3D-HybridEngine plan and the per-GPU transition cost of every strategy.

    hybridrl plan --model llama-70b --train-tp 8 --train-pp 8 --train-dp 2 --gen-tp 8 --gen-pp 1 [--json]
    hybridrl plan --model qwen3-30b-a3b --train-tp 4 --train-dp 4 --train-ep 4 --gen-tp 4 [--gen-ep 1]
    hybridrl plan --auto --model llama-70b --algorithm ppo --gpus 128 --gpu a100-80g [--nodes-of 8]
        [--prompt-len 1024 --response-len 1024 --batch 1024] [--top 5] [--json] [--write-config F]

Sizes come from the real parameter shapes of the model built on the meta device (no memory needed;
hybrid_engine/accounting.py's plan_report). `--auto` searches the device mapping (automap/plan_auto.py); its
estimates are modelled (hybridrl/automap/cost.py states the model), not measured.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from hybridrl.automap import plan_auto
from hybridrl.automap.hardware import GPUS
from hybridrl.automap.search import EXECUTIONS
from hybridrl.hybrid_engine.accounting import plan_report
from hybridrl.hybrid_engine.lora_sync import lora_plan_report
from hybridrl.hybrid_engine.model_shapes import DTYPE_BYTES, PRESETS
from hybridrl.parallel.generation import GenerationLayout
from hybridrl.parallel.layout import FSDP_MODES, LayoutError, ParallelLayout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model",
                        help=f"preset ({', '.join(PRESETS)}), a local Hugging Face config folder, a hub id "
                             f"org/name[@revision] or tiny:<name> (required unless --memory)")
    parser.add_argument("--memory", metavar="CONFIG",
                        help="the memory ledger of a training config instead: per pool, what stays on one GPU (--gpu) "
                             "in each phase of a step, vLLM's copy and KV cache and offload included "
                             "(hybridrl/automap/ledger.py)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for --memory (repeatable)")
    for role, name in (("train", "training"), ("gen", "generation")):
        parser.add_argument(f"--{role}-tp", type=int, default=1, help=f"{name} tensor-parallel size")
        parser.add_argument(f"--{role}-pp", type=int, default=1, help=f"{name} pipeline-parallel size")
    parser.add_argument("--train-dp", type=int, default=1, help="training data-parallel size")
    parser.add_argument("--train-ep", type=int, default=1,
                        help="training expert-parallel size (mixture-of-experts models; divides --train-dp, or "
                             "--train-tp x --train-dp / --train-etp)")
    parser.add_argument("--train-etp", type=int, default=None,
                        help="training expert tensor-parallel size (divides --train-tp or is a multiple of it; "
                             "default: --train-tp)")
    parser.add_argument("--train-fsdp", choices=FSDP_MODES, default="no_shard",
                        help="fully sharded data parallel in training: each TP shard's rows split over --train-dp "
                             "(shard_grad_op and full_shard hold the same parameter shards between steps)")
    parser.add_argument("--gen-ep", type=int, default=1,
                        help="generation expert-parallel size (divides --train-ep; the rollout engines run 1)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="parameter dtype")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--per-rank", action="store_true", help="also list every rank's shard and costs")
    _add_auto_arguments(parser)


def _add_auto_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("automatic device mapping (--auto; HybridFlow Algorithm 1)")
    group.add_argument("--auto", action="store_true", help="search placements and layouts for an RL step")
    group.add_argument("--algorithm", default="ppo", help="registered algorithm (ppo, remax, grpo, safe_rlhf, ...)")
    group.add_argument("--gpus", type=int, help="devices to map onto (required with --auto)")
    group.add_argument("--gpu", default="a100-80g", help=f"device type: {', '.join(sorted(GPUS))}")
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
    group.add_argument("--reward-model", default=None,
                       help="same (the actor's size; the default without --judge-model), none (a rule reward: no "
                            "devices), or a preset / folder")
    group.add_argument("--judge-model", help="a generative judge (preset / folder) scoring the responses")
    group.add_argument("--judge-tokens", type=int, default=32,
                       help="tokens of the judge's verdict (0: choice_logprob, one forward)")
    group.add_argument("--judge-pool", action="store_true", help="the judge on a pool of its own")
    group.add_argument("--teacher-model", help="an on-policy distillation teacher (preset / folder; opd needs one)")
    group.add_argument("--execution", choices=sorted(EXECUTIONS), default="hybridflow",
                       help="hybridflow: pools are whole nodes and run a stage in parallel (the paper's d_cost); "
                            "trainer: what `hybridrl train` runs today (calls in sequence, pools spread over nodes)")
    group.add_argument("--rollout-pool", action="store_true",
                       help="also consider generation on a pool of its own and p_g > 1 (not yet runnable)")
    group.add_argument("--engine", choices=("vllm", "native"),
                       help="the actor's rollout engine (default: vllm on GPUs, native on CPU); vllm keeps its own "
                            "copy of the generation weights, its runtime and KV cache beside what stays on the GPU")
    group.add_argument("--offload", metavar="STATES", help="actor.offload while generating: a comma list of grads, "
                                                          "optimizer, params")
    group.add_argument("--top", type=int, default=5, help="mappings to list")
    group.add_argument("--write-config", metavar="FILE", help="write the best mapping as a hybridrl train YAML")
    lora = parser.add_argument_group("LoRA (the actor's adapters; plan and --auto)")
    lora.add_argument("--lora-rank", type=int, default=0, help="adapter rank (0: full fine-tuning)")
    lora.add_argument("--lora-targets", default="all", help="comma-separated lora.target_modules (default: all)")


def _gib(n: float) -> str:
    return f"{n / 2**30:9.3f} GiB"


def build_report(args: argparse.Namespace) -> dict:
    """Validate (before building anything), build the plan and account every strategy."""
    train = ParallelLayout(tp=args.train_tp, pp=args.train_pp, dp=args.train_dp, ep=args.train_ep,
                           etp=args.train_etp, fsdp=args.train_fsdp)
    gen = GenerationLayout(tp=args.gen_tp, pp=args.gen_pp, ep=args.gen_ep)
    report = plan_report(args.model, train, gen, args.dtype, per_rank=args.per_rank)
    if args.lora_rank:
        report["lora"] = lora_plan_report(args.model, args.lora_rank, _lora_targets(args), train, gen,
                                          DTYPE_BYTES[args.dtype])
    return report


def _lora_targets(args: argparse.Namespace) -> list[str]:
    return [t for t in args.lora_targets.split(",") if t]


def _print_text(report: dict) -> None:
    tr, ge = report["train"], report["gen"]
    print(f"model {report['model']} ({report['dtype']}): M = {report['model_bytes']:,} bytes "
          f"({report['model_bytes'] / 2**30:.2f} GiB)")
    if report["num_experts"]:
        print(f"experts: {report['num_experts']} per MoE layer, E = {report['expert_bytes'] / 2**30:.2f} GiB; "
              f"training ep={tr['ep']} expert_tp={tr['expert_tp']} -> generation e_g={ge['ep']}")
    fsdp = f" fsdp={tr['fsdp']}" if tr["fsdp"] != "no_shard" else ""
    print(f"training p={tr['pp']} t={tr['tp']} d={tr['dp']}{fsdp} -> generation p_g={ge['pp']} t_g={ge['tp']} "
          f"d_g={ge['micro_dp']} d={tr['dp']} ({ge['dp']} generation replicas)")
    for key in ("expert_gather_groups", "micro_dp_groups", "fsdp_gather_groups", "gen_tp_groups", "gen_pp_groups"):
        if not report[key]:
            continue
        groups = report[key]
        shown = " ".join(str(g) for g in groups[:16]) + (f" ... ({len(groups)} groups)" if len(groups) > 16 else "")
        print(f"{key:16s} {shown}")
    print(f"\n{'strategy':13s} {'recv/GPU mean':>15s} {'recv/GPU max':>15s} {'padding max':>15s} "
          f"{'peak extra':>15s} {'redundant max':>15s}")
    for name, s in report["strategies"].items():
        print(f"{name:13s} {_gib(s['bytes_per_gpu_mean']):>15s} {_gib(s['bytes_per_gpu_max']):>15s} "
              f"{_gib(s['padding_bytes_per_gpu_max']):>15s} {_gib(s['peak_extra_bytes_per_gpu']):>15s} "
              f"{_gib(s['redundant_bytes_per_gpu_max']):>15s}")
    if "lora" in report:
        lo = report["lora"]
        print(f"\nLoRA r={lo['rank']} on {','.join(lo['targets'])}: {lo['adapter_params']:,} adapter params "
              f"({lo['adapter_share']:.4f} of the model; gradients and optimizer states for these only)")
        print(f"reference: {lo['reference']}")
        print(f"rollout pool sync per rank: {_gib(lo['sync_bytes_per_rollout_rank'])} adapters vs "
              f"{_gib(lo['full_sync_bytes_per_rollout_rank'])} full (ratio "
              f"{lo['sync_bytes_per_rollout_rank'] / lo['full_sync_bytes_per_rollout_rank']:.4f})")
        print(f"merged generation: {_gib(lo['merge_kept_bytes_per_gpu'])} of frozen base kept aside per GPU")


def _print_auto(report: dict) -> None:
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


def _resolved(args: argparse.Namespace) -> argparse.Namespace:
    """The arguments with every model that is a hub id or tiny:<name> as its local folder (presets, folders and
    the words same / none unchanged). ModelReferenceError when a hub id is neither cached nor reachable."""
    # start-up time: the model references import torch, which `hybridrl --help` does without
    from hybridrl.models.hub import is_hub_reference, resolve_model
    from hybridrl.models.tiny import TINY_PREFIX

    resolved = argparse.Namespace(**vars(args))
    for option in ("model", "critic_model", "reward_model", "judge_model", "teacher_model"):
        ref = getattr(args, option, None)
        if ref and ref not in PRESETS and (is_hub_reference(ref) or ref.startswith(TINY_PREFIX)):
            setattr(resolved, option, resolve_model(ref, "--" + option.replace("_", "-")))
    return resolved


def run(args: argparse.Namespace) -> int:
    if args.memory:
        return _run_memory(args)
    if not args.model:
        print("hybridrl plan: give --model (or --memory CONFIG)", file=sys.stderr)
        return 2
    if args.auto:
        return _run_auto(args)
    try:
        report = build_report(_resolved(args))
    except (LayoutError, ValueError) as exc:
        print(f"hybridrl plan: {exc}", file=sys.stderr)
        return 2
    report["model"] = args.model  # as given (a hub id, not its cache folder)
    if args.json:
        print(json.dumps(report))
    else:
        _print_text(report)
    return 0


def _run_memory(args: argparse.Namespace) -> int:
    """`hybridrl plan --memory CONFIG`: the config planned as `hybridrl train` plans it, then each pool's ledger."""
    # start-up time: the trainer's plan imports the model and rollout packages; only this command needs them
    from hybridrl.automap.hardware import gpu
    from hybridrl.config import ConfigError, load_config
    from hybridrl.trainer.plan import plan_run
    from hybridrl.trainer.plan_memory import plan_memory

    if args.gpu not in GPUS:
        print(f"hybridrl plan --memory: --gpu {args.gpu!r} is not a known device type; choose one of "
              f"{', '.join(sorted(GPUS))}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.memory, args.overrides)
        ledgers = plan_memory(plan_run(cfg, on_gpu=True), cfg, gpu(args.gpu))
    except (ConfigError, ValueError, OSError) as exc:
        print(f"hybridrl plan --memory: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({pool: ledger.to_json() for pool, ledger in ledgers.items()}))
    else:
        for pool, ledger in ledgers.items():
            print(ledger.summary(pool, args.gpu))
            for phase, nbytes in ledger.phases.items():
                print(f"  {phase:24s} {_gib(nbytes)}")
    return 0 if all(ledger.fits for ledger in ledgers.values()) else 3


def _run_auto(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    if args.gpu not in GPUS:  # checked here, not by argparse: one line, not its usage block
        print(f"hybridrl plan --auto: --gpu {args.gpu!r} is not a known device type; choose one of "
              f"{', '.join(sorted(GPUS))}", file=sys.stderr)
        return 2
    try:
        report = plan_auto.build_report(_resolved(args))
        report["model"] = args.model  # as given (a hub id, not its cache folder)
        if args.write_config:  # the config names the models as given (a hub id stays a hub id)
            plan_auto.write_config(report, args.model, args.nodes_of, args.write_config, args.reward_model,
                                   judge_model=args.judge_model, teacher_model=args.teacher_model)
    except (LayoutError, ValueError) as exc:
        print(f"hybridrl plan --auto: {exc}", file=sys.stderr)
        return 2
    report["candidates"]["total_s"] = round(time.perf_counter() - start, 3)
    if args.json:
        print(json.dumps(report))
    else:
        _print_auto(report)
        if args.write_config:
            print(f"wrote {args.write_config}")
    return 0

"""`hybridrl plan`: the 3D-HybridEngine plan and the per-GPU transition cost of every strategy.

    hybridrl plan --model llama-70b --train-tp 8 --train-pp 8 --train-dp 2 --gen-tp 8 --gen-pp 1 [--json]
    hybridrl plan --model qwen3-30b-a3b --train-tp 4 --train-dp 4 --train-ep 4 --gen-tp 4 [--gen-ep 1]
    hybridrl plan --auto --model llama-70b --algorithm ppo --gpus 128 --gpu a100-80g [--json]  (automap/plan_auto.py)

Sizes come from the real parameter shapes of the model built on the meta device (no memory needed).
"""
from __future__ import annotations

import argparse
import json
import sys

from hybridrl.hybrid_engine.model_shapes import DTYPE_BYTES, PRESETS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help=f"preset ({', '.join(PRESETS)}) or a local Hugging Face config folder")
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
    parser.add_argument("--gen-ep", type=int, default=1,
                        help="generation expert-parallel size (divides --train-ep; the rollout engines run 1)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16", help="parameter dtype")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--per-rank", action="store_true", help="also list every rank's shard and costs")
    from hybridrl.automap import plan_auto

    plan_auto.add_arguments(parser)


def _gib(n: float) -> str:
    return f"{n / 2**30:9.3f} GiB"


def build_report(args: argparse.Namespace) -> dict:
    """Validate (before building anything), build the plan and account every strategy."""
    from hybridrl.hybrid_engine.accounting import account_all
    from hybridrl.hybrid_engine.model_shapes import model_shapes
    from hybridrl.hybrid_engine.plan import HybridEnginePlan
    from hybridrl.parallel.generation import GenerationLayout, check_generation_layout
    from hybridrl.parallel.layout import ParallelLayout

    train = ParallelLayout(tp=args.train_tp, pp=args.train_pp, dp=args.train_dp, ep=args.train_ep,
                           etp=args.train_etp)
    gen = GenerationLayout(tp=args.gen_tp, pp=args.gen_pp, ep=args.gen_ep)
    check_generation_layout(train, gen)  # layout-only checks first: cheap, before the model is built
    shapes = model_shapes(args.model)
    plan = HybridEnginePlan(train, gen, shapes, dtype_bytes=DTYPE_BYTES[args.dtype])
    costs = account_all(plan)
    report = {
        "model": args.model, "dtype": args.dtype, "model_bytes": plan.model_bytes,
        "expert_bytes": plan.expert_bytes, "num_experts": shapes.num_experts,
        "train": {"tp": train.tp, "pp": train.pp, "dp": train.dp, "ep": train.ep, "expert_tp": train.expert_tp},
        "gen": {"tp": gen.tp, "pp": gen.pp, "ep": gen.ep, "micro_dp": plan.groups.micro_dp_size,
                "dp": plan.groups.gen_dp_size},
        "expert_gather_groups": plan.expert_gather_groups("hybrid"),
        "micro_dp_groups": plan.groups.micro_dp_groups(),
        "gen_tp_groups": plan.groups.gen_tp_groups(),
        "gen_pp_groups": plan.groups.gen_pp_groups(),
        "gen_dp_groups": plan.groups.gen_dp_groups(),
        "strategies": {name: cost.summary() for name, cost in costs.items()},
    }
    if args.per_rank:
        report["ranks"] = [plan.describe_rank(r) for r in train.ranks()]
        report["per_rank_costs"] = {name: cost.per_rank() for name, cost in costs.items()}
    return report


def _print_text(report: dict) -> None:
    tr, ge = report["train"], report["gen"]
    print(f"model {report['model']} ({report['dtype']}): M = {report['model_bytes']:,} bytes "
          f"({report['model_bytes'] / 2**30:.2f} GiB)")
    if report["num_experts"]:
        print(f"experts: {report['num_experts']} per MoE layer, E = {report['expert_bytes'] / 2**30:.2f} GiB; "
              f"training ep={tr['ep']} expert_tp={tr['expert_tp']} -> generation e_g={ge['ep']}")
    print(f"training p={tr['pp']} t={tr['tp']} d={tr['dp']} -> generation p_g={ge['pp']} t_g={ge['tp']} "
          f"d_g={ge['micro_dp']} d={tr['dp']} ({ge['dp']} generation replicas)")
    for key in ("expert_gather_groups", "micro_dp_groups", "gen_tp_groups", "gen_pp_groups"):
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


def run(args: argparse.Namespace) -> int:
    from hybridrl.parallel.layout import LayoutError

    if args.auto:
        from hybridrl.automap import plan_auto

        return plan_auto.run(args)
    try:
        report = build_report(args)
    except (LayoutError, ValueError) as exc:
        print(f"hybridrl plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
    else:
        _print_text(report)
    return 0

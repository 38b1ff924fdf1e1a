"""What the device-mapping search (hybridrl/automap) picks for the HybridFlow paper's settings, beside the
paper's placements and layouts, both estimated under the same cost model.

    python benchmarks/auto_map.py [--gpus 8 16 32 64 96 128] [--algorithms ppo remax safe_rlhf]

Settings (HybridFlow §8.1, arXiv 2409.19256, read in this session): Llama 7B/13B/34B/70B, actor = critic =
reference = reward size, 16 x 8 A100-80GB, NVLink 600 GB/s, 200 Gb/s between nodes, 1024 prompts of 1024
tokens, 1024-token responses, 1 PPO epoch of 8 update iterations, bf16 weights, fp32 gradients and Adam.
Writes benchmarks/results/auto_map.{json,md}. Every number here is modelled (hybridrl/automap/cost.py).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from _results import default_meta, write_results  # noqa: E402

from hybridrl.automap.cost import Workload  # noqa: E402
from hybridrl.automap.hardware import gpu  # noqa: E402
from hybridrl.automap.pools import STAGES  # noqa: E402
from hybridrl.automap.search import UNITS, Mapper, make_problem  # noqa: E402

MODELS = ("llama-7b", "llama-13b", "llama-34b", "llama-70b")
# Fig. 14 captions (verified): actor training (t, p) -> generation (t_g, p_g)
FIG14 = {"llama-7b": (8, 1, 2, 1), "llama-13b": (8, 1, 4, 1), "llama-34b": (8, 4, 8, 1), "llama-70b": (8, 8, 8, 1)}


def paper_placement(model: str, gpus: int, critic: str | None) -> tuple[list[tuple[str, int]], str]:
    """The paper's placement for a PPO setting as [(units, devices)] and where it comes from."""
    half = gpus // 2
    if critic == "llama-70b":  # Fig. 13 text: 13B actor/ref, 70B critic/reward
        if gpus <= 64:
            return [("actor+ref+critic+reward", gpus)], "Fig. 13 text: colocate up to 64 GPUs (verified)"
        if gpus == 96:
            return [("actor+ref", half), ("critic+reward", half)], \
                "Fig. 13 text: split at 96 (verified); even halves assumed"
        return [("actor+ref+reward", 64), ("critic", 64)], "Fig. 13 text: actor+ref+reward 64 | critic 64 (verified)"
    if model in ("llama-13b", "llama-34b"):
        if gpus <= 64:
            return [("actor+ref+critic+reward", gpus)], "Fig. 12 text: colocate for 16-64 GPUs (verified)"
        if model == "llama-13b" and gpus == 128:
            return [("actor", 64), ("critic", 32), ("ref", 16), ("reward", 16)], \
                "Fig. 12 text: standalone 64/32/16/16 (verified)"
        return [("actor+ref", half), ("critic+reward", half)], "Fig. 12 text: split, even halves (verified)"
    return [("actor+ref+critic+reward", gpus)], "not stated in the paper: colocate assumed"


def _units_to_roles(units: str, roles: tuple[str, ...]) -> tuple[str, ...]:
    members = {r for u in units.split("+") for r in UNITS[u]}
    return tuple(r for r in roles if r in members)


def paper_mapping(mapper: Mapper, placement: list[tuple[str, int]], model: str):
    """The paper's placement with Fig. 14's actor layout (where its t*p divides the actor's pool); other pools
    and colocated roles get the best layout of the same model (the paper does not give theirs)."""
    prob = mapper.prob
    t, p, tg, pg = FIG14[model]
    pools, notes = [], []
    for units, devices in placement:
        roles = _units_to_roles(units, prob.roles)
        if not roles:
            continue
        fixed = None
        if "actor" in roles:
            if devices % (t * p) == 0:
                fixed = (t, p, tg, pg)
            else:
                notes.append(f"Fig. 14 layout t*p={t * p} does not divide the actor's {devices} GPUs: best layout used")
        pools.append((roles, devices, fixed))
    mapping = mapper.evaluate(pools)
    if mapping is None and any(f for _, _, f in pools):
        notes.append("Fig. 14 layout does not fit memory here: best layout used")
        mapping = mapper.evaluate([(r, d, None) for r, d, _ in pools])
    return mapping, notes


def _layout(mapping) -> str:
    """The actor's (t,p,d)->(t_g,p_g)."""
    actor = next(p for p in mapping.pools if "actor" in p.roles)
    return f"({actor.tp},{actor.pp},{actor.dp})->({actor.gen_tp},{actor.gen_pp})"


def _reasons(pick, paper) -> str:
    """Stages where the two differ by more than 5%, with the actor layouts."""
    out = []
    for name, a, b in zip(STAGES, pick.stages, paper.stages):
        if abs(a - b) > 0.05 * max(a, b, 1e-9):
            out.append(f"{name} {b:.0f}->{a:.0f} s")
    if _layout(pick) != _layout(paper):
        out.append(f"actor {_layout(paper)} vs {_layout(pick)}")
    if pick.label.split(" | ") != paper.label.split(" | ") and pick.kind != paper.kind:
        out.append(f"{paper.kind} -> {pick.kind}")
    return "; ".join(out) or "same mapping"


def run_setting(alg: str, model: str, gpus: int, critic: str | None = None) -> dict | None:
    a100 = gpu("a100-80g")
    work = Workload(prompts=1024, prompt_len=1024, response_len=1024, greedy=alg == "remax", mini_batches=8)
    row: dict = {"algorithm": alg, "model": model + (f" (critic/reward {critic})" if critic else ""), "gpus": gpus}
    results = {}
    for execution in ("hybridflow", "trainer"):
        prob = make_problem(model, alg, a100, gpus, work, critic_model=critic, reward_model=critic or "same",
                            cost_model=critic or "same")
        mapper = Mapper(prob, execution)
        try:
            results[execution] = (mapper, mapper.search(top_k=1))
        except ValueError:
            return None  # does not fit at this size
    mapper, result = results["hybridflow"]
    pick = result.best
    row.update(pick=pick.label, pick_kind=pick.kind, pick_actor=_layout(pick), pick_s=round(pick.step_s, 1),
               pick_stages={s: round(v, 1) for s, v in zip(STAGES, pick.stages)},
               pick_tokens_per_s=round(1024 * 2048 / pick.step_s),
               simulations=result.counts["simulations"], mappings=result.counts["mappings"],
               search_s=round(result.seconds, 2))
    if alg == "ppo":
        placement, source = paper_placement(model, gpus, critic)
    else:
        units = "+".join(u for u, members in UNITS.items() if members[0] in mapper.prob.roles)
        placement, source = [(units, gpus)], "not stated in the paper: colocate assumed"
    paper, notes = paper_mapping(mapper, placement, model)
    row.update(paper_placement=" | ".join(f"{u}:{d}" for u, d in placement), paper_source=source,
               paper_fig14_actor="({},{})->({},{})".format(*FIG14[model]))
    if paper is None:
        row.update(paper_s=None, reasons="the paper's placement does not fit memory under this model")
    else:
        row.update(paper_actor=_layout(paper), paper_s=round(paper.step_s, 1),
                   paper_stages={s: round(v, 1) for s, v in zip(STAGES, paper.stages)},
                   speedup=round(paper.step_s / pick.step_s, 3), reasons="; ".join([_reasons(pick, paper)] + notes))
    tmapper, tresult = results["trainer"]
    row.update(trainer_pick=tresult.best.label, trainer_actor=_layout(tresult.best),
               trainer_s=round(tresult.best.step_s, 1))
    return row


def generation_layouts(model: str) -> list[dict]:
    """Fig. 15's experiment: 16 GPUs, all colocated, training 1-8-2 (p-t-d), t_g from 1 to 8."""
    work = Workload(prompts=1024, prompt_len=1024, response_len=1024, mini_batches=8)
    mapper = Mapper(make_problem(model, "ppo", gpu("a100-80g"), 16, work), "hybridflow")
    rows = []
    for tg in (1, 2, 4, 8):
        m = mapper.evaluate([(mapper.prob.roles, 16, (8, 1, tg, 1))])
        actor = m.pools[0] if m else None
        rows.append({"model": model, "t_g": tg, "generation_s": round(actor.ops["actor.generate"], 2) if m else None,
                     "transition_s": round(actor.ops["actor.transition"], 3) if m else None,
                     "step_s": round(m.step_s, 1) if m else None})
    return rows


COLUMNS = ["algorithm", "model", "gpus", "paper_placement", "paper_source", "paper_actor", "paper_s", "pick",
           "pick_actor", "pick_s", "speedup", "reasons", "trainer_pick", "trainer_s", "simulations", "search_s"]

NOTES = """
## How to read this

- `paper_*`: the paper's placement (§8.3 text for Fig. 12: PPO 13B/34B; Fig. 13: 13B actor/ref with 70B
  critic/reward; read in this session from the paper's text, so *verified* where the source says so) with the
  actor's Fig. 14 layout (t,p -> t_g,p_g; verified from the figure captions), estimated under our cost model.
  Where the paper gives no placement (7B, 70B, ReMax, Safe-RLHF) colocate is *assumed* (its §9 insight for
  small clusters); the paper does not give the other models' layouts, so those are the model's best
  (colocated roles share the actor's layout, as hybridrl's trainer requires). The paper's figures give
  throughput only as bars; no paper time is quoted here.
- `pick`: the search's best mapping under HybridFlow's execution model (pools of whole nodes, different pools
  run a stage in parallel); `*_actor` is the actor's (t,p,d)->(t_g,p_g); `speedup` = paper mapping time / pick
  time, both modelled.
- `trainer_pick`: the best mapping for `hybridrl train` as it runs today (calls in sequence, each pool spread
  over all nodes), also modelled.
- `reasons`: the stages whose modelled time differs by more than 5% (paper -> pick) and the layout change.

## Why the picks differ from the paper (the model's assumptions, not measurements)

- Cross-node data parallelism is expensive in this model: gradient reduce-scatter + parameter all-gather of
  the distributed optimizer go over the testbed's 200 Gb/s per node without overlap with the backward pass.
  The model therefore prefers pipeline stages (small p2p messages, bubble amortised over 128 micro-batches of
  a 128-sequence mini-batch per replica) and smaller TP (TP all-reduces are not overlapped either) over
  Fig. 14's t=8, where Megatron on the real testbed overlaps the DP reduce and hides part of it.
- Decode is modelled as memory-bandwidth bound, and with 1024 + 1024-token sequences the KV-cache reads
  dominate the weight reads, so the generation TP size matters less here than in Fig. 15 (where t_g=2 for 7B
  cut generation 60.3% vs t_g=8 on vLLM 0.3.1, whose per-step overheads this model does not have).
- Colocated roles share one layout (hybridrl's trainer); the paper lets each model in a colocated set choose
  its own, so its colocated mappings can be better than what this model gives them.
- Split placements win in this model sooner than in the paper: its d_cost lets the two pools' preparation
  and training stages overlap perfectly, with no dispatch or data-resharding cost between pools.
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64, 96, 128])
    parser.add_argument("--algorithms", nargs="+", default=["ppo", "remax", "safe_rlhf"])
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = parser.parse_args()
    start = time.perf_counter()
    rows = []
    for alg in args.algorithms:
        for model in MODELS:
            for gpus in args.gpus:
                row = run_setting(alg, model, gpus)
                if row is not None:
                    rows.append(row)
                    print(f"{alg:9s} {model:9s} {gpus:4d}: pick {row['pick']} {row['pick_s']} s; paper "
                          f"{row['paper_placement']} {row['paper_s']} s", flush=True)
    if "ppo" in args.algorithms:
        for gpus in args.gpus:
            row = run_setting("ppo", "llama-13b", gpus, critic="llama-70b")
            if row is not None:
                rows.append(row)
    fig15 = generation_layouts("llama-7b") + generation_layouts("llama-13b")
    meta = {**default_meta(), "hardware": gpu("a100-80g").describe(), "workload": "1024 prompts x (1024 + 1024) "
            "tokens, 1 epoch x 8 mini-batches, bf16 + fp32 grads/Adam", "runtime_s": round(time.perf_counter() - start, 1),
            "estimates": "modelled by hybridrl/automap/cost.py, not measured"}
    json_path, md_path = write_results("auto_map", rows, meta, COLUMNS, args.out)
    payload = json.loads(json_path.read_text())
    payload["generation_layouts_16_gpus"] = fig15
    json_path.write_text(json.dumps(payload, indent=1) + "\n")
    fig15_md = ["", "## Generation layout on 16 GPUs (Fig. 15's experiment: PPO, all colocated, training 1-8-2)", "",
                "Paper (verified text): t_g=2 best for 7B (-60.3% generation vs t_g=8), t_g=4 best for 13B (-36.4%).",
                "", "| model | t_g | generation (s) | transition (s) | step (s) |", "|---|---|---|---|---|"]
    fig15_md += [f"| {r['model']} | {r['t_g']} | {r['generation_s']} | {r['transition_s']} | {r['step_s']} |"
                 for r in fig15]
    md_path.write_text(md_path.read_text() + NOTES + "\n".join(fig15_md) + "\n")
    print(f"wrote {json_path} and {md_path} in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

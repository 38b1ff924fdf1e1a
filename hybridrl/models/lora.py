"""LoRA adapters inside Megatron-Core's tensor-parallel linears, at any TP / PP / SP, dense and mixture-of-experts.

A targeted linear keeps its class's behaviour and gains a `lora` child (LoraAdapter): its forward returns the
base output plus (alpha / r) * B A x. The adapters follow the linear's own tensor-parallel split (DESIGN.md,
"Memory-scaling features"):
- column-parallel (the fused QKV, the SwiGLU fc1): A [r, in] replicated, B [out/tp, r] sharded with the output.
  The fused linears hold one adapter per Hugging Face projection (q, k, v; gate, up), as peft does, their A's
  stacked into one matmul and their B outputs laid out in Megatron's fused order (QKV interleaved per query
  group, fc1 as [gate; up]);
- row-parallel (attention proj, fc2): A [r, in/tp] sharded with the input, B [out, r] replicated.
Only r-wide activations cross the TP group: column h = A x is copied in (its gradient all-reduced; sequence
parallel: all-gathered along the sequence), row A x is all-reduced (sequence parallel: reduce-scattered). Where
a replicated factor's gradient is a per-rank partial sum (sequence parallel; experts, whose comms the token
dispatcher does) it is tagged `sequence_parallel`, so Megatron's finalize_model_grads sums it over TP.

Every other parameter is frozen (requires_grad False): Megatron's DDP and (distributed) optimizer then hold
gradients and optimizer states for the adapters only (a critic's value head stays trainable). Adapter parameters
are named `<linear>.lora.a` / `<linear>.lora.b.<i>`; models/builder.py's named_global_parameters leaves them out,
so conversion, export and the hybrid engine see the base model. Full (unsharded) adapters travel by Hugging Face
module name (models/lora_state.py: peft's layout, gathered and sharded here per part).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from hybridrl.config import LORA_INITS, LoraConfig

# the parts (Hugging Face projections) of each Megatron linear, in Megatron's fused output order
PARTS_OF = {"qkv": ("q", "k", "v"), "proj": ("o",), "fc1": ("gate", "up"), "fc2": ("down",), "output": ("lm_head",)}
ROW_PARALLEL = ("proj", "fc2")
# `all` is every decoder linear; the output layer (vocab-parallel lm_head) only when named, as in peft's all-linear
ALL_PARTS = frozenset(p for kind, parts in PARTS_OF.items() if kind != "output" for p in parts)
# target_modules names: Megatron's linears, Hugging Face's projections (Mixtral's experts: w1 gate, w3 up, w2 down)
TARGET_NAMES = {"all": ALL_PARTS, "all-linear": ALL_PARTS, **{k: frozenset(v) for k, v in PARTS_OF.items()},
                "q_proj": {"q"}, "k_proj": {"k"}, "v_proj": {"v"}, "o_proj": {"o"}, "gate_proj": {"gate"},
                "up_proj": {"up"}, "down_proj": {"down"}, "w1": {"gate"}, "w3": {"up"}, "w2": {"down"},
                "lm_head": {"lm_head"}}


def resolve_targets(names: list[str] | tuple[str, ...] | None) -> frozenset[str]:
    """The parts a target_modules list names (None: all). ValueError names an unknown entry."""
    parts: set[str] = set()
    for name in names if names is not None else ["all"]:
        if name not in TARGET_NAMES:
            raise ValueError(f"lora.target_modules: unknown {name!r}; choose from qkv, proj, fc1, fc2, all, output or "
                             f"the Hugging Face names {sorted(n for n in TARGET_NAMES if n.endswith('_proj'))}, lm_head")
        parts |= TARGET_NAMES[name]
    if not parts:
        raise ValueError("lora.target_modules is empty: name at least one linear (e.g. all)")
    return frozenset(parts)


def linear_kind(module_name: str) -> str | None:
    """qkv | proj | fc1 | fc2 for a Megatron decoder linear's module name (dense MLP, expert, shared expert)."""
    if module_name.endswith("self_attention.linear_qkv"):
        return "qkv"
    if module_name.endswith("self_attention.linear_proj"):
        return "proj"
    if ".mlp." in f".{module_name}" and module_name.rsplit(".", 1)[-1] in ("linear_fc1", "linear_fc2"):
        return "fc1" if module_name.endswith("fc1") else "fc2"
    return "output" if module_name == "output_layer" else None


def is_adapter_param(name: str) -> bool:
    return ".lora." in f".{name}"


def _tp(linear: Any) -> tuple[Any, int, int]:
    group = getattr(linear, "tp_group", None)
    if group is None or not torch.distributed.is_initialized():
        return None, 1, 0
    return group, torch.distributed.get_world_size(group), torch.distributed.get_rank(group)


@dataclass(frozen=True)
class Slot:
    """One Hugging Face projection inside a (possibly fused) Megatron linear's local output."""
    part: str
    rows: int  # output rows per group on this rank (column) or all output rows (row-parallel)


class LoraAdapter(torch.nn.Module):
    """The adapters of one Megatron linear on this rank (see the module docstring for the split)."""

    def __init__(self, linear: Any, kind: str, parts: list[str], hf_modules: dict[str, str], cfg: LoraConfig,
                 rank: int, alpha: float) -> None:
        super().__init__()
        self.kind, self.parts, self.hf_modules = kind, parts, hf_modules
        self.row = kind in ROW_PARALLEL
        self.rank, self.scaling, self.dropout = rank, alpha / rank, float(cfg.dropout)
        self.tp_group, self.tp_size, self.tp_rank = _tp(linear)
        self.groups, self.slots = _slots(linear, kind, self.tp_size)
        # experts: the token dispatcher gathers their inputs and reduces their outputs, not the linear
        self.expert_comm = bool(getattr(linear, "explicit_expert_comm", False))
        self.sequence_parallel = bool(getattr(linear, "sequence_parallel", False)) and not self.expert_comm
        if self.expert_comm and self.tp_size > 1:
            _check_expert_tp(linear, self.tp_group)
        self.active = True
        self.vocab_rows: int | None = None  # the output layer: the real vocabulary (its B pads rows to Megatron's)
        weight = linear.weight
        out_local, in_local = weight.shape
        factory = dict(dtype=weight.dtype, device=weight.device)
        if self.row:
            self.a = torch.nn.Parameter(torch.zeros(rank, in_local, **factory))
            self.b = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(out_local, rank, **factory))])
        else:
            self.a = torch.nn.Parameter(torch.zeros(rank * len(parts), in_local, **factory))
            rows = {s.part: s.rows * self.groups for s in self.slots}
            self.b = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(rows[p], rank, **factory))
                                             for p in parts])
        self._mark(linear)

    def _mark(self, linear: Any) -> None:
        """Megatron's parameter attributes: TP split (grad-norm dedup, checkpoints), expert placement (DDP)."""
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        allreduce = getattr(linear.weight, "allreduce", True)
        sharded, replicated = ([self.a], list(self.b)) if self.row else (list(self.b), [self.a])
        for param in sharded:
            set_tensor_model_parallel_attributes(param, True, 1 if self.row else 0, 1)
        # a replicated factor is a TP duplicate (counted once in the grad norm) where the linear is TP-split
        for param in replicated:
            set_tensor_model_parallel_attributes(param, self.tp_size == 1 and self.expert_comm, 0, 1)
            if self.tp_size > 1 and (self.sequence_parallel or self.expert_comm):
                param.sequence_parallel = True  # a per-rank partial gradient: finalize_model_grads sums it
        for param in self.parameters():
            param.allreduce = allreduce

    # ---- forward ---------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The delta (alpha / r) B A x in the layout of the linear's own output (before its bias)."""
        return self._delta(x, comm=self.tp_size > 1 and not self.expert_comm)

    def decode_delta(self, x: torch.Tensor) -> torch.Tensor:
        """The delta of a generation forward that does the linear's TP communication itself (fast_decode.py):
        column-parallel, x whole, this rank's output columns; row-parallel, x this rank's input slice, a partial
        sum the caller's all-reduce completes (B (A_shard x_shard) summed over ranks is B A x)."""
        return self._delta(x, comm=False)

    def _delta(self, x: torch.Tensor, comm: bool) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        if self.dropout and self.training:
            x = F.dropout(x, self.dropout)
        h = F.linear(x, self.a)
        if self.row:
            if comm:
                h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group) \
                    if self.sequence_parallel else mappings.reduce_from_tensor_model_parallel_region(h, self.tp_group)
            return F.linear(h, self.b[0]) * self.scaling
        if comm:
            h = mappings.gather_from_sequence_parallel_region(h, group=self.tp_group) if self.sequence_parallel \
                else mappings.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        outs = dict(zip(self.parts, (F.linear(hp, b) * self.scaling
                                     for hp, b in zip(h.split(self.rank, dim=-1), self.b))))
        return self._assemble(outs, h.shape[:-1], h)

    def _assemble(self, outs: dict[str, torch.Tensor], lead: tuple, like: torch.Tensor) -> torch.Tensor:
        """Per-part outputs [..., groups * rows] -> the fused linear's local output (zeros where untargeted)."""
        if len(self.slots) == 1:
            return outs[self.slots[0].part]
        pieces = [outs[s.part].reshape(*lead, self.groups, s.rows) if s.part in outs
                  else like.new_zeros((*lead, self.groups, s.rows)) for s in self.slots]
        return torch.cat(pieces, dim=-1).reshape(*lead, -1)

    def delta_weight(self) -> torch.Tensor:
        """(alpha / r) B A as this rank's shard of the linear's weight, in float32."""
        a, bs = self.a.detach().float(), [b.detach().float() for b in self.b]
        if self.row:
            return (bs[0] @ a) * self.scaling
        columns = a.shape[1]
        deltas = {p: (b @ ap) * self.scaling for p, b, ap in zip(self.parts, bs, a.split(self.rank, dim=0))}
        pieces = [deltas[s.part].reshape(self.groups, s.rows, columns) if s.part in deltas
                  else a.new_zeros((self.groups, s.rows, columns)) for s in self.slots]
        return torch.cat(pieces, dim=1).reshape(-1, columns)

    # ---- full (unsharded) factors by part ---------------------------------------------------------------
    def split_dim(self, factor: str) -> int | None:
        """The dim along which this rank holds a slice of a part's full factor ("A" / "B"), None: whole."""
        if self.tp_size == 1:
            return None
        if self.row:
            return 1 if factor == "A" else None
        return 0 if factor == "B" else None

    def local_factor(self, part: str, factor: str) -> torch.Tensor:
        """This rank's piece of a part's A [r, in] or B [out, r]."""
        i = self.parts.index(part)
        if factor == "A":
            return self.a if self.row else self.a[i * self.rank:(i + 1) * self.rank]
        return self.b[0] if self.row else self.b[i]

    def extra_repr(self) -> str:
        return f"{self.kind}: parts={self.parts}, r={self.rank}, scaling={self.scaling:g}, tp={self.tp_size}"


def _check_expert_tp(linear: Any, group: Any) -> None:
    """Split experts' replicated factors get their partial gradients summed by finalize_model_grads, which sums
    over the dense TP group when sequence parallelism is on: the experts' TP group must be that group."""
    from megatron.core import parallel_state

    dense = parallel_state.get_tensor_model_parallel_group()
    if not linear.config.sequence_parallel or \
            torch.distributed.get_process_group_ranks(group) != torch.distributed.get_process_group_ranks(dense):
        raise ValueError("LoRA on experts split over TP needs sequence parallelism and the experts' TP equal to the "
                         "TP (parallel.expert_tp unset or 1); or leave the experts out of lora.target_modules")


def _slots(linear: Any, kind: str, tp_size: int) -> tuple[int, list[Slot]]:
    """(groups, slots) of a linear's local output: QKV per query group [q, k, v], fc1 [gate; up]."""
    out_local = linear.weight.shape[0]
    config = linear.config
    if kind == "qkv":
        head_dim = config.kv_channels
        per_group = config.num_attention_heads // (config.num_query_groups or config.num_attention_heads)
        groups = out_local // ((per_group + 2) * head_dim)
        return groups, [Slot("q", per_group * head_dim), Slot("k", head_dim), Slot("v", head_dim)]
    if kind == "fc1":
        if not config.gated_linear_unit:
            raise ValueError("LoRA on fc1 needs a gated (SwiGLU) MLP; this model's MLP is not gated")
        return 1, [Slot("gate", out_local // 2), Slot("up", out_local // 2)]
    return 1, [Slot(PARTS_OF[kind][0], out_local)]


class _LoraLinear:
    """Mixed into a targeted linear's class: base output plus the adapters' (while they are active)."""

    lora: LoraAdapter

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        if self.lora.active:
            delta = self.lora(input_)
            if delta.shape[-1] != output.shape[-1]:  # the output layer gathered its vocab shards (generation)
                from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

                delta = gather_from_tensor_model_parallel_region(delta, group=self.tp_group)
            output = output + delta
        return output, bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The base's entries, with the adapters split along their own TP dims (the base class would call them
        replicated)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        adapter = self.lora
        tensors = {f"lora.{n}": p for n, p in adapter.named_parameters()}
        axes = {}
        if adapter.tp_size > 1:
            axes = {"lora.a": 1} if adapter.row else {f"lora.b.{i}": 0 for i in range(len(adapter.b))}
        state.update(make_sharded_tensors_for_checkpoint(tensors, prefix, axes, sharded_offsets,
                                                         tp_group=self.tp_group,
                                                         dp_cp_group=(metadata or {}).get("dp_cp_group")))
        return state


_CLASSES: dict[type, type] = {}


def _lora_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Lora{cls.__name__}", (_LoraLinear, cls), {})
    return _CLASSES[cls]


# ---- the model ---------------------------------------------------------------------------------------------
def attach_lora(model: Any, cfg: LoraConfig, *, hf_modules_of: Any, seed: int = 0,
                trainable: tuple[str, ...] = ()) -> list[LoraAdapter]:
    """Add adapters to every targeted linear of `model` (a GPTModel shard, before any DDP wrapper), freeze
    everything else except the parameters named in `trainable`, and initialise the adapters (cfg.init kaiming |
    gaussian; an adapter folder is loaded by the caller). hf_modules_of(module_name, kind) -> the Hugging Face
    module names of the linear's parts, in PARTS_OF order. Returns the adapters."""
    targets = resolve_targets(cfg.target_modules)
    rank = int(cfg.rank)
    if rank < 1:
        raise ValueError(f"lora.rank={cfg.rank}: give a rank >= 1 (or an adapter folder as lora.init)")
    alpha = float(cfg.alpha if cfg.alpha is not None else rank)
    for param in model.parameters():
        param.requires_grad_(False)
    adapters = []
    for name, module in list(model.named_modules()):
        kind = linear_kind(name)
        if kind is None or isinstance(module, _LoraLinear) or not hasattr(module, "weight"):
            continue
        parts = [p for p in PARTS_OF[kind] if p in targets]
        if not parts:
            continue
        if kind == "output" and (getattr(module, "weight", None) is None or not hasattr(module, "gather_output")):
            raise ValueError("lora.target_modules names the output layer (lm_head), which this model ties to its "
                             "input embedding (or replaces by a scalar head): leave it out")
        if module.weight is None or module.weight.dim() != 2:
            raise ValueError(f"LoRA cannot wrap {name} ({type(module).__name__}): not a plain 2-D linear (grouped "
                             f"experts); target other modules")
        hf = dict(zip(PARTS_OF[kind], hf_modules_of(name, kind)))
        adapter = LoraAdapter(module, kind, parts, {p: hf[p] for p in parts}, cfg, rank, alpha)
        if kind == "output":
            adapter.vocab_rows = int(model.hybridrl_args.vocab_size)
        module.lora = adapter
        module.__class__ = _lora_class(type(module))
        adapters.append(adapter)
    if not adapters:
        raise ValueError(f"lora.target_modules={cfg.target_modules}: no linear of this model matches")
    named = dict(model.named_parameters())
    for key in trainable:
        if key in named:
            named[key].requires_grad_(True)
    if cfg.init in LORA_INITS:
        init_adapters(adapters, cfg.init, seed)
    return adapters


def _generator(seed: int, name: str) -> torch.Generator:
    """A generator per Hugging Face module: the same initial adapter at every TP / PP layout."""
    digest = sum((i + 1) * ord(c) for i, c in enumerate(name)) % (1 << 31)
    return torch.Generator().manual_seed((seed * 1_000_003 + digest) % (1 << 62))


@torch.no_grad()
def init_adapters(adapters: list[LoraAdapter], init: str, seed: int) -> None:
    """peft's initialisations: A kaiming-uniform (a = sqrt(5)) or normal(0, 1/r), B zero; each A drawn whole
    from its module's own generator, then sliced for this rank."""
    for adapter in adapters:
        for part in adapter.parts:
            a = adapter.local_factor(part, "A")
            full = torch.empty(adapter.rank, _full_in(adapter, a))
            if init == "gaussian":
                torch.nn.init.normal_(full, std=1.0 / adapter.rank, generator=_generator(seed, adapter.hf_modules[part]))
            else:
                torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=_generator(seed, adapter.hf_modules[part]))
            a.copy_(shard(full, adapter, "A"))
            adapter.local_factor(part, "B").zero_()


def _full_in(adapter: LoraAdapter, a_local: torch.Tensor) -> int:
    return a_local.shape[1] * (adapter.tp_size if adapter.split_dim("A") == 1 else 1)


def shard(full: torch.Tensor, adapter: LoraAdapter, factor: str) -> torch.Tensor:
    """This rank's piece of a full factor (plain chunks: a part's rows / columns split evenly over TP)."""
    dim = adapter.split_dim(factor)
    if dim is None:
        return full
    return torch.chunk(full, adapter.tp_size, dim=dim)[adapter.tp_rank]


def adapters_of(model: Any) -> list[LoraAdapter]:
    return [m for m in model.modules() if isinstance(m, LoraAdapter)]


@contextmanager
def adapters_disabled(model: Any) -> Iterator[None]:
    """The base model: forwards skip the adapters (the reference policy of a LoRA actor)."""
    adapters = adapters_of(model)
    states = [a.active for a in adapters]
    for a in adapters:
        a.active = False
    try:
        yield
    finally:
        for a, state in zip(adapters, states):
            a.active = state


def lora_linears(model: Any) -> list[Any]:
    return [m for m in model.modules() if isinstance(m, _LoraLinear)]


class MergedWeights:
    """W + (alpha / r) B A written into the targeted linears' weights (adapters inactive meanwhile), and W put
    back bit for bit by restore(): the frozen base is kept aside while merged (a subtraction would round)."""

    def __init__(self, model: Any) -> None:
        self.adapters = adapters_of(model)
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for linear in lora_linears(model):
                weight = linear.weight
                self.kept.append((weight, weight.detach().clone()))
                weight.copy_((weight.float() + linear.lora.delta_weight()).to(weight.dtype))
                linear.lora.active = False

    @property
    def kept_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.kept)

    def restore(self) -> None:
        with torch.no_grad():
            for weight, kept in self.kept:
                weight.copy_(kept)
        for adapter in self.adapters:
            adapter.active = True
        self.kept = []


@contextmanager
def merged_adapters(model: Any) -> Iterator[MergedWeights | None]:
    """W + BA in the weights for the block (exported, sent, generated with), W restored after; a model without
    adapters is left as it is (None)."""
    merged = MergedWeights(model) if adapters_of(model) else None
    try:
        yield merged
    finally:
        if merged is not None:
            merged.restore()


# HF projection name -> part (the adapter count of a model known by its HF tensor shapes, e.g. hybridrl plan)
_PART_OF_HF = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
               "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down", "lm_head": "lm_head"}


def adapter_numel(named_shapes: Any, rank: int, targets: list[str] | None) -> int:
    """Adapter parameters (rank x (in + out) per adapted projection) of a model given as (HF name, shape) pairs."""
    parts = resolve_targets(targets)
    total = 0
    for name, shape in named_shapes:
        if name.endswith(".weight") and len(shape) == 2:
            projection = name[:-len(".weight")].rsplit(".", 1)[-1]
            if _PART_OF_HF.get(projection) in parts:
                total += rank * (shape[0] + shape[1])
    return total

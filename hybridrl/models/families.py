"""HF <-> Megatron-Core conversion tables, once per model family (Llama, Qwen2, Qwen3; Qwen2-MoE, Qwen3-MoE,
Mixtral).

Conventions used everywhere in hybridrl:
- A *Megatron name* is a parameter name of a Megatron GPTModel with GLOBAL layer numbers (what a
  TP=1, PP=1 model's `named_parameters()` shows), e.g. `decoder.layers.7.mlp.linear_fc1.weight`.
- A *full* Megatron tensor is the tensor that TP=1 model holds (canonical layout): QKV interleaved per
  query group `[q_g0, k_g0, v_g0, q_g1, ...]`, SwiGLU fc1 as `[gate; up]`, vocab rows padded to the
  Megatron (padded) vocab size. `tp_shard` / `tp_gather` convert between a full tensor and TP shards
  (fc1 is the one tensor whose shards are not plain chunks of the full tensor).
- Mixture-of-experts layers: `{e}` in a name template is the GLOBAL expert number (what an EP=1 model shows
  as `mlp.experts.local_experts.{e}`); each expert's fc1 is a SwiGLU fc1 like a dense MLP's. HF checkpoints
  store experts one by one (transformers 5 fuses them in memory only and splits them again on save).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

# Kinds of mapping between one Megatron tensor and its HF tensor(s).
PLAIN = "plain"      # same tensor, same layout
VOCAB = "vocab"      # rows are vocab entries: Megatron pads rows to its padded vocab size
QKV = "qkv"          # Megatron fused QKV <- HF q_proj, k_proj, v_proj
GATE_UP = "gate_up"  # Megatron fused fc1 <- HF gate_proj, up_proj


class UnsupportedModelError(ValueError):
    """A Hugging Face model/config hybridrl cannot build or convert."""


@dataclass(frozen=True)
class ConversionRule:
    kind: str
    hf_names: tuple[str, ...]


@dataclass(frozen=True)
class ModelDims:
    """The sizes the conversion needs, read once from a HF config."""
    hidden: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden: int
    num_layers: int
    vocab_size: int
    moe: "MoeDims | None" = None

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_query_groups

    @staticmethod
    def from_hf(hf_config: Any) -> "ModelDims":
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        return ModelDims(hidden=hf_config.hidden_size, num_heads=heads,
                         num_query_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
                         head_dim=head_dim, ffn_hidden=hf_config.intermediate_size,
                         num_layers=hf_config.num_hidden_layers, vocab_size=hf_config.vocab_size,
                         moe=MoeDims.from_hf(hf_config))


@dataclass(frozen=True)
class MoeDims:
    """A mixture-of-experts config: experts, top-k, sizes and which layers have experts."""
    num_experts: int
    topk: int
    ffn_hidden: int  # one expert's intermediate size
    shared_ffn_hidden: int  # the shared expert's (0: none)
    layers: tuple[bool, ...]  # per layer: experts (True) or a dense MLP
    normalize_topk: bool  # the top-k weights renormalised to sum 1 (else softmax over all experts, then top-k)

    @staticmethod
    def from_hf(hf_config: Any) -> "MoeDims | None":
        if getattr(hf_config, "model_type", None) == "mixtral":  # every layer, top-k renormalised
            return MoeDims(hf_config.num_local_experts, hf_config.num_experts_per_tok, hf_config.intermediate_size,
                           0, (True,) * hf_config.num_hidden_layers, True)
        experts = getattr(hf_config, "num_experts", None) or 0
        if not experts:
            return None
        step = getattr(hf_config, "decoder_sparse_step", 1) or 1
        dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
        layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(hf_config.num_hidden_layers))
        return MoeDims(experts, hf_config.num_experts_per_tok, hf_config.moe_intermediate_size,
                       getattr(hf_config, "shared_expert_intermediate_size", None) or 0, layers,
                       bool(getattr(hf_config, "norm_topk_prob", False)))


# Megatron name template -> (kind, HF name templates). `{i}` is the global layer number. Norm weights
# have two Megatron names: local spec (separate norm modules) and TransformerEngine spec (fused into
# the following linear as `layer_norm_weight`).
_DECODER_TABLE: dict[str, tuple[str, tuple[str, ...]]] = {
    "embedding.word_embeddings.weight": (VOCAB, ("model.embed_tokens.weight",)),
    "decoder.layers.{i}.input_layernorm.weight": (PLAIN, ("model.layers.{i}.input_layernorm.weight",)),
    "decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight":
        (PLAIN, ("model.layers.{i}.input_layernorm.weight",)),
    "decoder.layers.{i}.self_attention.linear_qkv.weight":
        (QKV, tuple(f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkv")),
    "decoder.layers.{i}.self_attention.linear_proj.weight": (PLAIN, ("model.layers.{i}.self_attn.o_proj.weight",)),
    "decoder.layers.{i}.pre_mlp_layernorm.weight": (PLAIN, ("model.layers.{i}.post_attention_layernorm.weight",)),
    "decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight":
        (PLAIN, ("model.layers.{i}.post_attention_layernorm.weight",)),
    "decoder.layers.{i}.mlp.linear_fc1.weight":
        (GATE_UP, ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight")),
    "decoder.layers.{i}.mlp.linear_fc2.weight": (PLAIN, ("model.layers.{i}.mlp.down_proj.weight",)),
    "decoder.final_layernorm.weight": (PLAIN, ("model.norm.weight",)),
}
_QKV_BIAS = {"decoder.layers.{i}.self_attention.linear_qkv.bias":
             (QKV, tuple(f"model.layers.{{i}}.self_attn.{p}_proj.bias" for p in "qkv"))}
_LM_HEAD = {"output_layer.weight": (VOCAB, ("lm_head.weight",))}
# Tied embeddings: the last stage's output layer (PP > 1) holds a copy of the input embedding.
_TIED_LM_HEAD = {"output_layer.weight": (VOCAB, ("model.embed_tokens.weight",))}
_SCORE_HEAD = {"output_layer.weight": (PLAIN, ("score.weight",))}  # scalar head: Linear(h, 1), replicated
_QK_NORM = {f"decoder.layers.{{i}}.self_attention.{q}_layernorm.weight":
            (PLAIN, (f"model.layers.{{i}}.self_attn.{q}_norm.weight",)) for q in "qk"}


@dataclass(frozen=True)
class MoeNames:
    """HF names of an MoE layer's MLP, after `model.layers.{i}.`; `{e}`: the expert."""
    router: str
    gate: str
    up: str
    down: str
    shared: bool = False  # a shared expert beside the routed ones, scaled by sigmoid(shared_expert_gate(x))

    def table(self) -> dict[str, tuple[str, tuple[str, ...]]]:
        layer, experts = "model.layers.{i}.", "decoder.layers.{i}.mlp.experts.local_experts.{e}."
        table = {"decoder.layers.{i}.mlp.router.weight": (PLAIN, (layer + self.router,)),
                 experts + "linear_fc1.weight": (GATE_UP, (layer + self.gate, layer + self.up)),
                 experts + "linear_fc2.weight": (PLAIN, (layer + self.down,))}
        if self.shared:
            shared = "decoder.layers.{i}.mlp.shared_experts."
            table.update({
                shared + "linear_fc1.weight": (GATE_UP, (layer + "mlp.shared_expert.gate_proj.weight",
                                                         layer + "mlp.shared_expert.up_proj.weight")),
                shared + "linear_fc2.weight": (PLAIN, (layer + "mlp.shared_expert.down_proj.weight",)),
                shared + "gate_weight": (PLAIN, (layer + "mlp.shared_expert_gate.weight",))})
        return table


QWEN_MOE = MoeNames("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                    "mlp.experts.{e}.down_proj.weight")
MIXTRAL_MOE = MoeNames("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                       "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight")


def _template_regex(template: str) -> re.Pattern:
    pattern = re.escape(template)
    for key in ("i", "e"):  # the layer and the expert number
        pattern = pattern.replace(re.escape("{" + key + "}"), rf"(?P<{key}>\d+)")
    return re.compile("^" + pattern + "$")


@dataclass(frozen=True)
class ModelFamily:
    name: str
    causal_lm_architectures: tuple[str, ...]
    seq_cls_architectures: tuple[str, ...]
    qkv_bias: bool
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3)
    moe: MoeNames | None = None  # the HF names of its MoE layers

    # ---- the name table ------------------------------------------------------------------------
    def table(self, head: str = "lm", tied: bool = False) -> dict[str, tuple[str, tuple[str, ...]]]:
        table = dict(_DECODER_TABLE)
        if self.qkv_bias:
            table.update(_QKV_BIAS)
        if self.qk_norm:
            table.update(_QK_NORM)
        if self.moe is not None:
            table.update(self.moe.table())
        if head == "scalar":
            table.update(_SCORE_HEAD)
        else:
            table.update(_TIED_LM_HEAD if tied else _LM_HEAD)
        return table

    def rule(self, mcore_name: str, head: str = "lm", tied: bool = False) -> ConversionRule:
        """How one Megatron parameter (global layer numbering) maps to HF tensors."""
        for template, (kind, hf_templates) in self.table(head, tied).items():
            match = _template_regex(template).match(mcore_name)
            if match:
                numbers = {k: v for k, v in match.groupdict().items() if v is not None}
                names = []
                for name in hf_templates:
                    for key, value in numbers.items():
                        name = name.replace("{" + key + "}", value)
                    names.append(name)
                return ConversionRule(kind, tuple(names))
        raise UnsupportedModelError(f"{self.name}: no HF counterpart for Megatron parameter {mcore_name!r}")

    def expected_hf_tensors(self, hf_config: Any, head: str = "lm") -> dict[str, tuple[int, ...]]:
        """Every HF tensor a Megatron model of this config needs, with its shape."""
        d = ModelDims.from_hf(hf_config)
        q_rows, kv_rows = d.num_heads * d.head_dim, d.num_query_groups * d.head_dim
        shapes = {"model.embed_tokens.weight": (d.vocab_size, d.hidden), "model.norm.weight": (d.hidden,)}
        for i in range(d.num_layers):
            p = f"model.layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": (d.hidden,), p + "post_attention_layernorm.weight": (d.hidden,),
                p + "self_attn.q_proj.weight": (q_rows, d.hidden), p + "self_attn.k_proj.weight": (kv_rows, d.hidden),
                p + "self_attn.v_proj.weight": (kv_rows, d.hidden), p + "self_attn.o_proj.weight": (d.hidden, q_rows)})
            if d.moe is not None and d.moe.layers[i]:
                shapes.update(self._expert_shapes(p, d))
            else:
                shapes.update({p + "mlp.gate_proj.weight": (d.ffn_hidden, d.hidden),
                               p + "mlp.up_proj.weight": (d.ffn_hidden, d.hidden),
                               p + "mlp.down_proj.weight": (d.hidden, d.ffn_hidden)})
            if self.qk_norm:
                shapes.update({p + f"self_attn.{q}_norm.weight": (d.head_dim,) for q in "qk"})
            if self.qkv_bias:
                shapes.update({p + "self_attn.q_proj.bias": (q_rows,), p + "self_attn.k_proj.bias": (kv_rows,),
                               p + "self_attn.v_proj.bias": (kv_rows,)})
        if head == "scalar":
            shapes["score.weight"] = (1, d.hidden)
        elif not getattr(hf_config, "tie_word_embeddings", False):
            shapes["lm_head.weight"] = (d.vocab_size, d.hidden)
        return shapes

    def _expert_shapes(self, prefix: str, d: ModelDims) -> dict[str, tuple[int, ...]]:
        moe, names = d.moe, self.moe
        shapes = {prefix + names.router: (moe.num_experts, d.hidden)}
        for e in range(moe.num_experts):
            for template, shape in ((names.gate, (moe.ffn_hidden, d.hidden)), (names.up, (moe.ffn_hidden, d.hidden)),
                                    (names.down, (d.hidden, moe.ffn_hidden))):
                shapes[prefix + template.replace("{e}", str(e))] = shape
        if names.shared:
            shared = moe.shared_ffn_hidden
            shapes.update({prefix + "mlp.shared_expert.gate_proj.weight": (shared, d.hidden),
                           prefix + "mlp.shared_expert.up_proj.weight": (shared, d.hidden),
                           prefix + "mlp.shared_expert.down_proj.weight": (d.hidden, shared),
                           prefix + "mlp.shared_expert_gate.weight": (1, d.hidden)})
        return shapes

    # ---- full-tensor conversion (used by the hybrid engine and the vLLM weight sync) -------------
    def to_hf(self, mcore_name: str, tensor: torch.Tensor, hf_config: Any,
              head: str = "lm") -> list[tuple[str, torch.Tensor]]:
        """A FULL Megatron tensor -> its HF-named tensors (vocab padding stripped).

        With tied embeddings a pipeline-last-stage `output_layer.weight` maps to `model.embed_tokens.weight`.
        """
        rule = self.rule(mcore_name, head, is_tied(hf_config, head))
        d = ModelDims.from_hf(hf_config)
        if rule.kind == PLAIN:
            return [(rule.hf_names[0], tensor)]
        if rule.kind == VOCAB:
            return [(rule.hf_names[0], tensor[: d.vocab_size])]
        if rule.kind == QKV:
            return list(zip(rule.hf_names, split_qkv(tensor, d.num_query_groups, d.heads_per_group, d.head_dim)))
        if rule.kind == GATE_UP:
            return list(zip(rule.hf_names, torch.chunk(tensor, 2, dim=0)))
        raise AssertionError(rule.kind)

    def from_hf(self, mcore_name: str, get_hf: Callable[[str], torch.Tensor], hf_config: Any,
                head: str = "lm", padded_vocab_size: int | None = None) -> torch.Tensor:
        """The FULL Megatron tensor for `mcore_name`, reading HF tensors through `get_hf(name)`."""
        rule = self.rule(mcore_name, head, is_tied(hf_config, head))
        d = ModelDims.from_hf(hf_config)
        parts = [get_hf(name) for name in rule.hf_names]
        if rule.kind == PLAIN:
            return parts[0]
        if rule.kind == VOCAB:
            return pad_rows(parts[0], padded_vocab_size or d.vocab_size)
        if rule.kind == QKV:
            return fuse_qkv(*parts, num_query_groups=d.num_query_groups, head_dim=d.head_dim)
        if rule.kind == GATE_UP:
            return torch.cat(parts, dim=0)
        raise AssertionError(rule.kind)

    def accepts(self, architecture: str) -> bool:
        return architecture in self.causal_lm_architectures + self.seq_cls_architectures


LLAMA = ModelFamily("llama", ("LlamaForCausalLM",), ("LlamaForSequenceClassification",), qkv_bias=False)
QWEN2 = ModelFamily("qwen2", ("Qwen2ForCausalLM",), ("Qwen2ForSequenceClassification",), qkv_bias=True)
QWEN3 = ModelFamily("qwen3", ("Qwen3ForCausalLM",), ("Qwen3ForSequenceClassification",), qkv_bias=False,
                    qk_norm=True)
QWEN2_MOE = ModelFamily("qwen2_moe", ("Qwen2MoeForCausalLM",), (), qkv_bias=True,
                        moe=dataclasses.replace(QWEN_MOE, shared=True))
QWEN3_MOE = ModelFamily("qwen3_moe", ("Qwen3MoeForCausalLM",), (), qkv_bias=False, qk_norm=True, moe=QWEN_MOE)
MIXTRAL = ModelFamily("mixtral", ("MixtralForCausalLM",), (), qkv_bias=False, moe=MIXTRAL_MOE)
FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (LLAMA, QWEN2, QWEN3, QWEN2_MOE, QWEN3_MOE, MIXTRAL)}


def is_tied(hf_config: Any, head: str = "lm") -> bool:
    return head == "lm" and bool(getattr(hf_config, "tie_word_embeddings", False))


def supported_architectures() -> list[str]:
    return [a for f in FAMILIES.values() for a in f.causal_lm_architectures + f.seq_cls_architectures]


def family_for(hf_config: Any) -> ModelFamily:
    """The family of a HF config, from its `architectures` (else its `model_type`), or a clear error."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for arch in architectures:
        for family in FAMILIES.values():
            if family.accepts(arch):
                return family
    if not architectures and getattr(hf_config, "model_type", None) in FAMILIES:
        return FAMILIES[hf_config.model_type]
    raise UnsupportedModelError(
        f"unsupported architecture {architectures or getattr(hf_config, 'model_type', None)!r}; "
        f"hybridrl supports: {', '.join(supported_architectures())}")


def head_of(hf_config: Any) -> str:
    """'scalar' for *ForSequenceClassification checkpoints, else 'lm'."""
    architectures = getattr(hf_config, "architectures", None) or []
    return "scalar" if any(a.endswith("ForSequenceClassification") for a in architectures) else "lm"


# ---- layout helpers (pure tensor functions; work on full tensors and on TP-local slices) ----------
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_query_groups: int,
             head_dim: int) -> torch.Tensor:
    """HF q/k/v (weights [rows, h] or biases [rows]) -> Megatron QKV interleaved per query group."""
    tail = q.shape[1:]
    q = q.reshape(num_query_groups, -1, *tail)
    k = k.reshape(num_query_groups, head_dim, *tail)
    v = v.reshape(num_query_groups, head_dim, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, num_query_groups: int, heads_per_group: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tail = qkv.shape[1:]
    grouped = qkv.reshape(num_query_groups, (heads_per_group + 2) * head_dim, *tail)
    q, k, v = torch.split(grouped, [heads_per_group * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(-1, *tail).contiguous(), k.reshape(-1, *tail).contiguous(),
            v.reshape(-1, *tail).contiguous())


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor
    pad = tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat([tensor, pad], dim=0)


_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)\.")


def expert_number(mcore_name: str) -> int | None:
    """The expert a Megatron parameter belongs to (None: not an expert's)."""
    match = _EXPERT.search(mcore_name)
    return None if match is None else int(match.group(2))


def renumber_expert(mcore_name: str, expert: int) -> str:
    """The same parameter of another expert."""
    return _EXPERT.sub(lambda m: f"{m.group(1)}{expert}.", mcore_name)


def is_gated_fc1(mcore_name: str) -> bool:
    """A SwiGLU fc1 ([gate; up]): a dense MLP's, an expert's or the shared expert's."""
    return mcore_name.endswith("linear_fc1.weight") or mcore_name.endswith("linear_fc1.bias")


def tp_shard(mcore_name: str, full: torch.Tensor, partition_dim: int | None, tp_rank: int,
             tp_size: int) -> torch.Tensor:
    """The TP rank's shard of a FULL Megatron tensor (SwiGLU fc1: its gate rows then its up rows)."""
    if partition_dim is None or tp_size == 1:
        return full
    if is_gated_fc1(mcore_name):
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp_size, 0)[tp_rank], torch.chunk(up, tp_size, 0)[tp_rank]], 0)
    return torch.chunk(full, tp_size, dim=partition_dim)[tp_rank].contiguous()


def tp_gather(mcore_name: str, shards: list[torch.Tensor], partition_dim: int | None) -> torch.Tensor:
    """The FULL Megatron tensor from all TP shards (inverse of `tp_shard`)."""
    if partition_dim is None or len(shards) == 1:
        return shards[0]
    if is_gated_fc1(mcore_name):
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=partition_dim)


def tp_partition_dim(param: torch.Tensor) -> int | None:
    """The dim along which Megatron splits this parameter over TP, or None if it is replicated."""
    return param.partition_dim if getattr(param, "tensor_model_parallel", False) else None

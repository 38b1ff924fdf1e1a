"""A lean forward of a dense Megatron GPTModel for the native engine's prefill and decode steps.

Megatron-Core's module stack costs ~10 ms of Python per decode step on a 25M model (inference context,
rotary tables rebuilt per layer, transposes for its [seq, batch] layout, masked softmax): on CPU that is the
gap to transformers' generate. This forward reads the same parameters (the live generation-layout weights the
hybrid engine writes in place) and computes the same function with fewer, larger ops:
  - the embedding, the layer norms (also Qwen3's q/k norms), the final norm and the output layer are the
    model's own modules (exact by construction, vocab-parallel included);
  - the fused QKV and gated fc1 are one matmul each, split per query group / into [gate; up] as Megatron
    lays them out; the row-parallel projections sum over the generation TP group (all-reduce), then add
    their bias, as RowParallelLinear does;
  - RoPE at column positions with Megatron's frequencies (its inv_freq, interpolation factor), the keys and
    values in a preallocated cache [batch, groups, max_len, head_dim] written in place, attention by
    scaled_dot_product_attention over the cache with the engine's mask (grouped-query: enable_gqa) in the
    prefill, and in a decode step as one matmul per query group (its heads are the rows);
  - a mixture-of-experts layer's MLP is the model's own MoE module (router, dispatcher, experts, shared
    expert; its routing hooks fire as in Megatron's path).
`unsupported(gpt)` names what it does not cover (other attention or norm types, interleaved rotary, ...); the
engine then keeps Megatron's path. tests/test_rollout_native.py checks both paths give the same tokens and
log-probs.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


# oneDNN's prepacked linear (what torch.compile's CPU freezing uses); absent from builds without mkldnn
_ONEDNN_PACKING = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") \
    and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def unsupported(gpt: Any) -> str | None:
    """Why this forward cannot run `gpt` (None: it can)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    config = gpt.config
    if getattr(config, "multi_latent_attention", False):
        return "multi-latent attention"
    if config.normalization != "RMSNorm":
        return f"normalization {config.normalization}"
    if gpt.position_embedding_type not in ("rope", "learned_absolute"):
        return f"position embedding {gpt.position_embedding_type}"
    if gpt.position_embedding_type == "rope" and (type(gpt.rotary_pos_emb) is not RotaryEmbedding
                                                   or gpt.rotary_pos_emb.rotary_interleaved):
        return "this rotary embedding variant"
    if config.apply_residual_connection_post_layernorm or config.softmax_scale is not None:
        return "post-norm residuals or a custom softmax scale"
    if config.gated_linear_unit and config.activation_func is not F.silu:
        return "a gated unit other than SwiGLU"
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.identity_op import IdentityOp

    for layer in gpt.decoder.layers:
        attn, mlp = layer.self_attention, layer.mlp
        linears = [getattr(attn, "linear_qkv", None), getattr(attn, "linear_proj", None)]
        if not hasattr(mlp, "router"):
            linears += [getattr(mlp, "linear_fc1", None), getattr(mlp, "linear_fc2", None)]
        # TransformerEngine layers fuse the norms into the linears (the layer's norm is an IdentityOp)
        if not all(isinstance(x, (ColumnParallelLinear, RowParallelLinear)) for x in linears) \
                or isinstance(layer.input_layernorm, IdentityOp) or isinstance(layer.pre_mlp_layernorm, IdentityOp):
            return "layers other than Megatron's local spec (e.g. TransformerEngine's fused norm + linear)"
    return None


class FastForward:
    """Prefill / decode forward of one generation-layout GPTModel with its own KV cache."""

    def __init__(self, gpt: Any, tp_group: Any, max_len: int) -> None:
        config = gpt.config
        self.gpt, self.tp_group, self.max_len = gpt, tp_group, max_len
        self.tp = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
        self.heads = config.num_attention_heads // self.tp
        self.groups = (config.num_query_groups or config.num_attention_heads) // self.tp
        self.head_dim = config.kv_channels
        self.gated = config.gated_linear_unit
        self.activation = config.activation_func
        self.layers = list(gpt.decoder.layers)
        self.rope = gpt.rotary_pos_emb if gpt.position_embedding_type == "rope" else None
        self.cache: list[tuple[torch.Tensor, ...]] = []
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        self._packed: dict[int, torch.Tensor] = {}  # id(linear) -> its weight in oneDNN's layout (CPU bf16)

    # ---- cache and rotary tables ---------------------------------------------------------------------------
    def reset(self, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        """Before a chunk of `batch` rows: the KV cache, the rotary tables and (CPU bf16) the packed weights."""
        self._pack_weights(batch, dtype, device)
        shape = (batch, self.groups, self.max_len, self.head_dim)
        if not self.cache or self.cache[0][0].shape != shape or self.cache[0][0].dtype != dtype:
            self.cache = [tuple(torch.empty(shape, dtype=dtype, device=device) for _ in range(2))
                          for _ in self.layers]
        if self.rope is not None and (self._cos_sin is None or self._cos_sin[0].dtype != dtype):
            inv_freq = self.rope.inv_freq.to(device)
            seq = torch.arange(self.max_len, device=device, dtype=inv_freq.dtype)
            if self.rope.seq_len_interpolation_factor is not None:
                seq *= 1 / self.rope.seq_len_interpolation_factor
            freqs = torch.outer(seq, inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, rot_dim], Megatron's non-interleaved layout
            # in the activations' dtype once, as Megatron casts them per call (bf16: no casts per layer and step)
            self._cos_sin = (torch.cos(emb).to(dtype), torch.sin(emb).to(dtype))

    def share_prefix(self, index: torch.Tensor, length: int) -> None:
        """Rows 0..U-1 of the cache hold the first `length` positions of U distinct prompts: row i of the batch
        takes prompt index[i]'s (the n samples of a prompt share its prefill)."""
        for k_cache, v_cache in self.cache:
            k_cache[:len(index), :, :length] = k_cache[index, :, :length]
            v_cache[:len(index), :, :length] = v_cache[index, :, :length]

    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep the cache rows `index` (ascending), moved to the front: rows that stopped leave the decode batch."""
        count = len(index)
        for k_cache, v_cache in self.cache:
            k_cache[:count] = k_cache[index]
            v_cache[:count] = v_cache[index]

    def release(self) -> None:
        self.cache, self._cos_sin, self._packed = [], None, {}

    def _pack_weights(self, rows: int, dtype: torch.dtype, device: torch.device) -> None:
        """CPU bf16: each dense layer linear's weight reordered once per chunk into oneDNN's blocked layout for
        `rows` rows, which F.linear otherwise redoes on every call (CPU, 25M decode shapes: 1.25-1.5x faster
        matmuls). A second copy of those weights lives while the chunk generates; the weights are read here,
        after the hybrid engine and a LoRA merge wrote them."""
        self._packed = {}
        if device.type != "cpu" or dtype != torch.bfloat16 or not _ONEDNN_PACKING:
            return
        for layer in self.layers:
            linears = [layer.self_attention.linear_qkv, layer.self_attention.linear_proj]
            if not hasattr(layer.mlp, "router"):
                linears += [layer.mlp.linear_fc1, layer.mlp.linear_fc2]
            for linear in linears:
                self._packed[id(linear)] = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on x [B, n, S, d] with cos/sin [S, rot_dim] in x's dtype (the first rot_dim channels rotate)."""
        rot = cos.shape[-1]
        head, rest = x[..., :rot], x[..., rot:]
        x1, x2 = head.chunk(2, dim=-1)
        out = head * cos + torch.cat((-x2, x1), dim=-1) * sin
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp > 1:
            torch.distributed.all_reduce(x, group=self.tp_group)
        return x

    @staticmethod
    def _add_bias(x: torch.Tensor, linear: Any) -> torch.Tensor:
        bias = getattr(linear, "bias", None)
        return x if bias is None else x + bias

    def _linear(self, x: torch.Tensor, linear: Any) -> torch.Tensor:
        """x W^T (the packed weight where there is one), plus an active LoRA adapter's delta (models/lora.py; a
        row-parallel one's partial sum, completed by the caller's reduce like the weight's)."""
        packed = self._packed.get(id(linear))
        out = F.linear(x, linear.weight) if packed is None else \
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        adapter = getattr(linear, "lora", None)
        return out if adapter is None or not adapter.active else out + adapter.decode_delta(x)

    def _mlp(self, mlp: Any, x: torch.Tensor) -> torch.Tensor:
        if hasattr(mlp, "router"):  # Megatron's MoE layer on its [seq, batch, hidden] layout
            out, bias = mlp(x.transpose(0, 1).contiguous())
            out = out.transpose(0, 1)
            return out if bias is None else out + bias
        fc1 = self._add_bias(self._linear(x, mlp.linear_fc1), mlp.linear_fc1)
        if self.gated:
            gate, up = fc1.chunk(2, dim=-1)
            fc1 = self.activation(gate) * up
        else:
            fc1 = self.activation(fc1)
        return self._add_bias(self._reduce(self._linear(fc1, mlp.linear_fc2)), mlp.linear_fc2)

    def _decode_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          blocked: torch.Tensor) -> torch.Tensor:
        """One query per row: q [B, heads, 1, d] against the cache k / v [B, groups, L, d], blocked [B, 1, 1, L]
        True where a key is hidden. A group's query heads are consecutive (Megatron's layout, SDPA's enable_gqa), so
        they attend as the rows of one matmul against their group's keys: no copies of the keys per head, and no
        flash-attention tiling, which costs more than it saves for a single query (CPU: 1.1-1.4x faster). In bf16 /
        fp16 the small batched matmuls copy their operands and SDPA's kernel is the faster one (CPU, 25M shapes: 2.4x
        at 40 keys, 6x at 500)."""
        if q.dtype != torch.float32:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=~blocked, enable_gqa=self.heads > self.groups)
        batch = q.shape[0]
        grouped = q.reshape(batch, self.groups, self.heads // self.groups, self.head_dim)
        scores = torch.matmul(grouped, k.transpose(-1, -2)).mul_(self.head_dim ** -0.5)
        scores.masked_fill_(blocked, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), v).view(batch, self.heads, 1, self.head_dim)

    # ---- forward ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, attend: torch.Tensor,
                 offset: int) -> torch.Tensor:
        """Logits [B, V_padded / tp gathered to V_padded] of the last position. tokens / positions [B, S] at
        columns offset..offset+S-1; attend [B, 1, S, offset+S] True where a query may see a key."""
        gpt = self.gpt
        batch, length = tokens.shape
        end = offset + length
        # a padding query sees no key at all: let it see itself, so its (unused) output and cached key/value stay
        # finite (Megatron's masked softmax gives such rows uniform weights instead)
        columns = torch.arange(length, device=tokens.device)
        attend = attend.clone()
        attend[:, :, columns, offset + columns] = True
        hidden = gpt.embedding(input_ids=tokens, position_ids=positions).transpose(0, 1)  # [B, S, H]
        if self.rope is not None:
            cos, sin = (t[offset:end] for t in self._cos_sin)
        per_group = self.heads // self.groups
        blocked = ~attend.view(batch, 1, 1, end) if length == 1 else None  # decode: keys the query may not see
        for layer, (k_cache, v_cache) in zip(self.layers, self.cache):
            attn = layer.self_attention
            qkv = self._add_bias(self._linear(layer.input_layernorm(hidden), attn.linear_qkv), attn.linear_qkv)
            qkv = qkv.view(batch, length, self.groups, per_group + 2, self.head_dim)
            q = qkv[:, :, :, :per_group].reshape(batch, length, self.heads, self.head_dim).transpose(1, 2)
            k, v = qkv[:, :, :, per_group].transpose(1, 2), qkv[:, :, :, per_group + 1].transpose(1, 2)
            q, k = attn.q_layernorm(q), attn.k_layernorm(k)
            if self.rope is not None:
                q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            k_cache[:batch, :, offset:end] = k
            v_cache[:batch, :, offset:end] = v
            if blocked is not None:
                context = self._decode_attention(q, k_cache[:batch, :, :end], v_cache[:batch, :, :end], blocked)
            else:
                context = F.scaled_dot_product_attention(q, k_cache[:batch, :, :end], v_cache[:batch, :, :end],
                                                         attn_mask=attend, enable_gqa=per_group > 1)
            context = context.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim)
            out = self._reduce(self._linear(context, attn.linear_proj))
            hidden = hidden + self._add_bias(out, attn.linear_proj)
            hidden = hidden + self._mlp(layer.mlp, layer.pre_mlp_layernorm(hidden))
        last = gpt.decoder.final_layernorm(hidden[:, -1:]).transpose(0, 1)  # [1, B, H]
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
        logits, _ = gpt.output_layer(last, weight=weight, runtime_gather_output=True)
        return logits[0]

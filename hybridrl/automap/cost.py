"""The step cost model of the device-mapping search: time and memory of every stage of an RL step.

Analytical, stated so each number can be checked by hand (HybridFlow Appendix C uses the same kind of
simulators: training and inference compute-bound, generation memory-bound). Symbols, per role model:
  N   compute parameters: transformer layers + the output layer (the input embedding is a lookup, no FLOPs);
      critic / reward / cost models replace the LM head (V x h) with a scalar head (h)
  P   parameters as stored (model_shapes: every tensor once); L layers, h hidden, V vocabulary
  kv  key/value width per layer = num_key_value_heads * head_dim;  pb = parameter/activation bytes (bf16: 2)
  Layout (t, p, d): tensor, pipeline, data parallel (Megatron order, tp fastest); the actor also has its
  generation layout (t_g, p_g) on the same devices (R = t*p*d / (t_g*p_g) generation replicas).
  Workload: B prompts x n samples = S sequences of T = Lp + Lr tokens (prompt + response), K mini-batches per
  epoch, E epochs; micro-batches of mb sequences (m = mb*T tokens).

Device speed.  A GEMM over m rows runs at peak * mfu * m / (m + half_rows) ("batch effects": small batches
  and decode are far from peak). CPU "devices" are processes sharing the machine's cores: each gets
  cores/devices of the calibrated one-core FLOP/s and bandwidth, and per-op overheads slow down by
  devices/cores once devices outnumber cores.
Links.  Collectives are hierarchical: the members of a group on one node reduce over the intra-node link
  (NVLink, per device), then the nodes exchange their 1/q shares over the node's inter-node link (InfiniBand,
  per node), which all devices of the pool on that node use at once. A ring over g members moves (g-1)/g of
  the buffer per pass (reduce-scatter, all-gather: 1 pass; all-reduce: 2) plus one latency. No overlap of
  communication with compute (conservative: Megatron can overlap the data-parallel gradient reduce).
Forward (log-prob / value / reward passes): 2 N + 2 L h T FLOPs per token (2 x params x tokens, plus causal
  attention), per micro-batch on each pipeline stage 1/p of it over t devices; 2 TP all-reduces of m h pb
  bytes per layer; a p2p send of m h pb bytes between stages; layer_overhead per layer; 1F1B fill/drain:
  (micro-batches + p - 1) stage times.
Training (actor / critic update): 3x the forward FLOPs (6 N per token; 4x = 8 N with full activation
  recompute, chosen only when activations would not fit), 4 TP all-reduces per layer, pipeline bubble as
  above for each of the E*K optimizer steps, then the distributed optimizer's gradient reduce-scatter (fp32,
  4 B/param) and parameter all-gather (pb) over the d data-parallel ranks, and the Adam step (memory-bound).
Generation (actor, vLLM-style continuous batching, fixed-length responses as in the paper): each replica
  takes ceil(S'/R) sequences (S' = S, plus B greedy ones for ReMax) in waves of b = min(that, KV-cache
  capacity, max_decode_batch) sequences. Prefill: compute-bound, 2 N + 2 L h Lp FLOPs per prompt token.
  Decode: Lr steps, each max(bytes / (memory_bw * bw_efficiency), FLOPs / compute) with bytes = the
  device's weights (pb N / t_g; pipeline stages re-read theirs once per in-flight micro-batch) + the KV cache
  of b sequences at the average context Lp + Lr/2 (2 (L/p_g) ceil(kv_heads/t_g) head_dim pb per token),
  plus 2 L latency-bound TP all-reduces and L layer overheads per step.
Transition (actor training -> generation layout): the 3D-HybridEngine's exact per-rank bytes
  (hybrid_engine/plan.py) projected by hybrid_engine/cost_model.py on this machine's links; 0 when
  (t_g, p_g) = (t, p); the switch back only frees buffers.
Memory per device, decides what fits (capacity minus memory_reserve_bytes):
  weights of the largest pipeline stage / t (stage 0 holds the embedding, stage p-1 the output layer);
  trained roles add fp32 gradients (4 B/param) and, with the distributed optimizer sharded over d, fp32
  master weights + Adam moments (12 B/param; 8 B with fp32 training) / d;
  training activations (Korthikanti et al. 2022, flash attention, no sequence parallel): m h (10 + 24/t)
  bytes (at 2-byte activations) per layer per in-flight micro-batch, min(p, micro-batches) in flight on
  stage 0 for its L/p layers, plus fp32 logits m V / t; with recompute only each layer's input (m h pb);
  generation: the gathered generation shard minus the device's own training shard (it is a slot of the
  buffer), then the KV cache fills what is left (best effort, as in the paper).
Colocated roles keep their weights / gradients / optimizer states resident together; their transient
memory (activations, generation buffer + KV cache) is needed one stage at a time.
LoRA (a trained role's adapters = a share s of its parameters): the frozen base keeps its weights only, the
adapters add s x (weights + fp32 gradients + optimizer shard); the backward computes the activations' gradients
but no weight gradients for the base (2x the forward FLOPs instead of 3x), and the gradient reduce-scatter,
parameter all-gather and Adam step move s of the bytes. A LoRA actor is its own reference (an actor forward
with the adapters off, no reference model).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from hybridrl.automap.hardware import Accelerator
from hybridrl.hybrid_engine.model_shapes import ModelShapes

LM_ROLES = ("actor", "ref")  # roles whose model ends in the LM head; the others end in a scalar head


@dataclass(frozen=True)
class ModelStats:
    """The sizes the cost model needs, read from a model's real parameter shapes."""
    name: str
    params: int       # P: every tensor once
    layer_params: int  # the transformer layers
    embedding: int    # input embedding (first pipeline stage)
    output: int       # output layer + final norm (last pipeline stage; a tied embedding is copied there)
    layers: int
    hidden: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_shapes(cls, shapes: ModelShapes) -> "ModelStats":
        embed = next(s for s in shapes.params if s.name.endswith("embed_tokens.weight"))
        k_proj = next(s for s in shapes.params if s.name.endswith("k_proj.weight"))
        vocab, hidden = embed.shape
        output = sum(s.numel for s in shapes.params if s.section == "final")
        if not any(s.name.endswith("lm_head.weight") for s in shapes.params):
            output += embed.numel
        return cls(name=shapes.name, params=shapes.numel,
                   layer_params=sum(s.numel for s in shapes.params if s.section == "layer"),
                   embedding=embed.numel, output=output, layers=shapes.num_layers, hidden=hidden, vocab=vocab,
                   heads=shapes.num_attention_heads, kv_heads=shapes.num_query_groups,
                   head_dim=k_proj.shape[0] // shapes.num_query_groups)

    def compute_params(self, lm_head: bool) -> int:
        """N: parameters that do FLOPs per token (layers + output layer; scalar head for scoring models)."""
        return self.layer_params + (self.vocab * self.hidden if lm_head else self.hidden)

    def shard_params(self, t: int, p: int, lm_head: bool = True) -> int:
        """Parameters on one device at (t, p): the largest pipeline stage / t."""
        out = self.output if lm_head else self.output - self.vocab * self.hidden + self.hidden
        ends = self.embedding + out if p == 1 else max(self.embedding, out)
        return math.ceil((self.layer_params / p + ends) / t)

    def kv_bytes_per_token(self, tg: int, pg: int, pb: int) -> float:
        """KV-cache bytes per token on one generation device."""
        return 2 * (self.layers / pg) * math.ceil(self.kv_heads / tg) * self.head_dim * pb


@dataclass(frozen=True)
class Workload:
    prompts: int            # B: prompts per step
    prompt_len: int         # Lp
    response_len: int       # Lr
    samples: int = 1        # n per prompt
    greedy: bool = False    # ReMax: one greedy response per prompt, generated and scored too
    mini_batches: int = 1   # K optimizer steps per epoch
    epochs: int = 1         # E
    old_log_probs: bool = True  # a separate actor forward (off-policy updates or a KL penalty in the reward)
    max_decode_batch: int = 256  # sequences decoded together per replica (vLLM max_num_seqs default)

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples

    @property
    def tokens(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def generated(self) -> int:
        return self.sequences + (self.prompts if self.greedy else 0)

    @property
    def scored(self) -> int:
        return self.generated  # the reward model also scores the greedy responses


@dataclass(frozen=True)
class Net:
    """The links one pool's collectives use: `per_node` of the pool's devices share a node."""
    acc: Accelerator
    per_node: int
    pool_devices: int

    @property
    def cpu_share(self) -> float:
        """Fraction of one calibrated core a device gets (CPU); 1 on GPUs."""
        if self.acc.shared_cores is None:
            return 1.0
        return self.acc.shared_cores / self.pool_devices

    @property
    def slowdown(self) -> float:
        """Per-op overheads stretch when CPU devices outnumber cores."""
        return max(1.0, 1.0 / self.cpu_share) if self.acc.shared_cores else 1.0

    @property
    def flops(self) -> float:
        return self.acc.peak_flops * self.cpu_share

    @property
    def memory_bw(self) -> float:
        return self.acc.memory_bw * min(1.0, self.cpu_share) if self.acc.shared_cores else self.acc.memory_bw

    def link(self, span: int) -> tuple[float, float]:
        """(bandwidth, latency) between ranks `span` apart or closer: NVLink inside a node, else the
        device's share of its node's inter-node link."""
        if span <= self.per_node:
            return self.acc.intra_node_bw, self.acc.collective_latency
        return self.acc.inter_node_bw / self.per_node, self.acc.inter_node_latency

    def collective(self, nbytes: float, group: int, stride: int, passes: int = 1) -> float:
        """A reduce-scatter or all-gather (passes=1; an all-reduce is passes=2) of an nbytes buffer over
        `group` members `stride` ranks apart, done hierarchically: q members per node first over NVLink,
        then across the k nodes, where every device of the node does the same at once and shares the link."""
        if group <= 1:
            return 0.0
        q = min(group, max(1, self.per_node // stride))
        k = math.ceil(group / q)
        seconds = (q - 1) / q * nbytes / self.acc.intra_node_bw
        if k > 1:
            seconds += self.per_node * (k - 1) / k * (nbytes / q) / self.acc.inter_node_bw
        return passes * seconds + (self.acc.inter_node_latency if k > 1 else self.acc.collective_latency)

    def p2p(self, nbytes: float, stride: int) -> float:
        bw, lat = self.link(stride + 1)
        return nbytes / bw + lat


def gemm_efficiency(acc: Accelerator, rows: float) -> float:
    return acc.mfu * rows / (rows + acc.half_rows)


# ---- time ----------------------------------------------------------------------------------------------
def _stage_time(model: ModelStats, lm_head: bool, t: int, p: int, d: int, mb: int, tokens: int, net: Net,
                passes: float, comm_passes: int) -> float:
    """One micro-batch through one pipeline stage: `passes` x forward FLOPs, `comm_passes` x 2 TP all-reduces
    per layer, overheads and the p2p to the next stage."""
    acc = net.acc
    m = mb * tokens
    flops = m * (2 * model.compute_params(lm_head) + 2 * model.layers * model.hidden * tokens) * passes
    compute = flops / (p * t * net.flops * gemm_efficiency(acc, m))
    act = m * model.hidden * acc.param_bytes
    tp = (model.layers / p) * 2 * comm_passes * net.collective(act, t, 1, passes=2)
    overhead = (model.layers / p) * passes * acc.layer_overhead * net.slowdown
    p2p = comm_passes * net.p2p(act, t * d) if p > 1 else 0.0
    return compute + tp + overhead + p2p


def forward_time(model: ModelStats, lm_head: bool, t: int, p: int, d: int, mb: int, sequences: int,
                 tokens: int, net: Net) -> float:
    """A log-prob / value / score pass over `sequences` sequences of `tokens` tokens."""
    micro = math.ceil(math.ceil(sequences / d) / mb)
    return (micro + p - 1) * _stage_time(model, lm_head, t, p, d, mb, tokens, net, 1.0, 1)


def update_time(model: ModelStats, lm_head: bool, t: int, p: int, d: int, mb: int, work: Workload, net: Net,
                recompute: bool, adapters: float = 0.0) -> float:
    """E x K optimizer steps over the S sequences (one mini-batch each), distributed optimizer. adapters: LoRA's
    share of the parameters (0: full fine-tuning)."""
    acc = net.acc
    micro = math.ceil(math.ceil(work.sequences / (work.mini_batches * d)) / mb)
    passes = (2.0 + adapters if adapters else 3.0) + (1.0 if recompute else 0.0)
    stage = _stage_time(model, lm_head, t, p, d, mb, work.tokens, net, passes, 2)
    shard = model.shard_params(t, p, lm_head) * (adapters or 1.0)
    sync = net.collective(4 * shard, d, t) + net.collective(acc.param_bytes * shard, d, t)
    opt_bytes = 12 if acc.mixed_precision else 8
    adam = 2 * (acc.param_bytes + 4 + opt_bytes) * shard / d / net.memory_bw
    return work.epochs * work.mini_batches * ((micro + p - 1) * stage + sync + adam)


def generation_time(model: ModelStats, tg: int, pg: int, replicas: int, batch_cap: int, work: Workload,
                    net: Net) -> float:
    """All responses of one step on R replicas of (t_g, p_g), waves of at most batch_cap sequences."""
    acc = net.acc
    per_replica = math.ceil(work.generated / replicas)
    b = max(1, min(per_replica, batch_cap, work.max_decode_batch))
    waves = [b] * (per_replica // b) + ([per_replica % b] if per_replica % b else [])
    n_compute = model.compute_params(True)
    lp, lr, layers, h = work.prompt_len, work.response_len, model.layers, model.hidden
    context = lp + lr / 2
    kv_token = model.kv_bytes_per_token(tg, pg, acc.param_bytes)
    weights = acc.param_bytes * n_compute / tg
    total = 0.0
    for w in waves:
        rows = w * lp
        prefill = rows * (2 * n_compute + 2 * layers * h * lp) / (tg * pg * net.flops * gemm_efficiency(acc, rows))
        prefill += layers * 2 * net.collective(rows * h * acc.param_bytes, tg, 1, passes=2)
        prefill += layers * acc.layer_overhead * net.slowdown + (pg - 1) * net.p2p(rows * h * acc.param_bytes, tg)
        memory = (weights + w * context * kv_token) / (net.memory_bw * acc.bw_efficiency)
        compute = w * (2 * n_compute + 4 * layers * h * context) / (tg * pg * net.flops * gemm_efficiency(acc, w))
        step = max(memory, compute) + layers * 2 * net.collective(w * h * acc.param_bytes, tg, 1, passes=2)
        step += layers * acc.layer_overhead * net.slowdown + (pg - 1) * net.p2p(w * h * acc.param_bytes, tg)
        total += prefill + lr * step
    return total


# ---- memory --------------------------------------------------------------------------------------------
def static_bytes(model: ModelStats, lm_head: bool, trained: bool, t: int, p: int, d: int, acc: Accelerator,
                 adapters: float = 0.0) -> float:
    """Resident bytes on one device: weights (+ fp32 grads + distributed-optimizer shard when trained; LoRA, a
    share `adapters` of the parameters: the adapters' weights, grads and optimizer shard only)."""
    shard = model.shard_params(t, p, lm_head)
    if not trained:
        return acc.param_bytes * shard
    opt_bytes = 12 if acc.mixed_precision else 8
    if adapters:
        return acc.param_bytes * shard + (acc.param_bytes + 4 + opt_bytes / d) * adapters * shard
    return (acc.param_bytes + 4 + opt_bytes / d) * shard


def activation_bytes(model: ModelStats, lm_head: bool, t: int, p: int, mb: int, tokens: int, in_flight: int,
                     recompute: bool, acc: Accelerator) -> float:
    """Training activations on pipeline stage 0 (in_flight = 1, no storage: a forward-only pass)."""
    m = mb * tokens
    layer = m * model.hidden * (10 + 24 / t) * acc.param_bytes / 2
    stored = m * model.hidden * acc.param_bytes if recompute else layer
    logits = m * model.vocab / t * 4 if lm_head else 0.0
    return stored * (model.layers / p) * in_flight + (layer if recompute else 0.0) + logits


def forward_bytes(model: ModelStats, lm_head: bool, t: int, mb: int, tokens: int, acc: Accelerator) -> float:
    """A forward-only pass keeps about two layers' activations and the fp32 logits."""
    m = mb * tokens
    return 2 * m * model.hidden * (10 + 24 / t) * acc.param_bytes / 2 + (m * model.vocab / t * 4 if lm_head else 0.0)


def generation_buffer_bytes(model: ModelStats, t: int, p: int, tg: int, pg: int, acc: Accelerator) -> float:
    """Extra bytes of the gathered generation shard beyond the device's own training shard (in place)."""
    return max(0.0, acc.param_bytes * (model.shard_params(tg, pg) - model.shard_params(t, p)))

"""Build a Megatron-Core GPTModel (LM head or scalar head) from a Hugging Face config."""
from __future__ import annotations

import logging
from typing import Any

import torch

from hybridrl.models.config import GPTArgs, gpt_args_from_hf, transformer_config_from_hf
from hybridrl.models.families import ModelDims, expert_number, family_for, renumber_expert
from hybridrl.parallel.distributed import use_cuda
from hybridrl.versions import transformer_engine_usable

logger = logging.getLogger(__name__)

HEADS = ("lm", "scalar")


class ScalarHead(torch.nn.Module):
    """Linear(hidden, 1) replicated on every TP rank; stands in for GPTModel.output_layer.

    GPTModel calls `output_layer(hidden, weight=..., runtime_gather_output=...)` and expects
    `(output, bias)`; the result is per-token scalars of shape [s, b, 1] (GPTModel returns [b, s, 1]).
    """

    def __init__(self, config: Any, tp_group: Any):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        self.sequence_parallel = config.sequence_parallel
        self.weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype,
                                                     device="cpu" if config.use_cpu_initialization else None))
        config.init_method(self.weight)
        # Replicated over TP: Megatron's checkpointing and grad code read these attributes.
        self.weight.tensor_model_parallel = False

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        if self.sequence_parallel:  # the decoder output is split along the sequence over TP ranks
            hidden_states = gather_from_sequence_parallel_region(hidden_states, group=self.tp_group)
        return torch.nn.functional.linear(hidden_states, self.weight.to(hidden_states.dtype)), None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {},
                                                   sharded_offsets)


def uses_transformer_engine() -> bool:
    """True where models get TransformerEngine's layer spec: on GPU when transformer_engine imports (a release in
    hybridrl/versions.py's range; another one is refused with the fix)."""
    return use_cuda() and transformer_engine_usable()


def shares_rows() -> bool:
    """Whether several sequences may share one row under a block-diagonal attention mask. Megatron's local
    attention honours an explicit mask; TransformerEngine's causal kernels ignore it (packing there needs
    THD packed-sequence parameters), so with TE every sequence keeps a row of its own."""
    return not uses_transformer_engine()


def layer_spec(config: Any, pp_rank: int = 0, local: bool = False):
    """TransformerEngine spec on GPU when transformer_engine imports; Megatron's local spec otherwise (or when
    `local`: LoRA adapters need the norm's output, which TE's fused norm + linear keeps inside). With experts,
    the spec of this pipeline stage's layers (MoE or dense, from config.moe_layer_freq)."""
    from megatron.core.models.gpt import gpt_layer_specs

    te = uses_transformer_engine() and not local
    if config.num_moe_experts:
        return gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=te,
                                                          normalization=config.normalization, pp_rank=pp_rank)
    if te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization=config.normalization,
                                                    qk_layernorm=config.qk_layernorm)


def _tp_pp_sizes(pg_collection: Any) -> tuple[int, int, Any]:
    from megatron.core import parallel_state

    if pg_collection is not None:
        return pg_collection.tp.size(), pg_collection.pp.size(), pg_collection.tp
    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_group())


def _expert_sizes(pg_collection: Any) -> tuple[int, int | None]:
    """(ep, expert_tp) the MoE layers run at (a dense model's are ignored)."""
    from megatron.core import parallel_state

    if pg_collection is not None:
        return pg_collection.ep.size(), pg_collection.expt_tp.size()
    return (parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_world_size())


def build_gpt_model(hf_config: Any, *, head: str = "lm", pre_process: bool | None = None,
                    post_process: bool | None = None, pg_collection: Any = None,
                    dtype: torch.dtype = torch.float32, sequence_parallel: bool = False,
                    padded_vocab_size: int | None = None, local_spec: bool = False, **config_overrides: Any):
    """A Megatron GPTModel for this rank's TP/PP shard of a Llama/Qwen2 HF config.

    head="lm": logits over the (padded) vocab; head="scalar": per-token scalars [b, s, 1] from a
    replicated Linear(hidden, 1) (critic / reward model). Parallel sizes come from `pg_collection`
    or, without one, from Megatron's global parallel state. The returned model carries
    `hybridrl_args` (GPTArgs), `hybridrl_head` and `hybridrl_family` for conversion code. local_spec: Megatron's
    local layers even where TransformerEngine is installed (LoRA).
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    # megatron.core: these modules import it at their top; this module loads Megatron only where a model is built
    from hybridrl.models.attention import use_grouped_attention
    from hybridrl.models.swiglu import use_swiglu_mlp

    if head not in HEADS:
        raise ValueError(f"head={head!r}; choose one of {HEADS}")
    family = family_for(hf_config)
    tp, pp, tp_group = _tp_pp_sizes(pg_collection)
    pp_rank = pg_collection.pp.rank() if pg_collection is not None else \
        parallel_state.get_pipeline_model_parallel_rank()
    pre_process = pp_rank == 0 if pre_process is None else pre_process
    post_process = pp_rank == pp - 1 if post_process is None else post_process
    args: GPTArgs = gpt_args_from_hf(hf_config, tp, padded_vocab_size)
    ep, expert_tp = _expert_sizes(pg_collection) if ModelDims.from_hf(hf_config).moe is not None else (1, None)
    config = transformer_config_from_hf(hf_config, tp=tp, pp=pp, sequence_parallel=sequence_parallel,
                                        dtype=dtype, on_gpu=use_cuda(), ep=ep, expert_tp=expert_tp,
                                        transformer_engine=uses_transformer_engine() and not local_spec,
                                        **config_overrides)
    tie = args.tie_embeddings and head == "lm"
    extra = {"pg_collection": pg_collection} if pg_collection is not None else {}
    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec(config, pp_rank, local_spec), vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_sequence_length, pre_process=pre_process, post_process=post_process,
        parallel_output=True, share_embeddings_and_output_weights=tie, position_embedding_type="rope",
        rotary_base=args.rope.theta, rope_scaling=args.rope.llama3_factor is not None,
        rope_scaling_factor=args.rope.llama3_factor or 8.0,
        seq_len_interpolation_factor=args.rope.linear_factor, **extra)
    if head == "scalar" and post_process:
        model.output_layer = ScalarHead(config, tp_group)
    use_swiglu_mlp(model)
    use_grouped_attention(model)
    if dtype != torch.float32 and not use_cuda():
        model = model.to(dtype)
    model.hybridrl_args = args
    model.hybridrl_head = head
    model.hybridrl_family = family
    model.hybridrl_local_spec = local_spec  # a model resharded from this one is built with the same layers (names)
    model.hybridrl_expert_offset = _expert_offset(config, pg_collection)
    logger.debug("built %s GPTModel (%s head) tp=%d pp=%d stage=%d", family.name, head, tp, pp, pp_rank)
    return model


def layer_offset(model: Any) -> int:
    """Global index of this pipeline stage's first transformer layer."""
    decoder = getattr(model, "decoder", None)
    if decoder is None or len(decoder.layers) == 0:
        return 0
    return decoder.layers[0].layer_number - 1


def _expert_offset(config: Any, pg_collection: Any) -> int:
    """Global number of this rank's first local expert (experts are split evenly over the EP group)."""
    if not config.num_moe_experts:
        return 0
    from megatron.core import parallel_state

    ep_group = getattr(pg_collection, "ep", None) if pg_collection is not None else None
    ep_rank, ep_size = ((ep_group.rank(), ep_group.size()) if ep_group is not None else
                        (parallel_state.get_expert_model_parallel_rank(),
                         parallel_state.get_expert_model_parallel_world_size()))
    return ep_rank * (config.num_moe_experts // ep_size)


def global_param_name(model: Any, local_name: str) -> str:
    """A parameter name of this stage's model with the global layer and expert numbers (see families.py)."""
    prefix = "decoder.layers."
    if local_name.startswith(prefix):
        index, rest = local_name[len(prefix):].split(".", 1)
        local_name = f"{prefix}{int(index) + layer_offset(model)}.{rest}"
        offset = getattr(model, "hybridrl_expert_offset", 0)
        expert = expert_number(local_name) if offset else None
        if expert is not None:
            local_name = renumber_expert(local_name, expert + offset)
    return local_name


def named_global_parameters(model: Any):
    """(global Megatron name, parameter) for this rank's shard; unwraps DDP/Float16Module wrappers. LoRA adapters
    (models/lora.py) are not the model's weights: they are left out (models/lora_io.py moves them)."""
    inner = unwrap(model)
    for name, param in inner.named_parameters():
        if ".lora." not in f".{name}":
            yield global_param_name(inner, name), param


def unwrap(model: Any) -> Any:
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model

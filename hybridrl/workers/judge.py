"""A generative judge as Ray-side workers: a frozen Megatron causal LM, and a rollout engine without training.

JudgeWorker holds, on every rank of its pool, what its parser needs:
- choice_logprob: the judge as a frozen MegatronModel at the role's layout (tp, pp, dp); one forward gives the
  next-token log-probs of the answer tokens after each judge prompt (`choice_log_probs`);
- text verdicts: a rollout engine (the actor's generation path, workers/actor.py): native, on the generation-
  layout model the 3D-HybridEngine makes from the frozen model (t_g = the generation TP, p_g = 1; nothing moves
  when t_g = tp and pp = 1), or vLLM, which loads the judge folder itself (no Megatron copy is built then). The
  KV cache exists only while a batch of verdicts is generated (`generate_verdicts`), so a judge colocated with
  the actor is switched in and out like the reference.
"""
from __future__ import annotations

import torch

from hybridrl.config import RolloutConfig, ScoreModelConfig
from hybridrl.controller import Dispatch, Worker, register
from hybridrl.hybrid_engine.engine import HybridEngine
from hybridrl.models import load_hf_config
from hybridrl.parallel.generation import GenerationGroups, GenerationLayout
from hybridrl.protocol import Batch
from hybridrl.rollout import SamplingParams, TokenIds, build_rollout_engine
from hybridrl.workers.megatron_model import MegatronModel
from hybridrl.workers.sequences import gather_at
from hybridrl.workers.vocab_parallel import token_log_probs


class JudgeWorker(Worker):
    def __init__(self, scorer: ScoreModelConfig, rollout: RolloutConfig | None, tokens: TokenIds,
                 forward: bool, seed: int = 1) -> None:
        """scorer: the judge's section (model a local folder); rollout: how it generates verdicts (engine and tp
        resolved by the driver; None: it never generates); forward: it answers choice_log_probs."""
        self.rollout = rollout
        generates_natively = rollout is not None and rollout.engine == "native"
        self.model = None
        if forward or generates_natively:
            self.model = MegatronModel(scorer.model, head="lm", dtype=scorer.dtype,
                                       micro_batch_size=scorer.micro_batch_size,
                                       max_tokens_per_micro_batch=scorer.max_tokens_per_micro_batch,
                                       sequence_parallel=self.layout.sequence_parallel, seed=seed)
        self.engine = self.hybrid = None
        if rollout is None:
            return
        gen_layout = GenerationLayout(tp=rollout.tp)
        self.groups = GenerationGroups(self.layout, gen_layout)
        if generates_natively:
            self.hybrid = HybridEngine(self.model.model, self.model.hf_config, self.layout, gen_layout,
                                       bucket_mb=rollout.bucket_mb)
            self.engine = build_rollout_engine(rollout, model=self.hybrid.gen_model, vocab_size=self.model.vocab_size,
                                               tokens=tokens, dtype=scorer.dtype)
        else:  # vLLM reads the judge's weights from its folder; its TP groups are the generation groups
            self.engine = build_rollout_engine(rollout, model_path=scorer.model,
                                               vocab_size=int(load_hf_config(scorer.model).vocab_size), tokens=tokens,
                                               dtype=scorer.dtype, tp_groups=self.groups.gen_tp_groups())
        self.engine.release()  # KV cache only while judging

    @register(Dispatch.DP_COMPUTE)
    def choice_log_probs(self, data: Batch, choice_ids: list[int]) -> Batch | None:
        """"choice_log_probs" [B, k]: log p(answer token) at the position after each judge prompt (the rows'
        "prompts"; their one-token "responses" are placeholders whose prediction is read)."""
        model = self.model
        labels = torch.tensor(choice_ids, dtype=torch.long)

        def per_micro_batch(mb, logits):
            picked = gather_at(logits, mb, mb["prompt_lengths"].unsqueeze(1) - 1)  # [n, 1, V/tp]: after the prompt
            tp_group = model.tp_group if model.tp > 1 else None
            rows = picked.shape[0]
            return torch.cat([token_log_probs(picked, labels[i].expand(rows, 1).to(picked.device),
                                              vocab_size=model.vocab_size, tp_group=tp_group)[0]
                              for i in range(len(choice_ids))], dim=1)

        values = model.forward(data, per_micro_batch)
        return None if values is None else Batch({"choice_log_probs": values})

    @register(Dispatch.ONE_TO_ALL)
    def generate_verdicts(self, prompts: Batch, params: SamplingParams) -> tuple[int, Batch] | None:
        """Verdicts for this rank's generation replica's share of the judge prompts (left-padded "input_ids" +
        "attention_mask"); (replica index, Batch) on its generation TP rank 0, None elsewhere."""
        if self.engine is None:
            raise RuntimeError("this judge reads no text (parser choice_logprob): it has no rollout engine")
        replica = self.groups.gen_dp_rank(self.rank)
        share = prompts.chunk(self.groups.gen_dp_size)[replica]
        if not len(share):
            return None
        if self.hybrid is not None:
            self.hybrid.to_generation()
            self.engine.wake_weights()  # the engine's state machine (rollout/base.py): no push into a sleeping engine
            self.engine.load_weights(None)  # the generation model holds the judge's weights: drop stale cache
        self.engine.wake()
        try:
            with torch.no_grad():
                out = self.engine.generate(share, params)
        finally:
            self.engine.release()
            if self.hybrid is not None:
                self.hybrid.to_training()
        shard = self.groups.gen_shard(self.rank)
        return (replica, out) if shard.gen_tp == 0 else None

    @register(Dispatch.ONE_TO_ALL)
    def engine_state(self) -> dict:
        """Where this rank's verdict generation stands: the rollout engine's state (None: it never generates) and
        whether its hybrid engine holds the generation layout (between calls: asleep, False)."""
        return {"engine": None if self.engine is None else self.engine.state.value,
                "in_generation": self.hybrid is not None and self.hybrid.in_generation}

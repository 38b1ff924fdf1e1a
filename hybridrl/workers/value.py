"""Scalar-head roles as Ray-side workers: the critic (trained value model) and reward / cost models (frozen).

Both are Megatron GPT models whose output layer is a replicated Linear(hidden, 1) (models/builder.py,
ScalarHead), built from a Hugging Face folder: a *ForSequenceClassification checkpoint supplies `score`; a
causal-LM checkpoint gets a freshly initialised head (the usual way to start a critic).
- critic values: V(prefix before response token i), read at the position that predicts token i;
- reward model score: the scalar at each sequence's last real token.
"""
from __future__ import annotations

import torch

from hybridrl.algorithms.losses import masked_mean, value_loss
from hybridrl.config import RoleConfig, ScoreModelConfig
from hybridrl.controller import Dispatch, Worker, register
from hybridrl.protocol import Batch
from hybridrl.workers.megatron_model import CheckpointedRole, MegatronModel
from hybridrl.workers.policy import response_index, response_mask
from hybridrl.workers.sequences import gather_at


def _response_values(mb: dict, output: torch.Tensor) -> torch.Tensor:
    """[n, R] scalars at the positions that predict each response token (output [rows, W, 1])."""
    return gather_at(output.squeeze(-1).float(), mb, response_index(mb))


class CriticWorker(CheckpointedRole, Worker):
    """Value model V(s) trained with the clipped value loss (PPO, Safe-RLHF's reward and cost critics)."""

    def __init__(self, role: RoleConfig, seed: int = 1) -> None:
        self.model = MegatronModel.for_role(role, self.layout, head="scalar", seed=seed)

    @register(Dispatch.DP_COMPUTE)
    def compute_values(self, data: Batch) -> Batch | None:
        values = self.model.forward(data, _response_values, {"response_mask": data["response_mask"]})
        return None if values is None else Batch({"values": values * data["response_mask"]})

    @register(Dispatch.DP_COMPUTE, pad=False)
    def update(self, data: Batch, clip_range: float | None = 0.2, mini_batches: int = 1,
               epochs: int = 1) -> dict[str, float]:
        """Regress V on data["returns"] ([B, R]) with the value loss clipped around data["values"]."""
        for key in ("returns", "values", "response_mask"):
            if key not in data:
                raise KeyError(f"critic.update needs {key!r} in the batch")

        def loss_terms(mb, output):
            mask = response_mask(mb)
            values = _response_values(mb, output)
            loss, stats = value_loss(values, mb["values"], mb["returns"], mask, clip_range=clip_range)
            count = mask.sum()
            return loss * count, count, {"critic/value_loss": loss.detach(), "critic/vf_clipfrac": stats["vf_clipfrac"],
                                         "critic/values_mean": masked_mean(values.detach(), mask)}

        return self.model.train_epochs(data, loss_terms, ["response_mask", "returns", "values"], mini_batches,
                                       epochs, role="critic.update")


class RewardModelWorker(Worker):
    """A frozen scalar model scoring whole sequences (reward model, or Safe-RLHF's cost model)."""

    def __init__(self, scorer: ScoreModelConfig, seed: int = 1) -> None:
        """scorer: the reward_model: / cost_model: section, its model a local folder."""
        self.model = MegatronModel(scorer.model, head="scalar", dtype=scorer.dtype,
                                   micro_batch_size=scorer.micro_batch_size,
                                   max_tokens_per_micro_batch=scorer.max_tokens_per_micro_batch,
                                   sequence_parallel=self.layout.sequence_parallel, seed=seed, fsdp=self.layout.fsdp)

    @register(Dispatch.DP_COMPUTE)
    def score(self, data: Batch) -> Batch | None:
        """"scores" [B]: the model's scalar at each sequence's last real token."""

        def last_token_score(mb, output):
            last = (mb["lengths"] - 1).clamp(min=0).unsqueeze(1)
            return gather_at(output.squeeze(-1).float(), mb, last).squeeze(1)

        scores = self.model.forward(data, last_token_score)
        return None if scores is None else Batch({"scores": scores})

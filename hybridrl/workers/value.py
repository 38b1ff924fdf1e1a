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
from hybridrl.controller import Dispatch, Worker, register
from hybridrl.protocol import Batch
from hybridrl.workers.megatron_model import MegatronModel, model_spec
from hybridrl.workers.policy import response_index, response_mask


def _response_values(mb: dict, output: torch.Tensor) -> torch.Tensor:
    """[b, R] scalars at the positions that predict each response token (output [b, L, 1])."""
    return torch.gather(output.squeeze(-1).float(), 1, response_index(mb, output.shape[1]))


class CriticWorker(Worker):
    """Value model V(s) trained with the clipped value loss (PPO, Safe-RLHF's reward and cost critics)."""

    def __init__(self, model: dict, seed: int = 1) -> None:
        self.model = MegatronModel(model_spec(model, self.layout, head="scalar"), seed=seed)

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
        if len(data) < mini_batches:
            raise ValueError(f"critic.update: {len(data)} rows on this DP rank cannot make {mini_batches} mini-batches")

        def loss_terms(mb, output):
            mask = response_mask(mb)
            values = _response_values(mb, output)
            loss, stats = value_loss(values, mb["values"], mb["returns"], mask, clip_range=clip_range)
            count = mask.sum()
            return loss * count, count, {"critic/value_loss": loss.detach(), "critic/vf_clipfrac": stats["vf_clipfrac"],
                                         "critic/values_mean": masked_mean(values.detach(), mask)}

        history = []
        for _ in range(epochs):
            for part in data.chunk(mini_batches):
                extra = {k: part[k] for k in ("response_mask", "returns", "values")}
                history.append(self.model.train_step(part, loss_terms, extra))
        return {k: sum(h[k] for h in history) / len(history) for k in history[0]}


    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, out_dir: str) -> None:
        """Value-model weights, optimizer, scheduler and RNG states under out_dir (collective)."""
        self.model.save_checkpoint(out_dir)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, ckpt_dir: str, load_optimizer: bool = True) -> None:
        self.model.load_checkpoint(ckpt_dir, load_optimizer)


class RewardModelWorker(Worker):
    """A frozen scalar model scoring whole sequences (reward model, or Safe-RLHF's cost model)."""

    def __init__(self, model: dict, seed: int = 1) -> None:
        self.model = MegatronModel(model_spec(model, self.layout, head="scalar", optim=None), seed=seed)

    @register(Dispatch.DP_COMPUTE)
    def score(self, data: Batch) -> Batch | None:
        """"scores" [B]: the model's scalar at each sequence's last real token."""

        def last_token_score(mb, output):
            last = (mb["lengths"] - 1).clamp(min=0).unsqueeze(1)
            return torch.gather(output.squeeze(-1).float(), 1, last).squeeze(1)

        scores = self.model.forward(data, last_token_score)
        return None if scores is None else Batch({"scores": scores})

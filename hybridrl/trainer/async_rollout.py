"""Generation on a rollout pool of its own, `ahead` batches in flight ahead of training (trainer.mode).

    sync          ahead 0: generate a batch, train on it, send the weights, generate the next
    one_step_off  ahead 1: the next batch generates (with the weights before this update) while this one trains
    async         ahead algorithm.max_staleness: that many batches generate while one trains

Requests run on the replicas in submission order and weight syncs queue between them, so a request generates
with the policy version of the last sync sent before it: its staleness when trained on is the syncs sent since
(at most `ahead` by construction; a request over `max_staleness`, e.g. after a restart, is dropped and drawn
again with the current weights, and counted). With rollout.partial a sync is taken by the generation in
progress: its sequences resume with the new weights, and staleness is counted per token (mean over the
response tokens; max: the oldest token). The importance correction of samples from older weights is the
rollout-correction machinery's (algorithm.rollout_correction=tis against the rollout log-probs).

Checkpoints: the data loader's position is the one before the oldest batch not yet trained on, so a resumed run
regenerates the in-flight batches (with the resumed weights) instead of skipping them.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from hybridrl.controller import WorkerDiedError

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    step: int  # the training step the batch is for
    prompts: Any
    seed: int
    pending: Any  # api.PendingRollouts
    loader_state: dict  # the loader's position before this batch was drawn


class RolloutQueue:
    def __init__(self, replicas: Any, loader: Any, ahead: int, max_staleness: int,
                 settings_for: Callable[[int], list[dict]], seed_for: Callable[[int], int]) -> None:
        self.replicas, self.loader = replicas, loader
        self.ahead, self.max_staleness = ahead, max(max_staleness, ahead)
        self.settings_for, self.seed_for = settings_for, seed_for
        self.inflight: deque[_Request] = deque()
        self.broken: BaseException | None = None  # a failed sync, raised at the next batch
        self.dropped = 0

    def _submit(self, step: int) -> None:
        state = self.loader.state_dict()
        prompts = self.loader.next_batch()
        seed = self.seed_for(step)
        self.inflight.append(_Request(step, prompts, seed, self.replicas.submit(prompts, self.settings_for(seed)),
                                      state))

    def next(self, step: int) -> tuple[Any, int, list[Any], dict[str, float]]:
        """The batch for training step `step`: (prompts, seed, [Rollout per setting], async/* metrics); then
        `ahead` further batches are left generating."""
        if self.broken is not None:
            broken, self.broken = self.broken, None
            raise broken
        if not self.inflight:
            self._submit(step)
        request = self.inflight.popleft()
        start = time.perf_counter()
        outs = request.pending.result()
        wait_s = time.perf_counter() - start
        staleness = self._staleness(outs[0].sequences, request.pending.version)
        dropped = 0
        while staleness["async/staleness_max"] > self.max_staleness:  # e.g. after a restart: draw it again
            dropped += 1
            logger.info("a batch %d policy versions old (algorithm.max_staleness=%d) dropped and regenerated",
                        staleness["async/staleness_max"], self.max_staleness)
            request.pending = self.replicas.submit(request.prompts, self.settings_for(request.seed))
            outs = request.pending.result()
            staleness = self._staleness(outs[0].sequences, request.pending.version)
        self.dropped += dropped
        while len(self.inflight) < self.ahead:
            self._submit(step + 1 + len(self.inflight))
        metrics = {**staleness, "async/queue_size": float(len(self.inflight)), "async/wait_s": wait_s,
                   "async/generation_idle_s": float(outs[0].sequences.meta.get("generation_idle_s", 0.0)),
                   "async/dropped": float(dropped)}
        return request.prompts, request.seed, outs, metrics

    def _staleness(self, sequences: Any, started: int) -> dict[str, float]:
        """Policy versions between the weights being trained and those that generated the batch: per token
        for partial rollouts (mean over the response tokens, max = the oldest), else the version it started with;
        async/partial_resumed: the share of sequences that switched weights half-way."""
        now = self.replicas.version
        versions = sequences.tensors.get("policy_versions", None)
        mask = sequences["response_mask"].bool()
        if versions is None or not mask.any():
            return {"async/staleness_mean": float(now - started), "async/staleness_max": float(now - started)}
        newest = versions.masked_fill(~mask, -1).max(-1).values
        oldest = versions.masked_fill(~mask, now + 1).min(-1).values
        return {"async/staleness_mean": float(now - versions[mask].float().mean()),
                "async/staleness_max": float(now - versions[mask].min()),
                "async/partial_resumed": float(((newest > oldest) & mask.any(-1)).float().mean())}

    def after_update(self) -> dict[str, float]:
        """Send the updated weights (the replicas take them before the next queued generation)."""
        start = time.perf_counter()
        try:
            self.replicas.sync(in_flight=self.ahead)
        except WorkerDiedError as exc:  # the step itself is done: raise with the next batch
            self.broken = exc
        return {"time/weight_sync": time.perf_counter() - start}

    def loader_state(self) -> dict:
        """Where the loader stood before the oldest batch not trained on yet."""
        return self.inflight[0].loader_state if self.inflight else self.loader.state_dict()

    def discard(self) -> None:
        """Forget the batches in flight (a restart or a resume: the loader is rewound by the caller)."""
        self.inflight.clear()
        self.broken = None

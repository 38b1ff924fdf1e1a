"""A rollout pool of its own (disaggregated generation): generation replicas apart from the actor's training ranks.

Every rank of the pool holds a generation-layout Megatron model (t_g = the pool layout's tp, p_g = 1) and a
rollout engine on it (native: generates with that model; vLLM: its own copy of the weights, pushed from that
model after each sync, so the weights are held twice on this pool); the pool's dp replicas split the prompts.
New weights come shard to shard from the actor's training ranks over the bridge (hybrid_engine/bridge.py); until
the first sync the model holds the HF folder's. Mixture-of-experts: with generation expert parallelism (the
pool's layout ep = rollout.ep) each replica holds 1/ep of the experts and decodes in lockstep with its peers.

New weights are taken before the next generation call. With `partial` (rollout.partial) they are also taken
during one: between decode steps the replica reads the bridge's count of syncs sent; when it grew, the rows
still running stop, the new weights are received, and the rows resume from where they stopped (prompt +
tokens so far, prefilled again with the new weights). Each token records the policy version that generated it
("policy_versions"), each log-prob is the one of the weights that sampled it.
"""
from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from typing import Any

import torch

from hybridrl.config import LoraConfig, RolloutConfig
from hybridrl.controller import Dispatch, Worker, register
from hybridrl.hybrid_engine.bridge import PendingReceive, open_bridge
from hybridrl.hybrid_engine.lora_sync import AdapterSpec, FactorSource, PendingAdapterReceive
from hybridrl.hybrid_engine.megatron_adapter import load_generation_weights
from hybridrl.models import build_gpt_model, load_hf_weights
from hybridrl.models.checkpoint_hf import iter_full_hf_tensors
from hybridrl.models.lora import adapters_of, merged_adapters
from hybridrl.models.lora_io import add_adapters, load_adapter_factors
from hybridrl.models.peft import model_config, model_files, model_weights
from hybridrl.protocol import Batch
from hybridrl.rollout import SamplingParams, TokenIds, build_rollout_engine
from hybridrl.rollout.base import GeneratedSequence, assemble_batch, normalise_prompts, validate_prompts
from hybridrl.rollout.vllm_lora import VllmAdapters, vllm_adapter_support, vllm_lora_rank
from hybridrl.workers.actor import replica_params
from hybridrl.workers.megatron_model import DTYPES


class RolloutWorker(Worker):
    def __init__(self, model_path: str, dtype: str, rollout: RolloutConfig, tokens: TokenIds,
                 padded_vocab_size: int | None = None, lora: LoraConfig | None = None) -> None:
        """model_path: the actor's initial weights (a local HF folder); dtype: the actor's; rollout: engine and
        max_model_len resolved by the driver, rollout.partial for partial rollouts; padded_vocab_size: the
        actor's padded vocabulary (it depends on the training TP), so its shards fit this model; lora: a LoRA
        actor's adapter settings (resolved): the base stays as loaded, syncs bring the adapters only, which the
        native engine applies in its forward (vLLM gets W + BA pushed)."""
        self.path, self.rollout = model_path, rollout
        self.hf_config = model_config(model_path)  # a PEFT adapter folder: merged into its base (models/peft.py)
        self.dtype = DTYPES[dtype]
        self.model = build_gpt_model(self.hf_config, dtype=self.dtype, padded_vocab_size=padded_vocab_size,
                                     local_spec=lora is not None).eval()
        load_hf_weights(self.model, model_weights(model_path), self.hf_config)
        if lora is not None:  # the actor's initial adapters (B = 0, or lora.init's), until the first sync
            add_adapters(self.model, lora, seed=0)
        self._adapter_spec: AdapterSpec | None = None
        # vLLM runs SPMD over each replica's TP ranks (this pool's process group)
        tp_groups = self.layout.tp_groups() if rollout.engine == "vllm" else None
        adapters_in_vllm = rollout.engine == "vllm" and lora is not None and \
            vllm_adapter_support(lora, model_path, self.hf_config) is None
        self.engine = build_rollout_engine(rollout, model=self.model, model_path=model_files(model_path),
                                           vocab_size=int(self.hf_config.vocab_size), tokens=tokens, dtype=dtype,
                                           tp_groups=tp_groups, lora_rank=vllm_lora_rank(lora.rank) if adapters_in_vllm
                                           else None)
        self._vllm_adapters = VllmAdapters(self.engine, lora) if adapters_in_vllm else None
        if self._vllm_adapters is not None and lora.init not in ("kaiming", "gaussian"):
            self._vllm_adapters.load_folder(lora.init)  # the actor's starting adapters, until the first sync
        self.partial = rollout.partial
        self.version = 0  # policy versions applied
        self._posted = 0  # policy versions whose receives are posted
        self._incoming = None  # posted receives of the newest version, not applied yet
        self._sent = 0  # syncs sent, as the replica's TP ranks last agreed (partial rollouts)
        self.last_sync: dict = {}
        self._idle_since = time.perf_counter()  # generation idle: between the end of a call and the next

    @register(Dispatch.ONE_TO_ALL)
    def bridge_open(self, host: str, port: int, size: int, offset: int, timeout_s: float, plan: list, metas: dict,
                    train_layout: Any, adapter_spec: AdapterSpec | None = None) -> None:
        self._bridge = open_bridge(host, port, offset + self.rank, size, timeout_s,
                                   next(self.model.parameters()).device)
        self._plan, self._metas, self._train_layout = plan, metas, train_layout  # the same messages every sync
        self._adapter_spec = adapter_spec  # LoRA: syncs carry the adapters only (hybrid_engine/lora_sync.py)

    @register(Dispatch.ONE_TO_ALL)
    def bridge_receive(self, version: int) -> None:
        """Post the receives of the weights up to `version` (nothing when a partial rollout took them already);
        they are applied before the next generation: a generation in progress without `partial` is never
        switched to new weights half-way."""
        self._post_receives(version)

    def _post_receives(self, version: int) -> None:
        while self._posted < version:
            if self._incoming is not None:  # one version's buffers at a time: the older one goes in first
                self._apply()
            self._incoming = PendingAdapterReceive(self._adapter_spec, self._bridge) if self._adapter_spec else \
                PendingReceive(self._plan, self.rank, self._metas, self._train_layout, self._bridge, self.dtype)
            self._posted += 1

    @register(Dispatch.ONE_TO_ALL)
    def alive(self) -> bool:
        return True

    @register(Dispatch.ONE_TO_ALL)
    def bridge_stats(self) -> dict:
        """The last applied sync: bytes received and this rank's generation shard bytes, seconds, version."""
        if self._incoming is not None:
            self._apply()
        return dict(self.last_sync)

    def _apply(self) -> None:
        start = time.perf_counter()
        tensors, received = self._incoming.assemble()
        self._incoming = None
        if self._adapter_spec is not None:  # new adapters on the frozen base, this rank's TP pieces of them
            load_adapter_factors(self.model, FactorSource(tensors, adapters_of(self.model)[0].rank))
        else:
            load_generation_weights(self.model, tensors)
        if self.rollout.engine == "native":
            self.engine.load_weights(None)  # the native engine reads the model's parameters: drop the KV cache
        elif self._vllm_adapters is not None:  # LoRA served by vLLM: the new adapters become its LoRA request
            self._vllm_adapters.load(tensors)
        else:  # vLLM holds its own copy under HF names: full tensors, gathered over this replica's TP ranks
            with merged_adapters(self.model):  # LoRA: W + BA
                self.engine.load_weights(iter_full_hf_tensors(self.model, self.hf_config))
        self.version = self._posted
        self.last_sync = {"received_bytes": received, "seconds": time.perf_counter() - start, "version": self.version,
                          "shard_bytes": sum(p.numel() * p.element_size() for p in self.model.parameters())}

    def _newer_weights_sent(self) -> bool:
        """Whether syncs newer than this replica's weights were sent (the same answer on every rank of a
        replica's TP group: they agree on the oldest count any of them read)."""
        group = self.engine.tp_group
        # on the bridge's device: the replica's TP group is an NCCL group on GPUs, which refuses host tensors
        sent = torch.tensor([self._bridge.announced()], dtype=torch.long, device=self._bridge.device)
        if group is not None and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(sent, op=torch.distributed.ReduceOp.MIN, group=group)
        self._sent = int(sent.item())
        return self._sent > self.version

    @register(Dispatch.ONE_TO_ALL)
    def generate_sequences(self, prompts: Batch, sampling: list[SamplingParams]) -> tuple[int, list[Batch]] | None:
        """This replica's share of the prompts for each sampling setting, with the newest weights received;
        (replica, [Batch per setting]) on its TP rank 0, None elsewhere. Each Batch's meta: the policy version
        it started with and the seconds this rank sat idle before the call."""
        idle_s = time.perf_counter() - self._idle_since
        if self._incoming is not None:
            self._apply()
        coords = self.layout.coords(self.rank)
        share = prompts.chunk(self.layout.dp)[coords.dp]
        outs, versions = [], []
        # expert-parallel peers decode in lockstep: a replica without prompts keeps their pace (placeholder rows)
        lockstep = self.layout.ep > 1
        try:  # the engine stays awake (the pool is generation's own): weights are pushed into it between calls
            for params in sampling if len(share) or lockstep else []:
                params = replica_params(params, coords.dp)
                versions.append(self.version)
                with torch.no_grad():
                    if not len(share):
                        self.engine.generate_rows([], params)
                        continue
                    outs.append(self._generate_partial(share, params) if self.partial
                                else self.engine.generate(share, params))
        finally:
            self._idle_since = time.perf_counter()
        if not outs or coords.tp != 0:
            return None
        for out, version in zip(outs, versions):
            out.meta.update(policy_version=version, idle_s=idle_s)
        return coords.dp, outs

    def _generate_partial(self, share: Batch, params: Any) -> Batch:
        """Generation that takes new weights as soon as they are sent: interrupted rows resume with them."""
        engine = self.engine
        prompts = validate_prompts(normalise_prompts(share), engine.max_model_len, params.max_new_tokens,
                                   engine.vocab_size)
        rows = [GeneratedSequence(ids, [], [], "interrupted", versions=[]) for ids in prompts for _ in range(params.n)]
        segment = 0
        while any(row.finish_reason == "interrupted" for row in rows):
            # rows left with the same token allowance resume together (rows never started have all of it)
            by_allowance: dict[int, list[GeneratedSequence]] = defaultdict(list)
            for row in rows:
                if row.finish_reason == "interrupted":
                    by_allowance[params.max_new_tokens - len(row.tokens)].append(row)
            for allowance, members in by_allowance.items():
                if self._sent > self.version:  # interrupted: the newest weights sent first
                    self._post_receives(self._sent)
                    self._apply()
                # segment 0 draws exactly what engine.generate would; later groups draw streams of their own
                seed = params.seed if params.seed is None or not segment else \
                    params.seed + 1_000_003 * segment + allowance
                resumed = engine.generate_rows([row.prompt + row.tokens for row in members],
                                               dataclasses.replace(params, max_new_tokens=allowance, seed=seed),
                                               self._newer_weights_sent)
                for row, more in zip(members, resumed):
                    row.tokens += more.tokens
                    row.log_probs += more.log_probs
                    row.versions += [self.version] * len(more.tokens)
                    row.finish_reason = more.finish_reason
                    if more.routing is not None:  # the resumed forward routed the whole sequence again
                        row.routing = more.routing
            segment += 1
        return assemble_batch(rows, params, engine.pad_token_id)

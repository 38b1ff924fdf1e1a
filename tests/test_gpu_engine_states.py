"""The GPU branch of the vLLM engine's sleep / wake / push order, run on CPU against a stand-in for vLLM on a GPU
(issue 36 item 2 and Must show 2).

On CPU vLLM's sleep is a no-op, so a wrong order cannot fail there. `GpuVllm` below behaves as vLLM 0.32 does on a
GPU with sleep mode: sleep(level=1) moves the weights to host memory, sleep(level=2) discards them, both release
the KV cache; a write into unmapped weights (a push, a LoRA adapter swap) is an illegal memory access, and
generating from discarded or missing weights gives garbage. The engine's real code (VllmRolloutEngine's GPU branch)
and the real callers' order (ActorWorker.begin_generation / end_generation, JudgeWorker.generate_verdicts,
VllmAdapters) run against it. Pure and in-process: no vLLM import, no Ray, no process group.
"""
from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from hybridrl.config import VllmConfig
from hybridrl.rollout.base import EngineState, EngineStateError
from hybridrl.rollout.vllm_engine import VllmRolloutEngine


class IllegalMemoryAccess(RuntimeError):
    """What CUDA reports when a kernel writes into memory vLLM's sleep unmapped."""


class GpuVllm:
    """vLLM's LLM on a GPU with enable_sleep_mode, as far as memory goes."""

    def __init__(self, loaded: bool) -> None:
        self.mapped = self.kv = True
        self.values = "loaded" if loaded else None  # dummy load_format: random values until a push
        self.host_copy = None
        self.calls: list = []
        self.loras: set[int] = set()
        self.llm_engine = SimpleNamespace(remove_lora=self._remove_lora)

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))
        self.host_copy = self.values if level == 1 else None
        self.values, self.mapped, self.kv = None, False, False

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(("wake_up", tuple(tags)))
        if "weights" in tags:
            self.mapped, self.values = True, self.host_copy
        if "kv_cache" in tags:
            if not self.mapped:
                raise IllegalMemoryAccess("KV cache woken before the weights")
            self.kv = True

    def collective_rpc(self, method: str, kwargs: dict | None = None) -> None:
        if not self.mapped:
            raise IllegalMemoryAccess(f"{method} into unmapped weights")
        self.calls.append((method,))
        for _ in (kwargs or {}).get("weights_iterator", ()):
            pass
        self.values = "pushed"

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))

    def _remove_lora(self, lora_id: int) -> None:
        if not self.mapped:
            raise IllegalMemoryAccess("remove_lora writes into a slot that sleeps with the weights")
        self.loras.discard(lora_id)

    def generate_ok(self) -> str:
        if not (self.mapped and self.kv):
            raise IllegalMemoryAccess("generate with unmapped weights or KV cache")
        if self.values is None:
            raise AssertionError("generated from discarded weights: garbage tokens")
        return self.values


class GpuEngine(VllmRolloutEngine):
    """The real engine class, its GPU branch, over GpuVllm (no vLLM import): generate() runs the state checks and
    reports which weights it would generate from."""

    def __init__(self, load_format: str = "auto", lora_rank: int | None = None) -> None:
        super(VllmRolloutEngine, self).__init__()  # RolloutEngine's state only
        self.settings, self.on_gpu, self.tp_groups = VllmConfig(), True, None
        self.serves_adapters, self.lora_request = lora_rank is not None, None
        self.weights_pushed = load_format == "dummy"
        self.llm = GpuVllm(loaded=load_format != "dummy")
        self._weights_current = load_format != "dummy"

    def generate(self, prompts, params):
        self._check_awake()
        return self.llm.generate_ok()


def _pushed(engine):
    engine.load_weights([("model.embed_tokens.weight", torch.zeros(2, 2))])


def test_the_stand_in_fails_the_orders_a_gpu_fails():
    """The stand-in is strict: without the engine's state machine each wrong order fails as on a GPU."""
    llm = GpuVllm(loaded=False)
    llm.sleep(level=2)
    with pytest.raises(IllegalMemoryAccess):
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": []})
    llm.wake_up(tags=["weights"])
    llm.wake_up(tags=["kv_cache"])
    with pytest.raises(AssertionError, match="garbage"):
        llm.generate_ok()


def test_the_colocated_actor_sleeps_at_level_2_and_pushes_between_the_two_wakes():
    from hybridrl.workers.actor import ActorWorker

    engine = GpuEngine(load_format="dummy")
    assert engine.discards_weights and engine.sleep_level == 2
    engine.release()
    worker = SimpleNamespace(_generating=False, _vllm_adapters=None, _weights_offload=None, _merged=None,
                             model=SimpleNamespace(lora=None), engine=engine,
                             hybrid=SimpleNamespace(to_generation=lambda: "gen", to_training=lambda: None,
                                                    last_stats=SimpleNamespace(extra={})),
                             rollout=SimpleNamespace(engine="vllm"))
    worker._push_weights = lambda gen_model: _pushed(engine)
    for _ in range(2):
        ActorWorker.begin_generation(worker)
        assert engine.state is EngineState.AWAKE and engine.generate([[1]], None) == "pushed"
        ActorWorker.end_generation(worker)
        assert engine.state is EngineState.ASLEEP
    assert engine.llm.calls[:5] == [("sleep", 2), ("wake_up", ("weights",)), ("reload_weights",),
                                    ("reset_prefix_cache",), ("wake_up", ("kv_cache",))]
    with pytest.raises(EngineStateError, match="sleeping engine"):  # the order the issue found: push, then wake
        _pushed(engine)
    engine.wake()
    with pytest.raises(EngineStateError, match="discarded"):  # woken without a push: no garbage tokens
        engine.generate([[1]], None)


def test_a_judge_keeps_its_own_weights_across_sleep():
    """A judge's vLLM loads its weights from its folder and nothing pushes them again: it sleeps at level 1
    (weights to host memory and back). At level 2, as every engine did before, its first verdict after a sleep
    was refused (or, without the state machine, generated from discarded weights)."""
    from hybridrl.workers.judge import JudgeWorker

    engine = GpuEngine(load_format="auto")
    assert not engine.discards_weights and engine.sleep_level == 1
    engine.release()
    prompts = SimpleNamespace(chunk=lambda n: [[[1, 2]]])
    worker = SimpleNamespace(engine=engine, hybrid=None,
                             groups=SimpleNamespace(gen_dp_rank=lambda r: 0, gen_dp_size=1,
                                                    gen_shard=lambda r: SimpleNamespace(gen_tp=0)), rank=0)
    for _ in range(2):
        assert JudgeWorker.generate_verdicts(worker, prompts, None) == (0, "loaded")
        assert engine.state is EngineState.ASLEEP
    assert ("sleep", 1) in engine.llm.calls and ("sleep", 2) not in engine.llm.calls


def test_a_lora_actor_swaps_adapters_only_while_the_base_is_resident(monkeypatch):
    """Serving LoRA adapters the engine keeps the frozen base it loaded (level 1); each step's adapters replace
    the last ones between wake_weights() and wake() (removing the old adapter writes into its slot)."""
    import hybridrl.workers.actor as actor_module
    from hybridrl.config import LoraConfig
    from hybridrl.rollout.vllm_lora import VllmAdapters

    request = types.ModuleType("vllm.lora.request")
    request.LoRARequest = lambda name, lora_id, path: SimpleNamespace(lora_name=name, lora_int_id=lora_id,
                                                                      lora_path=path)
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request)
    factors = {"model.layers.0.self_attn.q_proj": (torch.zeros(2, 4), torch.zeros(4, 2))}
    monkeypatch.setattr(actor_module, "adapter_factors_everywhere", lambda model: factors)
    engine = GpuEngine(load_format="auto", lora_rank=8)
    assert engine.sleep_level == 1
    engine.release()
    adapters = VllmAdapters(engine, LoraConfig(rank=2, alpha=4.0))
    worker = SimpleNamespace(_generating=False, _vllm_adapters=adapters, _weights_offload=None, _merged=None,
                             model=SimpleNamespace(model=None), engine=engine,
                             hybrid=SimpleNamespace(to_training=lambda: None))
    try:
        for step in range(2):
            ActorWorker = actor_module.ActorWorker
            ActorWorker.begin_generation(worker)
            assert engine.generate([[1]], None) == "loaded" and engine.lora_request.lora_int_id == step + 1
            ActorWorker.end_generation(worker)
        with pytest.raises(EngineStateError, match="LoRA adapter swap into a sleeping engine"):
            adapters.load(factors)
    finally:
        adapters.close()
    assert ("sleep", 2) not in engine.llm.calls and ("reload_weights",) not in engine.llm.calls

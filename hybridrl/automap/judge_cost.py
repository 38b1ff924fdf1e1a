"""Time and memory of the judge and the distillation teacher in the device-mapping search (cost.py's model).

teacher: a frozen causal LM scoring the step's sequences like the reference: one forward over the S sequences of
  T tokens (cost.forward_time with the LM head), its weights resident (cost.static_bytes, not trained).
judge (a generative reward model): reads every scored response through a template, Lj = T + template tokens:
  - verdict_tokens = 0 (choice_logprob): one forward over the scored sequences of Lj tokens;
  - verdict_tokens = k > 0 (a generated verdict): the actor's generation model (cost.generation_time) with
    prompts of Lj tokens and k new tokens, on the judge's R = p * d replicas of (t_g = t, p_g = 1) (the
    trainer's judge regroups a pipeline-parallel layout into one stage to generate, like the actor). Memory while
    judging: its weights, the gathered generation shard beyond its own (cost.generation_buffer_bytes) and the KV
    cache of the sequences one replica decodes at once, capped by what the pool has left (best effort, as for
    the actor).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hybridrl.automap.cost import ModelStats, Net, Workload, forward_time, generation_buffer_bytes, generation_time

DEFAULT_TEMPLATE_TOKENS = 64


@dataclass(frozen=True)
class JudgeWork:
    verdict_tokens: int = 0  # 0: choice_logprob (one forward); k: a verdict of k generated tokens
    template_tokens: int = DEFAULT_TEMPLATE_TOKENS  # what the template adds around the prompt and response

    def prompt_len(self, tokens: int) -> int:
        """The judge's input for a sequence of `tokens` (prompt + response)."""
        return tokens + self.template_tokens


def judge_cost(model: ModelStats, judge: JudgeWork, work: Workload, t: int, p: int, d: int, mb: int, net: Net,
               static: float, cap: float) -> tuple[float, float] | None:
    """(seconds of one step's judging, peak bytes on a device while judging) at layout (t, p, d) with `static`
    bytes resident on the pool out of `cap`; None when its KV cache does not fit one sequence."""
    length = judge.prompt_len(work.tokens)
    if judge.verdict_tokens == 0:
        return forward_time(model, True, t, p, d, mb, work.scored, length, net), static
    acc = net.acc
    buffer = generation_buffer_bytes(model, t, p, t, 1, acc)
    per_sequence = (length + judge.verdict_tokens) * model.kv_bytes_per_token(t, 1, acc.param_bytes)
    batch_cap = math.floor((cap - static - buffer) / per_sequence)
    if batch_cap < 1:
        return None
    replicas = p * d
    verdicts = replace(work, prompts=work.scored, samples=1, greedy=False, prompt_len=length,
                       response_len=judge.verdict_tokens)
    seconds = generation_time(model, t, 1, replicas, batch_cap, verdicts, net)
    used = min(batch_cap, math.ceil(work.scored / replicas), work.max_decode_batch)
    return seconds, static + buffer + used * per_sequence

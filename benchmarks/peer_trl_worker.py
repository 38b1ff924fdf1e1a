"""The TRL side of benchmarks/peer_trl.py (runs inside benchmarks/.venv-trl; no hybridrl import): TRL's
GRPOTrainer on the peer job (benchmarks/peer_job.py), as a user runs it, writing one record per optimizer step.

GRPOConfig: use_cpu, --precision fp32: bf16 / fp16 off (the user's change), bf16: TRL's default (bf16=True: fp32
weights, bf16 autocast), gradient checkpointing off, num_generations = samples, one iteration per
batch, max_completion_length = new tokens (fixed length: min_new_tokens too). per_device_train_batch_size = every
sequence of the step, or --micro-batch with gradient accumulation up to the step's sequences (TRL then generates
the whole batch at once and trains in micro-batches, one optimizer step per batch). Torch's thread count and the
OpenMP settings are left at their defaults. Timing: generation (_generate_single_turn), reward
(_calculate_rewards), the rest of the rollout, forward+backward (the step minus the rollout and the optimizer)
and the optimizer step, with wrappers and callbacks; the padded positions each stage computes are counted.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from peer_job import JOB, word_reward


def build_trainer(args: argparse.Namespace):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(JOB["seed"])
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "target": r["target"]} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    sequences = args.prompts * args.samples
    micro = args.micro_batch or sequences
    if sequences % micro:
        raise SystemExit(f"--micro-batch {micro} must divide the step's {sequences} sequences")

    def reward(prompts, completions, target, **_):
        return [word_reward(p, c, target=t) for p, c, t in zip(prompts, completions, target)]

    generation = {} if args.natural else {"min_new_tokens": args.new_tokens}
    precision = {"bf16": False, "fp16": False} if args.precision == "fp32" else {}  # bf16: TRL's own default
    config = GRPOConfig(
        output_dir=args.out_dir, use_cpu=True, **precision, gradient_checkpointing=False,
        per_device_train_batch_size=micro, gradient_accumulation_steps=sequences // micro,
        num_generations=args.samples, num_iterations=1, max_completion_length=args.new_tokens,
        generation_kwargs=generation, temperature=JOB["temperature"], top_p=1.0, top_k=0, beta=JOB["beta"],
        epsilon=JOB["clip_ratio"], learning_rate=JOB["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=JOB["clip_grad"], max_steps=args.steps, logging_steps=1, save_strategy="no",
        report_to="none", seed=JOB["seed"], data_seed=JOB["seed"], dataloader_num_workers=0,
        remove_unused_columns=False, disable_tqdm=True, log_completions=False)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer)
    return trainer, micro


def instrument(trainer, steps: list[dict]) -> None:
    """Per-step records: stage seconds, sampled tokens, and the padded positions the update computes."""
    from transformers import TrainerCallback

    clock = time.perf_counter
    current: dict[str, float] = {}

    def timed(name: str, fn):
        def wrapper(*a, **k):
            start = clock()
            try:
                return fn(*a, **k)
            finally:
                current[name] = current.get(name, 0.0) + clock() - start
        return wrapper

    generate_and_score = trainer._generate_and_score_completions

    def rollout(inputs):
        start = clock()
        out = generate_and_score(inputs)
        current["rollout"] = current.get("rollout", 0.0) + clock() - start
        prompt_mask, completion_mask = out["prompt_mask"], out["completion_mask"]
        current["prompt_tokens"] = float(prompt_mask.sum())
        current["response_tokens"] = float(completion_mask.sum())
        current["sequences"] = float(completion_mask.shape[0])
        current["response_len_min"] = float(completion_mask.sum(-1).min())
        # the update runs on [sequences, prompt width + completion width]; generation decodes every row for
        # the longest completion's steps
        real = current["prompt_tokens"] + current["response_tokens"]
        current["update_fill"] = real / float(prompt_mask.numel() + completion_mask.numel())
        current["decode_fill"] = current["response_tokens"] / float(completion_mask.numel())
        return out

    trainer._generate_and_score_completions = rollout
    trainer._generate_single_turn = timed("generation", trainer._generate_single_turn)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *_, **__):
            current.clear()
            current["_start"] = clock()

        def on_pre_optimizer_step(self, *_, **__):
            current["_opt"] = clock()

        def on_optimizer_step(self, *_, **__):
            current["optimizer"] = clock() - current.pop("_opt")

        def on_step_end(self, *_, **__):
            record = dict(current)
            record["seconds"] = clock() - record.pop("_start")
            steps.append(record)

    trainer.add_callback(StepTimes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True, help="per-step records (JSON), rewritten after every step")
    parser.add_argument("--out-dir", required=True, help="TRL's output_dir")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--natural", action="store_true", help="EOS ends a response (no min_new_tokens)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="fp32: bf16=False; bf16: GRPOConfig's default (bf16=True)")
    parser.add_argument("--micro-batch", type=int, default=None, help="per_device_train_batch_size")
    args = parser.parse_args()

    import torch
    import transformers
    import trl

    trainer, micro = build_trainer(args)
    steps: list[dict] = []
    instrument(trainer, steps)
    versions = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}

    def write() -> None:  # after every step: a run stopped at its time limit keeps the steps it finished
        Path(args.out).write_text(json.dumps({"steps": steps, "threads": torch.get_num_threads(),
                                              "micro_batch": micro, "versions": versions,
                                              "bf16": bool(trainer.args.bf16)}))

    from transformers import TrainerCallback

    class Save(TrainerCallback):
        def on_step_end(self, *_, **__):
            write()

    trainer.add_callback(Save())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    for record, log in zip(steps, logs):
        record["reward_mean"] = float(log["reward"])
    write()


if __name__ == "__main__":
    main()

"""A reward model reads text with its own tokenizer (and chat template), and the seed's ReMax lines run as written.

- an RM whose vocabulary differs from the actor's scores (prompt, response) texts at TP=2 exactly as
  transformers' sequence classifier scores the same strings; given the actor's Rollout it re-tokenises;
- a reward model trained on a dialogue format reads (prompt, response) in that format (`format=`, over the
  prompt, the response and row fields): its scores equal transformers' on the same formatted text;
- the project's 6-line ReMax step (below, verbatim) runs with a model RM and with a rule RM;
- the short API checks the prompts it is given against the sequences' own (a mismatch is an error).
"""
from __future__ import annotations

import pytest
import torch

import hybridrl
from conftest import RM_VOCAB, save_rm_tokenizer
from hybridrl.api import TextScoring, check_prompts, encode_prompts
from hybridrl.data.tokenizer import load_tokenizer

PROMPTS = ["vowels: qzkt", "vowels: bcdf", "vowels: rkjm", "vowels: lfkp"]
HH_FORMAT = "\n\nHuman: {prompt}\n\nAssistant: {response}"  # Anthropic HH-RLHF's dialogue format


def _rm_ids(prompt: str, response: str, chat: bool, text: str | None = None) -> list[int]:
    """The RM's token ids, written out by hand from RM_VOCAB (independent of the tokenizer code); `text`: the
    whole input already formatted (BOS + its characters)."""
    index = {token: i for i, token in enumerate(RM_VOCAB)}
    chars = lambda text: [index.get(c, index["<unk>"]) for c in text]  # noqa: E731
    if text is not None:
        return [index["<|bos|>"]] + chars(text)
    if chat:
        return [index["<|bos|>"]] + chars(f"<user>{prompt}<assistant>{response}") + [index["<|eos|>"]]
    return [index["<|bos|>"]] + chars(prompt + response)


def _hf_scores(rm_own_tokenizer, prompts, responses, chat: bool, texts: list[str] | None = None) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(str(rm_own_tokenizer), dtype=torch.float32)
    texts = texts or [None] * len(prompts)
    with torch.no_grad():
        return torch.tensor([model(input_ids=torch.tensor([_rm_ids(p, r, chat, t)])).logits[0, 0].item()
                             for p, r, t in zip(prompts, responses, texts)])


# ---- without Ray ---------------------------------------------------------------------------------------
def test_text_scoring_tokenizes_with_the_rm_tokenizer(rm_own_tokenizer, tmp_path):
    actor_tok = load_tokenizer(None)
    chat = TextScoring(str(rm_own_tokenizer))  # the folder declares a chat template: used by default
    assert chat.chat_template and not chat.reads_ids_of(actor_tok)
    batch = chat.encode(["ab", "xyz?"], ["c", ""])
    for row, (p, r) in enumerate([("ab", "c"), ("xyz?", "")]):
        ids = torch.cat([batch["prompts"][row], batch["responses"][row]])
        mask = batch["attention_mask"][row].bool()
        assert ids[mask].tolist() == _rm_ids(p, r, chat=True)
    plain = TextScoring(str(rm_own_tokenizer), chat_template=False)
    assert plain.texts_to_ids(["ab"], ["c"]) == [_rm_ids("ab", "c", chat=False)]
    assert not plain.reads_ids_of(actor_tok)  # another vocabulary: re-tokenise

    from hybridrl.models.tiny import create_tiny_model

    bare = create_tiny_model(tmp_path / "bare", vocab_size=64, hidden=32, layers=1, head="seq_cls")
    assert TextScoring(str(bare)).reads_ids_of(actor_tok)  # no tokenizer of its own: reads the actor's ids
    assert TextScoring(str(bare), tokenizer=actor_tok, chat_template=False).reads_ids_of(load_tokenizer(None))
    save_rm_tokenizer(tmp_path / "plain_tok", chat_template=False)
    with pytest.raises(ValueError, match="no chat template"):
        TextScoring(str(rm_own_tokenizer), tokenizer=str(tmp_path / "plain_tok"), chat_template=True)
    with pytest.raises(ValueError, match="no Hugging Face model folder"):
        hybridrl.RewardModel(model=str(tmp_path / "nowhere"))


def test_text_scoring_in_the_models_own_format(rm_own_tokenizer):
    from hybridrl.config import load_config
    from hybridrl.trainer.config_checks import check_values

    hh = TextScoring(str(rm_own_tokenizer), format=HH_FORMAT)  # the format wins over the folder's chat template
    assert not hh.chat_template and not hh.reads_ids_of(hh.tokenizer)
    assert hh.render(["ab"], ["c"]) == ["\n\nHuman: ab\n\nAssistant: c"]
    assert hh.texts_to_ids(["ab"], ["c"]) == [_rm_ids("", "", False, "\n\nHuman: ab\n\nAssistant: c")]
    rows = TextScoring(str(rm_own_tokenizer), format="[{task}] {prompt} = {response}")  # a row's own field
    assert rows.render(["ab", "cd"], ["1", "2"], [{"task": "x"}, {"task": "y"}]) == ["[x] ab = 1", "[y] cd = 2"]
    with pytest.raises(ValueError, match=r"names \['task'\], which row 0 does not have"):
        rows.render(["ab"], ["1"])
    with pytest.raises(ValueError, match="not both"):
        TextScoring(str(rm_own_tokenizer), format=HH_FORMAT, chat_template=True)
    with pytest.raises(ValueError, match="has no {response} field"):
        hybridrl.RewardModel(model=str(rm_own_tokenizer), format="Human: {prompt}")
    with pytest.raises(ValueError, match="format= belong to a reward model"):
        hybridrl.RewardModel(fn="hybridrl.data.tasks:charset_reward", format=HH_FORMAT)
    cfg = load_config(None, ["reward_model.format='{0}{response}'"])  # quoted: YAML reads {..} as a mapping
    with pytest.raises(ValueError, match=r"reward_model.format='\{0\}\{response\}': fields must be plain names"):
        check_values(cfg)


def test_prompts_are_checked_against_the_sequences():
    tok = load_tokenizer(None)
    batch, _, _ = encode_prompts(tok, PROMPTS)
    n = 2  # two sequences per prompt, prompt-major, with a response column
    sequences = hybridrl.Batch({"prompts": batch["input_ids"].repeat_interleave(n, 0),
                                "attention_mask": torch.cat([batch["attention_mask"].repeat_interleave(n, 0),
                                                             torch.ones(len(PROMPTS) * n, 3, dtype=torch.long)], 1)})
    check_prompts(tok, PROMPTS, sequences, "test")
    with pytest.raises(ValueError, match="prompt 1 is not the prompt of sequence 2"):
        check_prompts(tok, [PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]], sequences, "test")
    with pytest.raises(ValueError, match="3 prompts for 8 sequences"):
        check_prompts(tok, PROMPTS[:3], sequences, "test")


# ---- on Ray --------------------------------------------------------------------------------------------
def _seed_step(actor, ref_policy, reward_model, batch, beta):
    """The seed's lines, verbatim."""
    actor_output = actor.generate_sequences(batch['prompt'])
    ref_log_probs = ref_policy.get_log_probs(batch['prompt'], actor_output.sequences)
    rewards = reward_model.score(batch['prompt'], actor_output.texts)
    kl_divergence = actor_output.log_probs - ref_log_probs
    total_rewards = rewards - beta * kl_divergence.mean(dim=-1)
    metrics = actor.update(states=batch['prompt'], actions=actor_output.sequences, advantages=total_rewards)
    return actor_output, rewards, kl_divergence, metrics


@pytest.mark.slow
def test_rm_with_its_own_tokenizer_at_tp2_and_the_seed_lines(ray_two_devices, rm_own_tokenizer):
    from hybridrl.data.tasks import charset_reward

    pool = hybridrl.ResourcePool(devices=2)
    try:
        actor = hybridrl.Actor(parallel={"tp": 2}, rollout={"tp": 1, "max_new_tokens": 8}, resource_pool=pool,
                               optim={"lr": 1e-2})
        ref_policy = hybridrl.ReferencePolicy(resource_pool=pool)
        reward_model = hybridrl.RewardModel(model=str(rm_own_tokenizer), resource_pool=pool, parallel={"tp": 2})
        assert reward_model.role.layout.tp == 2
        out = actor.generate_sequences(PROMPTS, seed=5)
        texts_scores = reward_model.score(PROMPTS, out.texts)
        rollout_scores = reward_model.score(PROMPTS, out)  # other vocabulary: re-tokenised from the texts
        expected = _hf_scores(rm_own_tokenizer, PROMPTS, out.texts, chat=True)
        assert (texts_scores - expected).abs().max() <= 1e-5
        assert torch.equal(rollout_scores, texts_scores)
        with pytest.raises(ValueError, match="is not the prompt of response 0"):
            reward_model.score(PROMPTS[::-1], out)
        with pytest.raises(TypeError, match="own tokenizer"):
            reward_model.score(out.sequences)  # the actor's ids mean nothing to this reward model
        with pytest.raises(TypeError, match="cannot be checked"):
            reward_model.score(PROMPTS, out.sequences)

        # the same model trained on HH-RLHF dialogues scores "\n\nHuman: ...\n\nAssistant: ..." texts
        hh_model = hybridrl.RewardModel(model=str(rm_own_tokenizer), resource_pool=pool, format=HH_FORMAT,
                                        role="hh_reward")
        formatted = [HH_FORMAT.format(prompt=p, response=r) for p, r in zip(PROMPTS, out.texts)]
        expected = _hf_scores(rm_own_tokenizer, PROMPTS, out.texts, chat=False, texts=formatted)
        assert (hh_model.score(PROMPTS, out) - expected).abs().max() <= 1e-5
        assert (expected - texts_scores).abs().max() > 1e-3  # the format changes what the model reads

        # the seed's lines with this reward model, then with a rule reward
        beta = 0.001
        batch = {"prompt": PROMPTS}
        out, rewards, kl, metrics = _seed_step(actor, ref_policy, reward_model, batch, beta)
        assert (rewards - _hf_scores(rm_own_tokenizer, PROMPTS, out.texts, chat=True)).abs().max() <= 1e-5
        assert metrics["update_ok"] == 1.0 and kl.shape == out.mask.shape
        rule_rm = hybridrl.RewardModel(fn=charset_reward)
        out, rewards, kl, metrics = _seed_step(actor, ref_policy, rule_rm, batch, beta)
        assert metrics["update_ok"] == 1.0
        assert torch.equal(rewards, torch.tensor([charset_reward(p, t) for p, t in zip(PROMPTS, out.texts)]))
        # what mean(dim=-1) means on padded [B, R] rows: each row's sum over its own tokens / the batch's R
        assert (kl * out.mask == kl).all()  # both log-prob tensors are 0 on padding
        width = out.mask.shape[1]
        assert torch.allclose(kl.mean(dim=-1), kl.sum(-1) / width)
        assert torch.allclose(out.masked_mean(kl), kl.sum(-1) / out.mask.sum(-1))

        # prompts that are not the sequences' own are refused, not ignored
        with pytest.raises(ValueError, match="is not the prompt of sequence"):
            actor.update(states=PROMPTS[::-1], actions=out.sequences, advantages=rewards)
        with pytest.raises(ValueError, match="is not the prompt of sequence"):
            ref_policy.get_log_probs(PROMPTS[::-1], out.sequences)
    finally:
        pool.shutdown()

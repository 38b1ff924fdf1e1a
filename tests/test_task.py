"""The bundled task: character tokenizer, prompt files and the rule reward."""
import json
import random

import pytest

from hybridrl.data import tasks
from hybridrl.data.make_task import NUM_ROWS, SEED
from hybridrl.data.tokenizer import (BUNDLED_TOKENIZER_DIR, CHARACTERS, VOCAB_SIZE, create_char_tokenizer,
                                     load_tokenizer)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_tokenizer_round_trips_text(tokenizer):
    text = "vowels: qzkt -> aeiou 0123!\n(ok)"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id  # Llama-style <s> prepended
    assert len(ids) == len(text) + 1  # one token per character
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    every_char = "".join(CHARACTERS)
    assert tokenizer.decode(tokenizer(every_char, add_special_tokens=False)["input_ids"]) == every_char


def test_tokenizer_special_tokens_and_vocab(tokenizer):
    assert VOCAB_SIZE == 64 and len(tokenizer) == 64 and VOCAB_SIZE % 8 == 0
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == ("<pad>", "<s>", "</s>")
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.convert_ids_to_tokens([4, 5]) == ["a", "b"]
    # a character outside the alphabet maps to <unk> instead of failing
    assert tokenizer("é", add_special_tokens=False)["input_ids"] == [tokenizer.unk_token_id]
    # special tokens written in text stay single tokens; decoding can drop them
    ids = tokenizer("ab</s>", add_special_tokens=False)["input_ids"]
    assert ids == [4, 5, 2]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "ab"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<s>u:hi\na:"


def test_bundled_assets_are_reproducible(tmp_path):
    assert create_char_tokenizer(tmp_path / "tok") == 64
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "tok" / name).read_bytes() == (BUNDLED_TOKENIZER_DIR / name).read_bytes(), name
    for name in sorted(tasks.TASK_ROW_MAKERS):
        fresh = tasks.write_task_file(name, tmp_path / f"{name}.jsonl", num_rows=NUM_ROWS, seed=SEED)
        assert fresh.read_bytes() == tasks.task_train_file(name).read_bytes(), name


def test_bundled_prompt_files():
    vowels = [json.loads(line) for line in tasks.task_train_file("vowels").read_text().splitlines()]
    assert len(vowels) == 400 and len({row["prompt"] for row in vowels}) > 300
    assert all(row["prompt"].startswith("vowels: ") and row["target_set"] == "aeiou" for row in vowels)
    mixed = [json.loads(line) for line in tasks.task_train_file("charset").read_text().splitlines()]
    assert sum(row["target_set"] == "0123456789" for row in mixed) == 200
    assert tasks.task_reward_path() == "hybridrl.data.tasks:charset_reward"
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        tasks.task_train_file("nope")


def test_reward_hand_values():
    reward = tasks.charset_reward
    assert reward("vowels: kt", "aexy") == 0.5
    assert reward("vowels: kt", "a1b2", target_set="0123456789") == 0.5
    assert reward("digits: kt", "7 7 7") == 0.6
    assert reward("vowels: kt", "") == 0.0
    assert reward("vowels: kt", "zzz") == 0.0
    assert reward("vowels: kt", "a") == 0.25  # short answers are divided by min_length=4
    assert reward("vowels: kt", "a", min_length=1) == 1.0
    assert reward("vowels: kt", "eeeeeeeeeeeeeeee") == 1.0
    with pytest.raises(ValueError, match="target_set"):
        reward("say something", "aeiou")


@pytest.mark.parametrize("task", ["vowels", "charset"])
def test_random_policy_scores_low_and_oracle_scores_one(tokenizer, task):
    rows = [json.loads(line) for line in tasks.task_train_file(task).read_text().splitlines()]
    rng = random.Random(0)
    max_new_tokens = 16
    scores = []
    for row in rows:
        # a uniform policy over the whole vocabulary, stopping at </s> like generation does
        ids = []
        for _ in range(max_new_tokens):
            token = rng.randrange(VOCAB_SIZE)
            if token == tokenizer.eos_token_id:
                break
            ids.append(token)
        response = tokenizer.decode(ids, skip_special_tokens=True)
        scores.append(tasks.charset_reward(row["prompt"], response, **{k: v for k, v in row.items() if k != "prompt"}))
    mean = sum(scores) / len(scores)
    assert 0.02 < mean < 0.2, mean
    for row in rows:
        extra = {k: v for k, v in row.items() if k != "prompt"}
        assert tasks.charset_reward(row["prompt"], tasks.charset_oracle(row["prompt"], **extra), **extra) == 1.0
        assert tasks.charset_reward(row["prompt"], tasks.charset_oracle(row["prompt"])) == 1.0

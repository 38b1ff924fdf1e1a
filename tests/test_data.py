"""Prompt datasets (jsonl / parquet / folders, chat template, metadata) and the resumable loader."""
import json

import pytest
import torch

from hybridrl.data.dataset import PromptDataset, prompt_dataset_from_config
from hybridrl.data.loader import StatefulPromptLoader, collate_prompts
from hybridrl.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def numbered_rows(n, start=0):
    return [{"prompt": f"p{i}", "answer": str(i), "level": i % 3} for i in range(start, start + n)]


def test_jsonl_parquet_and_folder(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(tmp_path / "a.jsonl", numbered_rows(3))
    pq.write_table(pa.Table.from_pylist(numbered_rows(2, start=3)), tmp_path / "b.parquet")
    (tmp_path / "notes.txt").write_text("ignored")
    data = PromptDataset(tmp_path, tok)  # folder: its .jsonl and .parquet files, sorted by name
    assert len(data) == 5 and [row.text for row in data.rows] == ["p0", "p1", "p2", "p3", "p4"]
    # "p4" -> <s>=1, p=4+15=19, 4=30+4=34
    assert data[4].input_ids == [1, 19, 34] and data[4].index == 4
    assert data[3].metadata == {"answer": "3", "level": 0}
    only_parquet = PromptDataset([tmp_path / "b.parquet"], tok)
    assert [row.text for row in only_parquet.rows] == ["p3", "p4"]


def test_prompt_key_chat_template_and_messages(tmp_path, tok):
    write_jsonl(tmp_path / "q.jsonl", [{"question": "hi", "gold": 1}])
    data = PromptDataset(tmp_path / "q.jsonl", tok, prompt_key="question", chat_template=True)
    # "<s>u:hi\na:" -> <s> u : h i \n a :
    assert data[0].input_ids == [1, 24, 44, 11, 12, 41, 4, 44]
    assert data[0].text == "hi" and data[0].metadata == {"gold": 1}
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ok"}]
    write_jsonl(tmp_path / "m.jsonl", [{"prompt": messages}])
    chat = PromptDataset(tmp_path / "m.jsonl", tok)  # message lists always go through the template
    assert tok.decode(chat[0].input_ids) == "<s>s:be brief\nu:ok\na:"
    assert chat[0].text == "ok"


def test_overlong_prompts_error_or_drop(tmp_path, tok):
    write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ab"}, {"prompt": "abcdefgh"}, {"prompt": "abc"}])
    with pytest.raises(ValueError, match=r"1 of 3 prompts are longer than data.max_prompt_length=5.*9 tokens"):
        PromptDataset(tmp_path / "d.jsonl", tok, max_prompt_length=5)
    kept = PromptDataset(tmp_path / "d.jsonl", tok, max_prompt_length=5, overlong="drop")
    assert [row.text for row in kept.rows] == ["ab", "abc"] and kept.num_dropped == 1
    assert [row.index for row in kept.rows] == [0, 1]
    with pytest.raises(ValueError, match="every prompt is longer"):
        PromptDataset(tmp_path / "d.jsonl", tok, max_prompt_length=2, overlong="drop")
    # from the config: the hint names the option, and the option drops
    from hybridrl.config import load_config
    from hybridrl.data.dataset import prompt_dataset_from_config

    cfg = load_config(None, [f"data.train_files=[{tmp_path / 'd.jsonl'}]", "data.max_prompt_length=5"])
    with pytest.raises(ValueError, match="drop them with data.overlong_prompts=drop"):
        prompt_dataset_from_config(cfg.data, tok)
    cfg.data.overlong_prompts = "drop"
    assert [row.text for row in prompt_dataset_from_config(cfg.data, tok).rows] == ["ab", "abc"]


def test_clear_errors(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="data.train_files.*does not exist"):
        PromptDataset(tmp_path / "missing.jsonl", tok)
    with pytest.raises(KeyError, match="no column 'prompt'.*'text'.*data.prompt_key"):
        PromptDataset(write_jsonl(tmp_path / "c.jsonl", [{"text": "x"}]), tok)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="hold no rows"):
        PromptDataset(tmp_path / "empty.jsonl", tok)
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
        PromptDataset(tmp_path / "bad.jsonl", tok)
    (tmp_path / "x.csv").write_text("prompt\na\n")
    with pytest.raises(ValueError, match="neither .jsonl nor .parquet"):
        PromptDataset(tmp_path / "x.csv", tok)
    (tmp_path / "sub").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.jsonl or \\*.parquet"):
        PromptDataset(tmp_path / "sub", tok)
    with pytest.raises(ValueError, match="string or a list"):
        PromptDataset(write_jsonl(tmp_path / "n.jsonl", [{"prompt": 5}]), tok)
    data = PromptDataset(write_jsonl(tmp_path / "ok.jsonl", numbered_rows(3)), tok)
    with pytest.raises(ValueError, match="data.batch_size=4 is larger than the dataset \\(3 prompts\\)"):
        StatefulPromptLoader(data, batch_size=4, pad_token_id=0)


def test_collate_left_pads(tmp_path, tok):
    data = PromptDataset(write_jsonl(tmp_path / "c.jsonl", [{"prompt": "a"}, {"prompt": "abc", "k": 1}]), tok)
    batch = collate_prompts(data.rows, pad_token_id=0)
    assert batch.input_ids.tolist() == [[0, 0, 1, 4], [1, 4, 5, 6]]
    assert batch.attention_mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert batch.texts == ["a", "abc"] and batch.metadata == [{}, {"k": 1}] and batch.indices == [0, 1]
    assert collate_prompts(data.rows, 0, pad_to=6).input_ids[0].tolist() == [0, 0, 0, 0, 1, 4]
    with pytest.raises(ValueError, match="pad_to=3"):
        collate_prompts(data.rows, 0, pad_to=3)


def test_loader_epochs_shuffle_and_drop_last(tmp_path, tok):
    data = PromptDataset(write_jsonl(tmp_path / "l.jsonl", numbered_rows(10)), tok)
    loader = StatefulPromptLoader(data, batch_size=3, pad_token_id=0, seed=5)
    assert len(loader) == 3  # drop_last: 10 // 3
    epoch0 = [batch.indices for batch in loader]
    assert len(epoch0) == 3 and all(len(b) == 3 for b in epoch0)
    assert len(set(sum(epoch0, []))) == 9  # no repeats inside an epoch
    epoch1 = [batch.indices for batch in loader]
    assert epoch1 != epoch0 and loader.epoch == 1  # reshuffled per epoch
    again = StatefulPromptLoader(data, batch_size=3, pad_token_id=0, seed=5)
    assert [b.indices for b in again] == epoch0  # same seed, same order
    other = StatefulPromptLoader(data, batch_size=3, pad_token_id=0, seed=6)
    assert [b.indices for b in other] != epoch0
    keep_last = StatefulPromptLoader(data, batch_size=4, pad_token_id=0, seed=5, drop_last=False)
    sizes_and_rows = [b.indices for b in keep_last]
    assert [len(b) for b in sizes_and_rows] == [4, 4, 2]
    assert sorted(sum(sizes_and_rows, [])) == list(range(10))  # every prompt exactly once
    plain = StatefulPromptLoader(data, batch_size=5, pad_token_id=0, shuffle=False)
    assert [b.indices for b in plain] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    first = plain.next_batch()  # next_batch rolls into the next epoch
    assert first.indices == [0, 1, 2, 3, 4] and plain.epoch == 1
    assert torch.equal(first.input_ids[0], torch.tensor([1, 19, 30]))  # "p0"


def test_loader_resume_is_exact(tmp_path, tok):
    data = PromptDataset(write_jsonl(tmp_path / "r.jsonl", numbered_rows(7)), tok)
    straight = StatefulPromptLoader(data, batch_size=2, pad_token_id=0, seed=3)
    reference = [straight.next_batch().indices for _ in range(10)]  # crosses 3 epoch boundaries
    for cut in (1, 3, 4, 7):
        first = StatefulPromptLoader(data, batch_size=2, pad_token_id=0, seed=3)
        seen = [first.next_batch().indices for _ in range(cut)]
        state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
        resumed = StatefulPromptLoader(data, batch_size=2, pad_token_id=0, seed=3)
        resumed.load_state_dict(state)
        seen += [resumed.next_batch().indices for _ in range(10 - cut)]
        assert seen == reference, cut
    wrong = StatefulPromptLoader(data, batch_size=3, pad_token_id=0, seed=3)
    with pytest.raises(ValueError, match="batch_size=2"):
        wrong.load_state_dict(straight.state_dict())


def test_dataset_from_config_defaults_to_bundled_task(tok):
    from omegaconf import OmegaConf

    from hybridrl.config import DataConfig

    cfg = OmegaConf.structured(DataConfig)
    data = prompt_dataset_from_config(cfg, tok)
    assert len(data) == 400 and data.max_length() <= cfg.max_prompt_length
    assert data[0].text.startswith("vowels: ") and data[0].metadata["target_set"] == "aeiou"
    loader = StatefulPromptLoader(data, cfg.batch_size, tok.pad_token_id, seed=cfg.seed)
    batch = loader.next_batch()
    assert batch.input_ids.shape[0] == cfg.batch_size
    assert (batch.input_ids[:, -1] != tok.pad_token_id).all()  # left padding: every prompt ends last

import pytest
import torch

from hybridrl.workers.policy import response_index, response_mask
from hybridrl.workers.sequences import gather_at, micro_batches, pack, packed_fill, restore_order


def _example():
    # row 0: prompt [5, 6] (left-padded to 3), response [7, 8] ; row 1: prompt [1, 2, 3], response [4]
    prompts = torch.tensor([[0, 5, 6], [1, 2, 3]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    responses = torch.tensor([[7, 8], [4, 0]])
    response_mask = torch.tensor([[1, 1], [1, 0]])
    return pack(prompts, prompt_mask, responses, response_mask, pad_id=0)


def test_pack_concatenates_real_tokens_right_padded():
    packed = _example()
    assert packed.input_ids.tolist() == [[5, 6, 7, 8], [1, 2, 3, 4]]
    assert packed.lengths.tolist() == [4, 4]
    assert packed.prompt_lengths.tolist() == [2, 3]


def test_response_index_points_at_the_predicting_position():
    packed = _example()
    mb = {"input_ids": packed.input_ids, "prompt_lengths": packed.prompt_lengths,
          "row_of": torch.tensor([0, 1]), "seq_start": torch.tensor([0, 0]),
          "response_mask": torch.tensor([[1, 1], [1, 0]]), "row_valid": torch.tensor([1.0, 0.0])}
    # row 0 response token 7 sits at position 2, predicted by position 1; row 1 token 4 by position 2
    index = response_index(mb)
    assert index.tolist() == [[1, 2], [2, 3]]
    picked = gather_at(packed.input_ids, mb, index + 1)
    assert picked[0].tolist() == [7, 8] and picked[1, 0].item() == 4
    assert response_mask(mb).tolist() == [[1.0, 1.0], [0.0, 0.0]]  # filler rows (row_valid 0) masked out


def test_pack_rounds_width_to_a_multiple():
    prompts = torch.tensor([[0, 5]])
    packed = pack(prompts, torch.tensor([[0, 1]]), torch.tensor([[9, 0, 0]]), torch.tensor([[1, 0, 0]]),
                  multiple_of=4)
    assert packed.input_ids.tolist() == [[5, 9, 0, 0]]
    assert packed.lengths.tolist() == [2]


def _lengths_example():
    """Five sequences of lengths 6, 2, 3, 4, 1 (prompt of 1 token each), packed right-padded to width 6."""
    lengths = [6, 2, 3, 4, 1]
    prompts = torch.tensor([[10 + i] for i in range(5)])
    responses = torch.zeros((5, 5), dtype=torch.long)
    response_mask = torch.zeros((5, 5), dtype=torch.long)
    for i, n in enumerate(lengths):
        responses[i, :n - 1] = torch.arange(1, n) + 20 * i
        response_mask[i, :n - 1] = 1
    return pack(prompts, torch.ones((5, 1), dtype=torch.long), responses, response_mask), response_mask


def test_token_budget_packs_short_sequences_into_shared_rows():
    packed, response_mask = _lengths_example()
    mbs, order = micro_batches(packed, {"response_mask": response_mask}, micro_batch_size=2, max_tokens=12)
    # first-fit decreasing into rows of 6: [6], [4, 2], [3, 1]; 12 tokens = 2 rows per micro-batch
    assert [mb["input_ids"].shape for mb in mbs] == [torch.Size([2, 6]), torch.Size([1, 6])]
    assert order == [0, 3, 1, 2, 4]
    second = mbs[0]
    assert second["row_of"].tolist() == [0, 1, 1] and second["seq_start"].tolist() == [0, 0, 4]
    assert second["input_ids"][1].tolist() == [13, 61, 62, 63, 11, 21]
    assert second["position_ids"][1].tolist() == [0, 1, 2, 3, 0, 1]
    mask = second["attention_mask"][1, 0]  # True = masked: block-diagonal causal
    allowed = ~mask
    assert allowed[5].tolist() == [False, False, False, False, True, True]
    assert allowed[3].tolist() == [True, True, True, True, False, False]
    # every sequence's tokens are found again at its place, and results come back in the original order
    seqs = iter(order)
    for mb in mbs:
        got = gather_at(mb["input_ids"], mb, torch.arange(6).unsqueeze(0).expand(len(mb["lengths"]), 6))
        for row, n in zip(got, mb["lengths"].tolist()):
            assert row[:n].tolist() == packed.input_ids[next(seqs), :n].tolist()
    results = torch.cat([mb["lengths"] for mb in mbs])
    assert restore_order(results, order).tolist() == packed.lengths.tolist()
    # 16 real tokens in 3 rows of 6 (one sequence per row: 5 rows of 6)
    assert packed_fill(mbs) == pytest.approx(16 / 18)
    assert packed_fill(micro_batches(packed, {}, micro_batch_size=8)[0]) == pytest.approx(16 / 30)


def test_rows_mode_and_uniform_pipeline_shapes():
    packed, response_mask = _lengths_example()
    mbs, order = micro_batches(packed, {"response_mask": response_mask}, micro_batch_size=2)
    assert order == [0, 1, 2, 3, 4] and [len(mb["lengths"]) for mb in mbs] == [2, 2, 1]
    assert all("attention_mask" not in mb for mb in mbs)  # one sequence per row: plain causal
    mbs, _ = micro_batches(packed, {"response_mask": response_mask}, micro_batch_size=2, uniform=True)
    assert [mb["input_ids"].shape[0] for mb in mbs] == [2, 2, 2]  # an empty filler row, no sequence in it
    assert len(mbs[-1]["lengths"]) == 1
    mbs, _ = micro_batches(packed, {"response_mask": response_mask}, micro_batch_size=2, max_tokens=12,
                           share_rows=False)
    assert [len(mb["lengths"]) for mb in mbs] == [2, 2, 1]
    try:
        micro_batches(packed, {}, micro_batch_size=2, max_tokens=5)
    except ValueError as exc:
        assert "max_tokens_per_micro_batch=5" in str(exc) and "at least 6" in str(exc)
    else:
        raise AssertionError("a budget below the longest sequence must be refused")


def test_a_fixed_micro_batch_count_spreads_the_same_sequences():
    """count= (expert-parallel replicas agree on how many forwards they run): the sequences are spread over more,
    smaller micro-batches, shared rows unpacked when there are fewer rows than micro-batches; every sequence is
    still found once at its place and the order restores; a count below the natural one or above the sequences
    is refused."""
    packed, response_mask = _lengths_example()
    natural, _ = micro_batches(packed, {"response_mask": response_mask}, micro_batch_size=2, max_tokens=12)
    assert len(natural) == 2
    for count, rows in ((3, [1, 1, 1]), (4, [1, 1, 1, 2]), (5, [1, 1, 1, 1, 1])):
        mbs, order = micro_batches(packed, {"response_mask": response_mask}, micro_batch_size=2, max_tokens=12,
                                   count=count)
        assert len(mbs) == count and [mb["input_ids"].shape[0] for mb in mbs] == rows, count
        assert sorted(order) == [0, 1, 2, 3, 4]
        seqs = iter(order)
        for mb in mbs:
            assert mb["input_ids"].shape[0] * 6 <= 12  # within the token budget
            got = gather_at(mb["input_ids"], mb, torch.arange(6).unsqueeze(0).expand(len(mb["lengths"]), 6))
            for row, n in zip(got, mb["lengths"].tolist()):
                assert row[:n].tolist() == packed.input_ids[next(seqs), :n].tolist()
        results = torch.cat([mb["lengths"] for mb in mbs])
        assert restore_order(results, order).tolist() == packed.lengths.tolist()
    mbs, _ = micro_batches(packed, {"response_mask": response_mask}, micro_batch_size=2, count=5)
    assert [len(mb["lengths"]) for mb in mbs] == [1] * 5
    for bad in (1, 6):
        with pytest.raises(ValueError, match=f"{bad} micro-batches asked for 5 sequences"):
            micro_batches(packed, {}, micro_batch_size=2, max_tokens=12, count=bad)

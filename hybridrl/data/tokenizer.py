"""A deterministic character-level tokenizer for the bundled tasks.

One token per character (a BPE model with no merges, so every character of the alphabet is its own
token and anything else maps to <unk>), a `<s>` prepended by the post-processor like Llama's, and a
decoder that simply concatenates. It is saved as a standard `tokenizer.json` + `tokenizer_config.json`
so `transformers.AutoTokenizer.from_pretrained(dir)` loads it like any Hugging Face tokenizer.
"""
from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)

# 4 special + 26 letters + 10 digits + space + newline + 22 punctuation marks = 64 (a multiple of 8, so
# Megatron's vocab padding for any TP <= 8 leaves the vocabulary unchanged).
CHARACTERS: tuple[str, ...] = tuple(
    string.ascii_lowercase + string.digits + " \n" + ".,:;!?-+=*/()'\"#<>[]_|"
)
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + CHARACTERS
VOCAB_SIZE = len(VOCAB)
assert VOCAB_SIZE == 64 and len(set(VOCAB)) == VOCAB_SIZE

# Minimal chat template: roles as one-letter tags, one message per line, "a:" opens the answer.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'][0] }}:{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}a:{% endif %}"
)

BUNDLED_TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "assets" / "tokenizer"


def build_char_tokenizer():
    """The `tokenizers.Tokenizer` object (not saved)."""
    from tokenizers import Tokenizer, decoders, models, processors

    vocab = {token: index for index, token in enumerate(VOCAB)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    # Special tokens are matched as whole strings before the character split.
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])],
    )
    tokenizer.decoder = decoders.Fuse()
    return tokenizer


def create_char_tokenizer(out_dir: str | Path) -> int:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`.

    Returns the vocabulary size (64). The files are byte-identical on every call.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": UNK_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "unk_token": UNK_TOKEN}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2, sort_keys=True) + "\n")
    return VOCAB_SIZE


def load_tokenizer(path: str | Path | None = None):
    """AutoTokenizer for `path`; None: the bundled character tokenizer."""
    directory = Path(path) if path is not None else BUNDLED_TOKENIZER_DIR
    if not (directory / "tokenizer_config.json").is_file() and not (directory / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"no tokenizer in {str(directory)!r} (expected tokenizer.json / tokenizer_config.json; "
            "create the bundled one with `python -m hybridrl.data.make_task`)"
        )
    # what AutoTokenizer returns for these, without importing every model class (~2 s); transformers 5 saves the
    # fast tokenizer's class as TokenizersBackend (PreTrainedTokenizerFast is its alias)
    if _tokenizer_class(directory) in ("PreTrainedTokenizerFast", "TokenizersBackend"):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(directory))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def _tokenizer_class(directory: Path) -> str | None:
    try:
        return json.loads((directory / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def tokenizer_for(model_path: str | Path, tokenizer: Any = None):
    """A role's tokenizer: `tokenizer` when given (an object, or a folder to load), else the model folder's own,
    else the bundled character tokenizer (the tiny test models ship none)."""
    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        return tokenizer
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    folder = Path(model_path)
    if (folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file():
        return load_tokenizer(folder)
    return load_tokenizer(None)

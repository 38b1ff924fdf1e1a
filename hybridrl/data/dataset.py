"""Prompt datasets from the files users bring: JSON lines or parquet files, or a folder of them.

Each row needs a prompt column (`prompt_key`): a string, or a list of chat messages
({"role", "content"}) rendered with the tokenizer's chat template. Every other column is kept as
per-row metadata and handed to reward functions as keyword arguments (e.g. a reference answer).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from hybridrl.data.tasks import DEFAULT_TASK, task_train_file

logger = logging.getLogger(__name__)

SUPPORTED_SUFFIXES = (".jsonl", ".parquet")
OVERLONG_POLICIES = ("error", "drop")


@dataclass
class PromptRow:
    """One prompt: its token ids (BOS / chat template included), the text rewards see, and metadata."""

    index: int  # position in the dataset (after dropping overlong prompts)
    input_ids: list[int]
    text: str  # the prompt string (for chat messages: the last message's content)
    metadata: dict[str, Any] = field(default_factory=dict)


def resolve_data_files(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    """Expand files and folders (their *.jsonl / *.parquet, sorted) into a file list; refuse the rest."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise ValueError("no prompt files given: set data.train_files to .jsonl / .parquet files or a folder")
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix in SUPPORTED_SUFFIXES and p.is_file())
            if not found:
                raise FileNotFoundError(f"data.train_files: folder {str(path)!r} holds no *.jsonl or *.parquet file")
            files.extend(found)
        elif path.is_file():
            if path.suffix not in SUPPORTED_SUFFIXES:
                raise ValueError(f"data.train_files: {str(path)!r} is neither .jsonl nor .parquet "
                                 "(convert it, e.g. with pandas.DataFrame.to_parquet)")
            files.append(path)
        else:
            raise FileNotFoundError(f"data.train_files: {str(path)!r} does not exist")
    return files


def read_rows(path: Path) -> list[dict[str, Any]]:
    """All rows of one .jsonl or .parquet file as dicts."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    rows = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_number}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{line_number}: each line must be a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


class PromptDataset:
    """Tokenised prompts with their metadata, loaded and checked once up front.

    overlong: what to do with prompts longer than `max_prompt_length` tokens: "error" refuses the
    dataset (naming the longest prompt), "drop" leaves them out and logs how many.
    """

    def __init__(self, files: str | Path | Sequence[str | Path], tokenizer: Any, prompt_key: str = "prompt",
                 max_prompt_length: int | None = None, chat_template: bool = False,
                 overlong: str = "error") -> None:
        if overlong not in OVERLONG_POLICIES:
            raise ValueError(f"data.overlong_prompts={overlong!r}; choose one of {OVERLONG_POLICIES}")
        if max_prompt_length is not None and max_prompt_length <= 0:
            raise ValueError(f"data.max_prompt_length={max_prompt_length} must be > 0")
        self.files = resolve_data_files(files)
        self.prompt_key = prompt_key
        self.max_prompt_length = max_prompt_length
        raw_rows: list[dict[str, Any]] = []
        for path in self.files:
            rows = read_rows(path)
            for position, row in enumerate(rows):
                if prompt_key not in row:
                    raise KeyError(f"{path} row {position} has no column {prompt_key!r} (columns: "
                                   f"{sorted(row)}); set data.prompt_key to the prompt column")
            raw_rows.extend(rows)
        if not raw_rows:
            raise ValueError(f"the prompt files {[str(p) for p in self.files]} hold no rows (data.train_files)")
        texts, rendered, needs_template = [], [], False
        for row in raw_rows:
            text, as_string, templated = self._render(row[prompt_key], tokenizer, chat_template)
            texts.append(text)
            rendered.append(as_string)
            needs_template |= templated
        # A chat template already contains BOS; plain prompts get the tokenizer's own special tokens.
        encoded = tokenizer(rendered, add_special_tokens=not (chat_template or needs_template))["input_ids"]
        self.rows: list[PromptRow] = []
        too_long = []
        for row, text, ids in zip(raw_rows, texts, encoded):
            if max_prompt_length is not None and len(ids) > max_prompt_length:
                too_long.append((len(ids), text))
                continue
            metadata = {key: value for key, value in row.items() if key != prompt_key}
            self.rows.append(PromptRow(len(self.rows), list(ids), text, metadata))
        self.num_dropped = len(too_long)
        if too_long:
            longest, example = max(too_long, key=lambda item: item[0])
            if overlong == "error":
                raise ValueError(f"{len(too_long)} of {len(raw_rows)} prompts are longer than data.max_prompt_length="
                                 f"{max_prompt_length} tokens (longest: {longest} tokens, {example[:60]!r}); raise "
                                 "data.max_prompt_length or drop them with data.overlong_prompts=drop")
            logger.warning("dropped %d of %d prompts longer than %d tokens (longest %d)", len(too_long),
                           len(raw_rows), max_prompt_length, longest)
            if not self.rows:
                raise ValueError(f"every prompt is longer than data.max_prompt_length={max_prompt_length}: "
                                 "nothing left to train on; raise data.max_prompt_length")

    @staticmethod
    def _render(prompt: Any, tokenizer: Any, chat_template: bool) -> tuple[str, str, bool]:
        """(text for rewards, string to tokenise, whether the chat template was applied)."""
        if isinstance(prompt, str) and not chat_template:
            return prompt, prompt, False
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) and "content" in m for m in prompt):
            messages = list(prompt)
        else:
            raise ValueError(f"a prompt must be a string or a list of {{'role', 'content'}} messages, got "
                             f"{type(prompt).__name__}: {str(prompt)[:60]!r}")
        if not messages:
            raise ValueError("a prompt is an empty list of chat messages")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("data.chat_template=true (or chat-message prompts) needs a tokenizer with a chat "
                             "template; set data.chat_template=false or use a chat tokenizer")
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return str(messages[-1]["content"]), rendered, True

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> PromptRow:
        return self.rows[index]

    def max_length(self) -> int:
        return max(len(row.input_ids) for row in self.rows)


def prompt_dataset_from_config(data_cfg: Any, tokenizer: Any, task: str | None = None,
                               overlong: str | None = None) -> PromptDataset:
    """A PromptDataset from the `data` config section; empty `train_files`: the bundled task's prompts."""
    files = list(data_cfg.train_files) or [task_train_file(task or DEFAULT_TASK)]
    return PromptDataset(files, tokenizer, prompt_key=data_cfg.prompt_key,
                         max_prompt_length=data_cfg.max_prompt_length, chat_template=data_cfg.chat_template,
                         overlong=overlong or data_cfg.get("overlong_prompts", "error"))

"""Regenerate the bundled assets: `python -m hybridrl.data.make_task` (deterministic, byte-identical).

Writes hybridrl/assets/tokenizer/ (the 64-token character tokenizer) and
hybridrl/assets/tasks/<name>/train.jsonl for every bundled task.
"""
from __future__ import annotations

import argparse
import logging

from hybridrl.data.tasks import TASK_ROW_MAKERS, TASKS_DIR, write_task_file
from hybridrl.data.tokenizer import BUNDLED_TOKENIZER_DIR, create_char_tokenizer

logger = logging.getLogger(__name__)

NUM_ROWS = 400
SEED = 0


def make_bundled_assets() -> None:
    vocab_size = create_char_tokenizer(BUNDLED_TOKENIZER_DIR)
    logger.info("tokenizer (vocab %d) -> %s", vocab_size, BUNDLED_TOKENIZER_DIR)
    for name in sorted(TASK_ROW_MAKERS):
        out = write_task_file(name, TASKS_DIR / name / "train.jsonl", num_rows=NUM_ROWS, seed=SEED)
        logger.info("task %s (%d prompts) -> %s", name, NUM_ROWS, out)


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    make_bundled_assets()


if __name__ == "__main__":
    main()

"""Prompt data: datasets from user files, the resumable loader, the character tokenizer, bundled tasks."""
from hybridrl.data.dataset import PromptDataset, PromptRow, prompt_dataset_from_config, resolve_data_files
from hybridrl.data.loader import PromptBatch, StatefulPromptLoader, collate_prompts
from hybridrl.data.tasks import DEFAULT_TASK, charset_reward, task_reward_path, task_train_file
from hybridrl.data.tokenizer import BUNDLED_TOKENIZER_DIR, VOCAB_SIZE, create_char_tokenizer, load_tokenizer

__all__ = [
    "BUNDLED_TOKENIZER_DIR", "DEFAULT_TASK", "PromptBatch", "PromptDataset", "PromptRow", "StatefulPromptLoader",
    "VOCAB_SIZE", "charset_reward", "collate_prompts", "create_char_tokenizer", "load_tokenizer",
    "prompt_dataset_from_config", "resolve_data_files", "task_reward_path", "task_train_file",
]

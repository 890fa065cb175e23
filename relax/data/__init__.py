"""Prompt data for Relax: tokenizers and model paths, prompt datasets and sampling, synthetic tasks,
GSM8K preparation.

Layer 2 of 0-9 (docs/design.md): imports Relax packages of lower layers only.
"""

from relax.data.datasets import (
    DataError,
    PromptDataset,
    PromptItem,
    PromptSampler,
    build_datasets,
    load_prompt_file,
    read_records,
    render_prompt,
)
from relax.data.gsm8k import prepare_gsm8k
from relax.data.tasks import generate_task
from relax.data.tokenizer import (
    CHATML_TEMPLATE,
    ModelFileError,
    ModelPathError,
    build_tiny_tokenizer,
    check_model_files,
    ensure_pad_token,
    load_tokenizer,
    resolve_model_path,
)

__all__ = [
    "CHATML_TEMPLATE",
    "DataError",
    "ModelFileError",
    "ModelPathError",
    "PromptDataset",
    "PromptItem",
    "PromptSampler",
    "build_datasets",
    "build_tiny_tokenizer",
    "check_model_files",
    "ensure_pad_token",
    "generate_task",
    "load_prompt_file",
    "load_tokenizer",
    "prepare_gsm8k",
    "read_records",
    "render_prompt",
    "resolve_model_path",
]

"""Reading checkpoint files safely: tensors only (`weights_only`), and a damaged file named in the error.

Light on purpose (torch and safetensors, no model code): relax-train checks a checkpoint's files before it starts
anything, and the trainers, the critic and the exporter read theirs with the same functions.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file


class CheckpointFileError(ValueError):
    """A checkpoint file that is damaged, truncated, or holds more than tensors and plain values; names the file."""


def load_tensor_file(path: str | os.PathLike, *, map_location: Any = None, mmap: bool = False) -> Any:
    """What `torch.save` wrote to `path`, loaded with `weights_only=True`: tensors and plain Python values only, so
    a tampered file cannot run code. CheckpointFileError naming the file when it is refused or damaged."""
    try:
        return torch.load(path, weights_only=True, map_location=map_location, mmap=mmap)
    except pickle.UnpicklingError as e:
        text = str(e)
        operand = re.search(r"Unsupported operand \d+", text)
        if operand:  # not even a pickle torch.save writes
            raise CheckpointFileError(f"checkpoint file {path} is damaged or truncated: not a torch.save file "
                                      f"({operand.group()})") from None
        found = re.search(r"GLOBAL ([\w.]+)", text)
        detail = f"refused global {found.group(1)}" if found else "refused by the weights-only unpickler"
        raise CheckpointFileError(f"checkpoint file {path} holds objects other than tensors and plain values "
                                  f"({detail}); it was not loaded (loading it could run code)") from None
    except Exception as e:  # a truncated or overwritten zip archive, a bad record, ...
        raise CheckpointFileError(f"checkpoint file {path} is damaged or truncated: "
                                  f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None


def load_safetensors_file(path: str | os.PathLike, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file; CheckpointFileError naming the file when it is damaged or truncated."""
    try:
        return load_file(str(path), device=device)
    except Exception as e:  # SafetensorError (header, sizes), OSError
        raise CheckpointFileError(f"checkpoint file {path} is damaged or truncated: {e}") from None


def load_safetensors_dir(directory: str | os.PathLike, exclude: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """All tensors of the *.safetensors files of a directory (sharded or not), except files in `exclude`."""
    files = sorted(p for p in Path(directory).glob("*.safetensors") if p.name not in exclude)
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in checkpoint directory {str(directory)!r}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_safetensors_file(f))
    return state

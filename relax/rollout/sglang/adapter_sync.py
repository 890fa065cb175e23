"""LoRA adapters to SGLang servers (rollout.lora_sync=adapter): each version is a PEFT directory that the servers
load (`/load_lora_adapter`); the previous one is unloaded and its directory removed."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from relax.models.lora import ADAPTER_WEIGHTS, write_adapter_dir
from relax.rollout.sglang.client import post


def adapter_name(version: int) -> str:
    """The name under which the servers hold the adapter of `version` (every request names it: `lora_path`)."""
    return f"relax-v{version}"


class AdapterSync:
    """`WeightSender`'s mode `adapter`: keeps the name of the adapter the servers hold."""

    def __init__(self, target: Any, model_cfg: Any = None):
        if target.adapter_root is None or model_cfg is None:
            raise ValueError("adapter weight sync needs the adapter directory and the model's config")
        self.target, self.model_cfg = target, model_cfg
        self.adapter: str | None = None  # the adapter the servers hold

    def send(self, state: Mapping[str, torch.Tensor], version: int, urls: list[str], *, regroup: bool = False) -> int:
        """The adapters of `version` as a PEFT directory that the servers at `urls` load (SGLang's
        `/load_lora_adapter`), the previous adapter unloaded and its directory removed, the version set. A server
        replacing a dead one gets the current adapter (same version: same name). No buckets: returns 0."""
        t, root = self.target, Path(self.target.adapter_root)
        name = adapter_name(version)
        directory = root / name
        if not (directory / ADAPTER_WEIGHTS).is_file():  # written last: a directory without it is unfinished
            write_adapter_dir(directory, dict(state), self.model_cfg)
        for url in urls:
            post(url, "/load_lora_adapter", {"lora_name": name, "lora_path": str(directory)}, timeout=t.timeout_s,
                 api_key=t.api_key)
            post(url, "/update_weight_version", {"new_version": str(version)}, timeout=t.timeout_s,
                 api_key=t.api_key)
        old, self.adapter = self.adapter, name
        if old is not None and old != name:
            for url in urls:
                post(url, "/unload_lora_adapter", {"lora_name": old}, timeout=t.timeout_s, api_key=t.api_key)
            shutil.rmtree(root / old, ignore_errors=True)
        return 0

    def close(self) -> None:
        pass

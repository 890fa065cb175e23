"""The prompt sets of a run as MLflow dataset inputs (the run's "Datasets used" in the MLflow UI).

One `DatasetRecord` per prompt set: the training set (context `train`) and each eval set (context `eval`). Its
digest is a content hash of the prompts the run actually uses, in order: the rendered prompt texts (after the chat
template and system prompt) and their labels, after prompts too long were dropped and eval sets were cut to
`data.num_eval_prompts`. Two runs with the same digest trained on the same prompts; a changed file, template, system
prompt, seed of a synthetic task or prompt limit changes it. MLflow keeps one dataset per (name, digest) in an
experiment, so runs on the same prompts share it.

Kept free of MLflow imports until a record is converted (`to_mlflow`), like `relax.tracking.params`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

CONTEXT_TAG = "mlflow.data.context"  # MLflow's input tag for a dataset's role in the run (mlflow.utils.mlflow_tags)
CONTEXTS = ("train", "eval")
SOURCE_FILE = "local"  # MLflow's source type of a local file ({"uri": path})
SOURCE_SYNTHETIC = "synthetic"  # a generated task: {"uri": "synthetic:<task>"}
DIGEST_LEN = 16  # hex characters of the SHA-256 (MLflow stores up to 36)
# The schema MLflow's UI shows for a dataset: what each record holds.
_SCHEMA = {"mlflow_colspec": [{"type": "string", "name": "prompt", "required": True},
                              {"type": "string", "name": "label", "required": True}]}


@dataclass(frozen=True)
class DatasetRecord:
    """One prompt set of a run, as it is logged: `name`, `context` (train | eval), where the prompts come from
    (`source_type` local with the file's path as `source`, or synthetic with `synthetic:<task>`), `digest`
    (`prompts_digest`), and its profile: `num_prompts` used, `num_dropped` (longer than rollout.max_prompt_len)."""

    name: str
    context: str
    source_type: str
    source: str
    digest: str
    num_prompts: int
    num_dropped: int = 0

    def __post_init__(self) -> None:
        if self.context not in CONTEXTS:
            raise ValueError(f"dataset context must be one of {CONTEXTS}, got {self.context!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DatasetRecord:
        return cls(**{k: data[k] for k in ("name", "context", "source_type", "source", "digest", "num_prompts",
                                           "num_dropped")})

    def to_mlflow(self) -> Any:
        """The `mlflow.entities.DatasetInput` of this record (for `MlflowClient.log_inputs`)."""
        from mlflow.entities import Dataset, DatasetInput, InputTag

        dataset = Dataset(name=self.name, digest=self.digest, source_type=self.source_type,
                          source=json.dumps({"uri": self.source}), schema=json.dumps(_SCHEMA),
                          profile=json.dumps({"num_prompts": self.num_prompts, "num_dropped": self.num_dropped}))
        return DatasetInput(dataset=dataset, tags=[InputTag(key=CONTEXT_TAG, value=self.context)])


def prompts_digest(prompts: Iterable[tuple[str, str]]) -> str:
    """The first `DIGEST_LEN` hex characters of the SHA-256 of (prompt text, label) pairs, in order."""
    h = hashlib.sha256()
    for text, label in prompts:
        h.update(json.dumps([text, label], ensure_ascii=False).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()[:DIGEST_LEN]

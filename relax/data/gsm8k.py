"""GSM8K preparation: from a local copy of the Hugging Face dataset to prompt/label JSONL.

Input (under `$DATA_DIR` or `data_dir`): `gsm8k/main/{train,test}-*.parquet` as in the HF repository
`openai/gsm8k`, or JSONL files with `question`/`answer` fields (`{split}-*.jsonl`, `{split}.jsonl`).
The directory searched is the first of `<dir>/gsm8k/main`, `<dir>/main`, `<dir>/gsm8k`, `<dir>` that
holds the files. Output: `<cache>/gsm8k/{split}.jsonl` with records
`{"prompt": question + instruction, "label": final answer, "solution": full answer}`; the cache is
`$RLOO_DATA_CACHE_DIR`, else `~/.cache/relax/data`. An existing output file is reused; files are written
to a temporary name and renamed, so a crash never leaves a half-written cache.

CLI: `python -m relax.data.gsm8k [--data-dir DIR] [--cache-dir DIR] [--force]`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

from relax.data.datasets import DataError

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
SPLITS = ("train", "test")
CACHE_VERSION = "v1"  # bump when the output format changes so stale caches are not reused


def default_cache_dir() -> Path:
    """`$RLOO_DATA_CACHE_DIR`, else `~/.cache/relax/data`."""
    env = os.environ.get("RLOO_DATA_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "relax" / "data"


def extract_final_answer(answer: str) -> str:
    """The text after the last `####` of a GSM8K answer, thousands commas and spaces stripped."""
    if "####" not in answer:
        raise ValueError("GSM8K answer has no '####' final answer marker")
    final = answer.rsplit("####", 1)[1].strip()
    return final.replace(",", "").replace(" ", "").rstrip(".")


def normalize_example(question: str, answer: str) -> dict[str, str]:
    """One GSM8K example as a prompt/label record."""
    return {
        "prompt": f"{question.strip()}\n{INSTRUCTION}",
        "label": extract_final_answer(answer),
        "solution": answer,
    }


def _split_files(directory: Path, split: str) -> list[Path]:
    files = sorted(directory.glob(f"{split}-*.parquet")) + sorted(directory.glob(f"{split}.parquet"))
    if files:
        return files
    return sorted(directory.glob(f"{split}-*.jsonl")) + sorted(directory.glob(f"{split}.jsonl"))


def find_source_dir(data_dir: Union[str, Path]) -> Path:
    """The directory under `data_dir` that holds GSM8K split files."""
    root = Path(data_dir).expanduser()
    candidates = [root / "gsm8k" / "main", root / "main", root / "gsm8k", root]
    for c in candidates:
        if c.is_dir() and any(_split_files(c, s) for s in SPLITS):
            return c
    raise DataError(f"no GSM8K files found under {root}: looked for {{train,test}}-*.parquet or "
                    f"{{train,test}}[-*].jsonl in {', '.join(str(c) for c in candidates)}")


def _read_rows(path: Path) -> list[tuple[dict[str, Any], str]]:
    """Rows of one source file with a location string for error messages."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        return [(r, f"{path} row {i}") for i, r in enumerate(rows)]
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append((json.loads(line), f"{path}:{lineno}"))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON: {e.msg}") from e
    return out


def _write_jsonl_atomic(records: list[dict[str, Any]], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def prepare_split(source_dir: Path, split: str, target: Path) -> Path:
    """Normalize one split's source files into `target` (JSONL)."""
    files = _split_files(source_dir, split)
    if not files:
        raise DataError(f"no GSM8K {split} files in {source_dir}")
    records = []
    for path in files:
        for row, where in _read_rows(path):
            if not isinstance(row, dict) or "question" not in row or "answer" not in row:
                raise DataError(f"{where}: expected fields 'question' and 'answer'")
            try:
                records.append(normalize_example(str(row["question"]), str(row["answer"])))
            except ValueError as e:
                raise DataError(f"{where}: {e}") from e
    if not records:
        raise DataError(f"GSM8K {split} files {[str(p) for p in files]} hold no examples")
    _write_jsonl_atomic(records, target)
    return target


def prepare_gsm8k(
    data_dir: Optional[Union[str, Path]] = None,
    cache_dir: Optional[Union[str, Path]] = None,
    force: bool = False,
) -> dict[str, Path]:
    """Prepared JSONL file per split (`train`, `test`), reusing the cache when it already exists.

    `data_dir` defaults to `$DATA_DIR`; `cache_dir` to `$RLOO_DATA_CACHE_DIR` or `~/.cache/relax/data`.
    Splits without source files are left out (at least one must exist).
    """
    cache = (Path(cache_dir).expanduser() if cache_dir else default_cache_dir()) / "gsm8k"
    targets = {s: cache / f"{s}.{CACHE_VERSION}.jsonl" for s in SPLITS}
    if not force and all(t.is_file() for t in targets.values()):
        return targets
    if data_dir is None:
        data_dir = os.environ.get("DATA_DIR")
        if not data_dir:
            raise DataError("GSM8K: $DATA_DIR is not set (and no data_dir given); put the HF dataset at "
                            "$DATA_DIR/gsm8k/main/{train,test}-*.parquet and export DATA_DIR")
    if not Path(data_dir).expanduser().is_dir():
        raise DataError(f"GSM8K: data directory {data_dir} ($DATA_DIR or data_dir) does not exist")
    source = find_source_dir(data_dir)
    out = {}
    for split, target in targets.items():
        if target.is_file() and not force:
            out[split] = target
        elif _split_files(source, split):
            out[split] = prepare_split(source, split, target)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Prepare GSM8K prompt/label JSONL from a local HF copy.")
    parser.add_argument("--data-dir", default=None, help="default: $DATA_DIR")
    parser.add_argument("--cache-dir", default=None, help="default: $RLOO_DATA_CACHE_DIR or ~/.cache/relax/data")
    parser.add_argument("--force", action="store_true", help="rewrite the cache even if it exists")
    args = parser.parse_args(argv)
    try:
        paths = prepare_gsm8k(args.data_dir, args.cache_dir, force=args.force)
    except DataError as e:
        parser.exit(2, f"error: {e}\n")
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

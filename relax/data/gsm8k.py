"""GSM8K preparation: from a local copy of the Hugging Face dataset to prompt/label JSONL.

Input (under `$DATA_DIR` or `data_dir`): `gsm8k/main/{train,test}-*.parquet` as in the HF repository
`openai/gsm8k`, or JSONL files with `question`/`answer` fields (`{split}-*.jsonl`, `{split}.jsonl`).
The directory searched is the first of `<dir>/gsm8k/main`, `<dir>/main`, `<dir>/gsm8k`, `<dir>` that
holds the files. Output: `<cache>/gsm8k/{split}.v1.jsonl` (v1: `CACHE_VERSION`) with records
`{"prompt": question + instruction, "label": final answer, "solution": full answer}`; the cache is
`$RLOO_DATA_CACHE_DIR`, else `~/.cache/relax/data`. The cache is reused while the source files are the same ones
(`source.v1.json` records them), and as it is when there is no source data; files are written to a temporary name
and renamed, so a crash never leaves a half-written cache.

Without the files, every entry point (`relax-train data=gsm8k`, this module's CLI) fails with one message naming
the two files to put in place and the command that downloads them (`missing_data_message`).

CLI: `python -m relax.data.gsm8k [--data-dir DIR] [--cache-dir DIR] [--force]`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Optional, Union

from relax.data.files import DataError, read_parquet

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
SPLITS = ("train", "test")
CACHE_VERSION = "v1"  # bump when the output format changes so stale caches are not reused
HF_REPO = "openai/gsm8k"  # the Hugging Face dataset; its config `main` holds one Parquet file per split
HF_FILES = {split: f"main/{split}-00000-of-00001.parquet" for split in SPLITS}  # paths inside the HF repository
_LFS_POINTER = b"version https://git-lfs"


def missing_data_message(problem: str, data_dir: Optional[Union[str, Path]] = None) -> str:
    """`problem`, then which files to put where (under `data_dir`, else `$DATA_DIR`) and how to download them."""
    if data_dir is None:
        target = "$DATA_DIR/gsm8k"
        export = "\nand point DATA_DIR at the directory that holds gsm8k/: export DATA_DIR=/path/to/data"
    else:
        target = f"{Path(data_dir).expanduser().absolute()}/gsm8k"
        export = ""
    files = "\n".join(f"  {target}/{HF_FILES[split]}" for split in SPLITS)
    return (f"GSM8K data not found: {problem}.\n"
            f"Put the Parquet files of the Hugging Face dataset {HF_REPO} (config main) at\n{files}\n"
            f"for example with: hf download {HF_REPO} --repo-type dataset --include 'main/*' --local-dir {target}\n"
            f"(a huggingface_hub older than 0.34 has no `hf`: huggingface-cli download, same arguments){export}")


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
    raise DataError(missing_data_message(
        f"no {{train,test}}-*.parquet (or {{train,test}}[-*].jsonl) in any of {', '.join(str(c) for c in candidates)}",
        root))


def _read_rows(path: Path) -> list[tuple[dict[str, Any], str]]:
    """Rows of one source file with a location string for error messages."""
    if path.suffix == ".parquet":

        with open(path, "rb") as f:
            head = f.read(len(_LFS_POINTER))
        if head == _LFS_POINTER:
            repo_dir = path.parent.parent if path.parent.name == "main" else path.parent
            raise DataError(f"{path} is a Git LFS pointer, not the Parquet file (the repository was cloned without "
                            f"git-lfs); download the files instead: hf download {HF_REPO} --repo-type dataset "
                            f"--include 'main/*' --local-dir {repo_dir}")
        return read_parquet(path)
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


def source_manifest(source_dir: Path) -> dict[str, Any]:
    """What the cache was prepared from: the source directory and each split file's name, size and mtime."""
    files = [path for split in SPLITS for path in _split_files(source_dir, split)]
    return {"source": str(source_dir.resolve()),
            "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]}


def _read_manifest(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _locate_source(data_dir: Optional[Union[str, Path]]) -> tuple[Optional[Path], Optional[str], str]:
    """(the directory with the split files or None, the data directory used or None, why there is none).
    A data directory without GSM8K files is a DataError (`find_source_dir`)."""
    where = "data_dir"
    if data_dir is None:
        data_dir, where = os.environ.get("DATA_DIR") or None, "$DATA_DIR"
        if data_dir is None:
            return None, None, "$DATA_DIR is not set"
    if not Path(data_dir).expanduser().is_dir():
        return None, str(data_dir), f"the data directory {data_dir} ({where}) does not exist"
    return find_source_dir(data_dir), str(data_dir), ""


def prepare_gsm8k(
    data_dir: Optional[Union[str, Path]] = None,
    cache_dir: Optional[Union[str, Path]] = None,
    force: bool = False,
) -> dict[str, Path]:
    """Prepared JSONL file per split (`train`, `test`), reusing the cache when it holds these source files.

    `data_dir` defaults to `$DATA_DIR`; `cache_dir` to `$RLOO_DATA_CACHE_DIR` or `~/.cache/relax/data`.
    The cache records what it was prepared from (`source_manifest`): other source files (another directory, a file
    replaced) prepare it again; without any source data the prepared copy is used as it is. The train split is
    required; a test split without source files is left out. Missing data is a DataError saying which files to
    put where (`missing_data_message`).
    """
    cache = (Path(cache_dir).expanduser() if cache_dir else default_cache_dir()) / "gsm8k"
    targets = {s: cache / f"{s}.{CACHE_VERSION}.jsonl" for s in SPLITS}
    manifest_path = cache / f"source.{CACHE_VERSION}.json"
    cached = {s: t for s, t in targets.items() if t.is_file()}
    usable = "train" in cached and not force  # a prepared copy to fall back on when there is no source data
    try:
        source, used_dir, why = _locate_source(data_dir)
    except DataError:
        if usable:  # a data directory without GSM8K files: the prepared copy stands
            return cached
        raise
    if source is None:
        if usable:
            return cached
        raise DataError(missing_data_message(f"{why} (and the cache {cache} holds no prepared copy)", used_dir))
    if not _split_files(source, "train"):
        raise DataError(missing_data_message(f"{source} holds no train split (train-*.parquet)", used_dir))
    manifest = source_manifest(source)
    expected = {s: t for s, t in targets.items() if _split_files(source, s)}
    if usable and cached == expected and _read_manifest(manifest_path) == manifest:
        return cached
    manifest_path.unlink(missing_ok=True)  # the cache is being replaced: never paired with the old manifest
    out = {}
    for split, target in targets.items():
        if _split_files(source, split):
            out[split] = prepare_split(source, split, target)
        else:
            target.unlink(missing_ok=True)  # prepared from other source files
    _write_jsonl_atomic([manifest], manifest_path)
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

"""Reading prompt files: JSONL (one JSON object per line) or Parquet, checked record by record; a malformed file is a
`DataError` naming the file and line. A directory is read as a Hugging Face `datasets` directory
(`Dataset.save_to_disk`: its Arrow files, in the order its state.json lists them) or as Parquet shards (its
`*.parquet` files, in name order: a Hub snapshot's split). Values are data, never code. A file in a form not read
(CSV or TSV, a compressed file, a `.json` file holding one JSON array) is a `DataError` naming the form and the
one-line conversion, quoted for a shell (`_conversion`). The label key may be a dotted path into nested fields
(`record_field`)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional, Union


class DataError(ValueError):
    """Malformed or unusable data; the message names the file and line (or the config field)."""


Record = tuple[dict[str, Any], str]  # a raw record and its location for error messages


def record_field(record: dict[str, Any], key: str) -> Any:
    """The value of `key` in a record (None: missing): its top-level field of that name where it has one (a name with
    a dot in it included); else, for a dotted key, the path into nested mappings (a Parquet struct, a JSON object):
    `reward_model.ground_truth` is `record["reward_model"]["ground_truth"]` (verl's parquet keeps its label there).
    The one reader of `data.label_key` (an eval set's `label_key` too)."""
    if key in record or "." not in key:
        return record.get(key)
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def check_prompt(prompt: Any, where: str, key: str) -> Union[str, list[dict[str, str]]]:
    """A record's prompt: a string or a non-empty chat message list (`[{"role", "content"}, ...]`)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)) and prompt:
        messages = []
        for m in prompt:
            if isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), list):
                messages.append({"role": m["role"], "content": _content_parts(m["content"], where, key)})
                continue
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise DataError(f"{where}: {key!r} must be a string or a list of {{'role': str, 'content': str}} "
                                f"messages, got element {m!r}")
            messages.append({"role": m["role"], "content": m["content"]})
        return messages
    raise DataError(f"{where}: {key!r} must be a string or a non-empty chat message list, got {type(prompt).__name__}")


def _content_parts(parts: list, where: str, key: str) -> Union[str, list]:
    """A message's content given as parts (the OpenAI form): text parts alone become their joined text; with image
    parts the list stays, read with the record's images (relax.data.images). Any other part is a DataError."""
    kinds = [p.get("type") if isinstance(p, dict) else None for p in parts]
    for part, kind in zip(parts, kinds, strict=True):
        if kind not in ("text", "image", "image_url") or (kind == "text" and not isinstance(part.get("text"), str)):
            raise DataError(f"{where}: {key!r}: unsupported content part {str(part)[:80]!r} (expected text, image_url "
                            "or image parts)")
    if all(kind == "text" for kind in kinds):
        return "".join(p["text"] for p in parts)
    return parts


def read_records(path: Union[str, Path], prompt_key: str = "prompt", label_key: str = "label",
                 key_fields: tuple[str, str] = ("data.prompt_key", "data.label_key"),
                 label_for: Optional[str] = "the reward") -> list[Record]:
    """Raw records of a JSONL or Parquet file, each checked to have its prompt and, where something reads it, its
    label; locations for messages. `key_fields`: what a missing key's message says sets it (the config fields of the
    prompt key and of the label key). `label_for`: what reads the label (`relax.config.derive.label_reader`), named
    in a missing label's message; None: nothing does, and a record may have none.

    Values are data, never code: JSON is parsed with `json.loads`, Parquet read with pyarrow (no extension type is
    unpickled), and no field is imported, evaluated or unpickled here or later.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        records = read_directory(p)
    elif not p.is_file():
        raise DataError(f"data file {p} does not exist{_relative_to_job_directory(p)}")
    elif p.suffix in (".parquet", ".pq"):
        records = read_parquet(p)
    else:
        _refuse_unread_form(p)
        records = _read_jsonl(p)
    if not records:
        raise DataError(f"data file {p} is empty (no records)")
    for obj, where in records:
        if obj.get(prompt_key) is None:
            raise DataError(f"{where}: missing key {prompt_key!r} ({key_fields[0]}); record has keys {sorted(obj)}")
        if label_for is not None and record_field(obj, label_key) is None:
            raise DataError(f"{where}: missing key {label_key!r} ({key_fields[1]}), the label {label_for} reads; "
                            f"record has keys {sorted(obj)}")
        check_prompt(obj[prompt_key], where, prompt_key)
    return records


def _relative_to_job_directory(p: Path) -> str:
    """For a relative path read in a Hydra job with `hydra.job.chdir=true` (which makes the job's output directory the
    working directory): the words saying so, for a message; else ""."""
    if p.is_absolute():
        return ""
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return ""
    if not HydraConfig.initialized() or not HydraConfig.get().job.chdir:
        return ""
    started = HydraConfig.get().runtime.cwd
    return (f" (a relative path is read from the job's directory {Path.cwd()}, not from {started} where relax-train "
            f"started, because hydra.job.chdir=true: give an absolute path, e.g. {Path(started) / p})")


def _conversion(program: str, target: Path | str, needs: str = "") -> str:
    """`python -c <program>, then data.path=<target>` for a message to paste: the program quoted for a shell (its
    paths written as `_py_str` writes them), the override quoted for Hydra and the shell (relax.config.store, its one
    owner); `needs`: the package it needs beyond pandas or the standard library, named after the command."""
    import shlex

    from relax.config.store import override_text

    target = str(target)
    override = override_text("data.path", target)
    quoted = shlex.quote(override) == override or override.startswith(('"', "'"))  # else: no quoting holds it
    then = (f"then {override}" if quoted else
            f"then point data.path at {target} (a config file's data.path: a path holding both ' and \" is not "
            "quoted for a command line here)")
    return f"python -c {shlex.quote(program)}{f' (it needs the {needs} package)' if needs else ''}, {then}"


def _py_str(s: str) -> str:
    """`s` as a Python string literal in double quotes (JSON's escapes, which are Python's too; a character that is
    not UTF-8 text, a file name's undecodable byte, as its escape), for a program a message prints."""
    text = json.dumps(s, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(s)
    return text


def _directory_conversion(p: Path) -> str:
    """The one-line conversion of a `datasets` directory to one Parquet file, for a message to paste."""
    return "convert it to one file: " + _conversion(
        f'import datasets; datasets.load_from_disk({_py_str(str(p))}).to_parquet("train.parquet")', "train.parquet")


def read_directory(p: Path) -> list[Record]:
    """The rows of a directory: a `datasets` `save_to_disk` directory (state.json and its Arrow files, read with
    pyarrow, rows numbered across the files) or a directory of Parquet shards (rows numbered across the shards). A
    `DatasetDict` directory (dataset_dict.json) names its splits; anything else is a DataError with the one-line
    conversion."""
    state = p / "state.json"
    if (p / "dataset_dict.json").is_file():
        splits = sorted(d.name for d in p.iterdir() if (d / "state.json").is_file())
        example = "train" if "train" in splits or not splits else splits[0]
        raise DataError(f"data file {p} is a datasets DatasetDict directory (splits: {', '.join(splits) or 'none'}): "
                        f"point data.path at one split's directory, e.g. {p / example}")
    if state.is_file():
        try:
            listed = json.loads(state.read_text(encoding="utf-8"))["_data_files"]
            files = [p / entry["filename"] for entry in listed]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"data file {p}: its state.json (a datasets save_to_disk directory) cannot be read "
                            f"({type(e).__name__}: {e}); " + _directory_conversion(p)) from None
        rows = [row for f in files for row in _arrow_rows(f, p)]
        return [(r, f"{p} row {i + 1}") for i, r in enumerate(rows)]
    shards = sorted(f for f in p.iterdir() if f.suffix in (".parquet", ".pq") and f.is_file())
    if shards:
        rows = [row for f in shards for row, _ in read_parquet(f)]
        return [(r, f"{p} row {i + 1}") for i, r in enumerate(rows)]
    raise DataError(f"data file {p} is a directory without Parquet shards (*.parquet) or a datasets save_to_disk "
                    "state.json; point data.path at a JSONL or Parquet file, or " + _directory_conversion(p))


def _arrow_rows(f: Path, directory: Path) -> list[dict[str, Any]]:
    """The rows of one Arrow file of a `save_to_disk` directory (the Arrow IPC stream format it writes)."""
    _check_pyarrow(f)
    import pyarrow
    import pyarrow.ipc

    try:
        with pyarrow.memory_map(str(f)) as source:
            return pyarrow.ipc.open_stream(source).read_all().to_pylist()
    except Exception as e:
        raise DataError(f"{f}: cannot read this Arrow file of the datasets directory {directory}: {e}") from None


def _check_pyarrow(p: Path) -> None:
    import pyarrow

    if _version(pyarrow.__version__) < (14, 0, 1):  # CVE-2023-47248: older pyarrow unpickles extension types
        raise DataError(f"{p}: reading Parquet or Arrow needs pyarrow>=14.0.1 (older versions can run code from "
                        f"such a file), found {pyarrow.__version__}")


def read_parquet(p: Path) -> list[Record]:
    """The rows of a Parquet file (pyarrow>=14.0.1: older versions unpickle extension types)."""
    import pyarrow.parquet as pq

    _check_pyarrow(p)
    try:
        rows = pq.read_table(p).to_pylist()
    except Exception as e:
        raise DataError(f"{p}: cannot read Parquet: {e}") from None
    return [(r, f"{p} row {i + 1}") for i, r in enumerate(rows)]


# a compressed file's name ends so, or its first bytes are so: the compression's name
_COMPRESSED = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd"}
_PANDAS = {"gzip": "gzip", "bzip2": "bz2", "xz": "xz", "zstd": "zstd"}  # pandas' names of them
_MAGIC = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"))
_MODULES = {"gzip": "gzip", "bzip2": "bz2", "xz": "lzma", "zstd": "zstandard"}  # the module that opens each


def _refuse_unread_form(p: Path) -> None:
    """A DataError for a file in a form that is not read (JSONL and Parquet are), naming the form and the one-line
    conversion to a form that is (`_conversion`): CSV or TSV (by its name; pandas to Parquet, every value as its
    text), a compressed file (by its name or its first bytes), a `.json` file holding one JSON array (its first
    character other than white space is `[`). JSON text is converted with the standard library's json, value for value
    (pandas would give every row every column and turn a number of a column some row lacks into a float)."""
    try:
        with open(p, "rb") as f:
            head = f.read(4096)
    except OSError as e:
        raise DataError(f"data file {p} cannot be read: {e.strerror or e}") from None
    suffix = p.suffix.lower()
    compression = _COMPRESSED.get(suffix) or next((name for magic, name in _MAGIC if head.startswith(magic)), None)
    inner = p.with_suffix("").suffix.lower() if suffix in _COMPRESSED else suffix
    base = p.name
    while Path(base).suffix.lower() in (*_COMPRESSED, ".jsonl", ".json", ".csv", ".tsv", ".txt"):
        base = Path(base).stem
    target = p.with_name(base + (".parquet" if inner in (".csv", ".tsv") else ".jsonl"))
    if target.exists():  # never one to overwrite (x.jsonl holding gzip; x.jsonl beside x.json)
        target = target.with_name(base + ".converted" + target.suffix)
    source, written = _py_str(str(p)), _py_str(str(target))
    if inner in (".csv", ".tsv"):
        sep = ', sep="\\t"' if inner == ".tsv" else ""
        # pandas infers a compression from the name's ending; a file whose name does not say gets it named
        named = f", compression={json.dumps(_PANDAS[compression])}" if compression and suffix not in _COMPRESSED else ""
        program = f"import pandas as pd; pd.read_csv({source}{sep}{named}, dtype=str).to_parquet({written})"
        form = inner[1:].upper() + (f" ({compression}-compressed)" if compression else "")
    elif compression is not None or (suffix == ".json" and head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")):
        array = compression is None or (inner == ".json" and _compressed_array(p, compression))
        module = _MODULES[compression] if compression else ""
        opened = f"{module}.open({source}, \"rt\"" if module else f"open({source}"
        # the text, a JSON array's objects one a line (a JSONL file's text as it is)
        program = (f"import json{', ' + module if module else ''}; t = {opened}, encoding=\"utf-8-sig\").read(); "
                   f"open({written}, \"x\", encoding=\"utf-8\").write(\"\".join(json.dumps(r, ensure_ascii=False) "
                   f"+ \"\\n\" for r in json.loads(t)) if t.lstrip().startswith(\"[\") else t)")
        form = " ".join(w for w in (f"{compression}-compressed" if compression else "",
                                    "one JSON array" if array else "JSONL") if w)
    else:
        return
    raise DataError(f"data file {p} is {form}, which is not read: data files are JSONL (one JSON object per line, "
                    f"uncompressed) or Parquet; convert it: "
                    + _conversion(program, target, "zstandard" if compression == "zstd" else ""))


def _compressed_array(p: Path, compression: str) -> bool:
    """Whether a compressed `.json` file holds one JSON array (its first text other than white space is `[`);
    False where the compression cannot be read here (zstd without the zstandard package)."""
    import importlib

    try:
        opener = importlib.import_module(_MODULES[compression]).open
    except ImportError:
        return False
    try:
        with opener(p, "rb") as f:
            return f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")
    except Exception:  # noqa: BLE001 - a damaged file: each module raises its own error types
        return False


def _read_jsonl(p: Path) -> list[Record]:
    records: list[Record] = []
    try:
        with open(p, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                where = f"{p}:{lineno}"
                try:
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    hint = " (it looks like Parquet: name it *.parquet)" if raw.startswith(b"PAR1") else ""
                    raise DataError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                    f"data files are UTF-8 JSONL or Parquet{hint}") from None
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
                except RecursionError:
                    raise DataError(f"{where}: invalid JSON (nested too deeply)") from None
                if not isinstance(obj, dict):
                    raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
                records.append((obj, where))
    except OSError as e:
        raise DataError(f"data file {p} cannot be read: {e.strerror or e}") from None
    return records


def _version(text: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string such as "14.0.1" or "15.0.0.dev12"."""
    return tuple(int(m.group()) if (m := re.match(r"\d+", part)) else 0 for part in text.split(".")[:3])

"""data.path at a directory: a Hugging Face `datasets` save_to_disk directory, or a directory of Parquet shards, is
read as the file it was made from would be; a DatasetDict directory names its splits; any other directory is a
DataError with the one-line conversion."""

from __future__ import annotations

import json
import shlex

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relax.data.datasets import load_prompt_file
from relax.data.files import DataError, read_records
from relax.data.tokenizer import build_tiny_tokenizer

ROWS = [{"question": f"repeat {d}", "answer": str(d), "difficulty": d % 3} for d in range(7)]


def same_as_jsonl(tmp_path, path):
    """The prompts of `path` and of the JSONL file of ROWS: the same texts, labels, token ids and fields."""
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    data = type("D", (), {"prompt_key": "question", "label_key": "answer"})()
    tok = build_tiny_tokenizer()
    ours, theirs = load_prompt_file(path, tok, data), load_prompt_file(jsonl, tok, data)
    assert [(i.prompt_text, i.label, i.prompt_ids, i.fields) for i in ours] == \
        [(i.prompt_text, i.label, i.prompt_ids, i.fields) for i in theirs]
    return ours


def test_a_datasets_save_to_disk_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    # two shards: the rows come back in order across them
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "hf"), num_shards=2)
    ours = same_as_jsonl(tmp_path, tmp_path / "hf")
    assert ours[6].source == f"{tmp_path / 'hf'} row 7"


def test_a_directory_of_parquet_shards(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    pq.write_table(pa.Table.from_pylist(ROWS[:4]), shards / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[4:]), shards / "train-00001-of-00002.parquet")
    same_as_jsonl(tmp_path, shards)


def test_a_dataset_dict_names_its_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    d = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({"train": d, "test": d}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"a datasets DatasetDict directory \(splits: test, train\): point data.path "
                                        r"at one split's directory"):
        read_records(tmp_path / "dd", "question", "answer")


def test_another_directory_says_how_to_convert_it(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"directory without Parquet shards .* datasets.load_from_disk\(\".*empty\"\)"
                                        r".to_parquet\(\"train.parquet\"\)") as exc:
        read_records(tmp_path / "empty", "question", "answer")
    # the command as printed is one shell word after -c, whatever the path holds (tests/data/test_data_file_forms.py
    # runs the file forms' commands through bash)
    program = shlex.split(str(exc.value).split("python -c ", 1)[1].split(", then ", 1)[0])[0]
    assert f"datasets.load_from_disk({json.dumps(str(tmp_path / 'empty'))})" in program

"""GSM8K preparation on the made-up fixture in tests/fixtures/gsm8k."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relax.data.datasets import DataError, load_prompt_file
from relax.data.gsm8k import INSTRUCTION, extract_final_answer, main, prepare_gsm8k
from relax.data.tokenizer import build_tiny_tokenizer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures"


def read(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_extract_final_answer():
    assert extract_final_answer("so 3+4=7\n#### 7") == "7"
    assert extract_final_answer("... #### 1,200") == "1200"
    with pytest.raises(ValueError):
        extract_final_answer("no marker")


def test_prepare_from_jsonl_fixture_and_reuse(tmp_path, monkeypatch):
    monkeypatch.setenv("DATA_DIR", str(FIXTURE))
    monkeypatch.setenv("RLOO_DATA_CACHE_DIR", str(tmp_path / "cache"))
    paths = prepare_gsm8k()
    assert set(paths) == {"train", "test"}
    assert all(Path(p).parent == tmp_path / "cache" / "gsm8k" for p in paths.values())
    train = read(paths["train"])
    assert len(train) == 5 and len(read(paths["test"])) == 3
    assert train[0]["label"] == "19" and train[1]["label"] == "1200"
    assert train[0]["prompt"].startswith("Mia has 4 boxes") and train[0]["prompt"].endswith(INSTRUCTION)
    assert "\\boxed{}" in INSTRUCTION and "#### 19" in train[0]["solution"]
    assert not list((tmp_path / "cache" / "gsm8k").glob("*.tmp"))

    # Second call reuses the cache, even without the source data.
    mtime = paths["train"].stat().st_mtime_ns
    monkeypatch.delenv("DATA_DIR")
    again = prepare_gsm8k()
    assert again == paths and again["train"].stat().st_mtime_ns == mtime

    ds = load_prompt_file(paths["train"], build_tiny_tokenizer())
    assert [x.label for x in ds] == [r["label"] for r in train]


def test_prepare_from_parquet(tmp_path):
    src = tmp_path / "data" / "gsm8k" / "main"
    src.mkdir(parents=True)
    for split in ("train", "test"):
        rows = read(FIXTURE / "gsm8k" / "main" / f"{split}-00000-of-00001.jsonl")
        pq.write_table(pa.Table.from_pylist(rows), src / f"{split}-00000-of-00001.parquet")
    paths = prepare_gsm8k(data_dir=tmp_path / "data", cache_dir=tmp_path / "cache")
    assert [r["label"] for r in read(paths["test"])] == ["7", "39", "165"]


def test_missing_data_dir_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("DATA_DIR", raising=False)
    with pytest.raises(DataError, match="DATA_DIR"):
        prepare_gsm8k(cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match="does not exist"):
        prepare_gsm8k(data_dir=tmp_path / "nope", cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match="no GSM8K files"):
        prepare_gsm8k(data_dir=tmp_path, cache_dir=tmp_path / "cache")


def test_malformed_source_names_line(tmp_path):
    src = tmp_path / "gsm8k" / "main"
    src.mkdir(parents=True)
    (src / "train.jsonl").write_text('{"question": "q", "answer": "a\\n#### 1"}\n{"question": "q"}\n')
    with pytest.raises(DataError, match=r"train\.jsonl:2"):
        prepare_gsm8k(data_dir=tmp_path, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache" / "gsm8k").exists() or not list((tmp_path / "cache" / "gsm8k").iterdir())


def test_cli(tmp_path, capsys):
    shutil.copytree(FIXTURE / "gsm8k", tmp_path / "gsm8k")
    assert main(["--data-dir", str(tmp_path), "--cache-dir", str(tmp_path / "c")]) == 0
    assert "train:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--data-dir", str(tmp_path / "nope"), "--cache-dir", str(tmp_path / "c2")])

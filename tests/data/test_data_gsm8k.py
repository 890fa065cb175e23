"""GSM8K preparation on the made-up fixture in tests/fixtures/gsm8k (JSONL, and Parquet in the HF layout)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relax.data.datasets import DataError, load_prompt_file
from relax.data.gsm8k import CACHE_VERSION, INSTRUCTION, extract_final_answer, main, prepare_gsm8k
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


def hf_parquet_module():
    """tests/fixtures/gsm8k/hf_parquet.py: the fixture in the file format of the HF dataset openai/gsm8k."""
    spec = importlib.util.spec_from_file_location("gsm8k_hf_parquet", FIXTURE / "gsm8k" / "hf_parquet.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prepare_from_parquet_in_the_hf_layout(tmp_path):
    written = hf_parquet_module().write_hf_parquet(tmp_path / "data")
    main_dir = tmp_path / "data" / "gsm8k" / "main"
    assert written == {s: main_dir / f"{s}-00000-of-00001.parquet" for s in ("train", "test")}
    table = pq.read_table(written["train"])  # the schema of the HF files: two string columns, the features metadata
    assert table.schema.names == ["question", "answer"] and set(table.schema.types) == {pa.string()}
    assert json.loads(table.schema.metadata[b"huggingface"])["info"]["features"]["answer"]["dtype"] == "string"
    paths = prepare_gsm8k(data_dir=tmp_path / "data", cache_dir=tmp_path / "cache")
    assert [r["label"] for r in read(paths["test"])] == ["7", "39", "165"]
    # the same records as from the JSONL rows they were written from
    from_jsonl = prepare_gsm8k(data_dir=FIXTURE, cache_dir=tmp_path / "cache-jsonl")
    for split in ("train", "test"):
        assert read(paths[split]) == read(from_jsonl[split])


def test_the_cache_follows_its_source_files(tmp_path, monkeypatch):
    monkeypatch.setenv("RLOO_DATA_CACHE_DIR", str(tmp_path / "cache"))
    first = prepare_gsm8k(data_dir=FIXTURE)  # the JSONL fixture: 5 train problems
    assert len(read(first["train"])) == 5
    other = tmp_path / "other" / "gsm8k" / "main"  # other data (one problem), e.g. the real files after the fixture
    other.mkdir(parents=True)
    pq.write_table(pa.table({"question": ["Ann has 2 cats and 3 dogs. How many pets?"],
                             "answer": ["2 + 3 = <<2+3=5>>5\n#### 5"]}), other / "train-00000-of-00001.parquet")
    second = prepare_gsm8k(data_dir=tmp_path / "other")
    assert [r["label"] for r in read(second["train"])] == ["5"]
    assert "test" not in second and not (tmp_path / "cache" / "gsm8k" / f"test.{CACHE_VERSION}.jsonl").exists()
    mtime = second["train"].stat().st_mtime_ns
    assert prepare_gsm8k(data_dir=tmp_path / "other")["train"].stat().st_mtime_ns == mtime  # same files: reused
    third = prepare_gsm8k(data_dir=FIXTURE)  # back to the fixture: its 5 problems and its test split again
    assert len(read(third["train"])) == 5 and len(read(third["test"])) == 3
    mtime = third["train"].stat().st_mtime_ns
    monkeypatch.delenv("DATA_DIR", raising=False)  # no source data at all: the complete cache as it is
    assert prepare_gsm8k() == third and third["train"].stat().st_mtime_ns == mtime
    assert prepare_gsm8k(force=False, data_dir=tmp_path) == third  # a directory without GSM8K files: the same


def test_missing_data_says_which_files_to_put_where(tmp_path, monkeypatch):
    monkeypatch.delenv("DATA_DIR", raising=False)
    with pytest.raises(DataError) as e:
        prepare_gsm8k(cache_dir=tmp_path / "cache")
    text = str(e.value)
    assert text.startswith("GSM8K data not found: $DATA_DIR is not set")
    assert "  $DATA_DIR/gsm8k/main/train-00000-of-00001.parquet\n  $DATA_DIR/gsm8k/main/test-00000-of-00001.parquet" \
        in text
    assert "hf download openai/gsm8k --repo-type dataset --include 'main/*' --local-dir $DATA_DIR/gsm8k" in text
    assert "export DATA_DIR=" in text

    with pytest.raises(DataError, match=r"the data directory .*nope \(data_dir\) does not exist") as e:
        prepare_gsm8k(data_dir=tmp_path / "nope", cache_dir=tmp_path / "cache")
    assert f"  {tmp_path}/nope/gsm8k/main/train-00000-of-00001.parquet" in str(e.value)

    monkeypatch.setenv("DATA_DIR", str(tmp_path))  # exists, holds no GSM8K files
    with pytest.raises(DataError, match=r"no \{train,test\}-\*\.parquet") as e:
        prepare_gsm8k(cache_dir=tmp_path / "cache")
    assert f"--local-dir {tmp_path}/gsm8k" in str(e.value)

    src = tmp_path / "gsm8k" / "main"  # a test split alone: training needs the train split
    src.mkdir(parents=True)
    shutil.copy(FIXTURE / "gsm8k" / "main" / "test-00000-of-00001.jsonl", src)
    with pytest.raises(DataError, match=r"holds no train split") as e:
        prepare_gsm8k(cache_dir=tmp_path / "cache")
    assert f"  {tmp_path}/gsm8k/main/train-00000-of-00001.parquet" in str(e.value)
    assert not (tmp_path / "cache" / "gsm8k").exists() or not list((tmp_path / "cache" / "gsm8k").iterdir())


def test_unreadable_parquet_names_the_file(tmp_path):
    src = tmp_path / "gsm8k" / "main"
    src.mkdir(parents=True)
    pointer = src / "train-00000-of-00001.parquet"  # what a git clone without git-lfs leaves
    pointer.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 2306545\n")
    with pytest.raises(DataError, match=r"train-00000-of-00001\.parquet is a Git LFS pointer") as e:
        prepare_gsm8k(data_dir=tmp_path, cache_dir=tmp_path / "cache")
    assert f"--local-dir {tmp_path}/gsm8k" in str(e.value)
    pointer.write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"train-00000-of-00001\.parquet: cannot read Parquet"):
        prepare_gsm8k(data_dir=tmp_path, cache_dir=tmp_path / "cache")
    pq.write_table(pa.table({"question": ["q"], "text": ["#### 1"]}), pointer)  # another dataset's columns
    with pytest.raises(DataError, match=r"train-00000-of-00001\.parquet row 1: expected fields 'question' and"):
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
    with pytest.raises(SystemExit) as e:
        main(["--data-dir", str(tmp_path / "nope"), "--cache-dir", str(tmp_path / "c2")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: GSM8K data not found") and f"{tmp_path}/nope/gsm8k/main/train-00000-of-00001" in err

"""What a verl / TRL user's data files get (docs/training.md, "Data and rewards"): an empty prompt without the chat
template is refused at start naming its file and line (it used to pass every check and crash the rollout); a dotted
`data.label_key` reads a nested field (verl's `reward_model.ground_truth`), a top-level key of that exact name winning;
a CSV/TSV, compressed or JSON-array file is refused naming its form with a pandas conversion that, run as printed,
writes a file that reads as the original rows; a `DatasetDict` directory's refusal names its `train` split."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relax.config.schema import DataConfig, RelaxConfig, RolloutConfig
from relax.data.datasets import DataError, build_datasets, load_prompt_file
from relax.data.files import read_records
from relax.data.tokenizer import build_tiny_tokenizer

ROWS = [{"prompt": f"repeat {i}", "label": str(i)} for i in range(4)]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- an empty prompt without the chat template


@pytest.mark.parametrize("empty, what", [
    ("", "is empty"),
    ("  \n", "is only white space"),
    ([{"role": "user", "content": ""}], "has messages whose contents are empty"),
    ([{"role": "system", "content": ""}, {"role": "user", "content": ""}], "has messages whose contents are empty"),
])
def test_an_empty_prompt_without_the_template_is_refused_naming_its_line(tmp_path, tok, empty, what):
    rows = [*ROWS[:2], {"prompt": empty, "label": "0"}, ROWS[3]]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(DataError, match=rf"p\.jsonl:3: the prompt 'prompt' {what}, and without a chat template"):
        load_prompt_file(path, tok, DataConfig(apply_chat_template=False))
    # control: the same file with that prompt given text reads, every prompt with its own tokens
    rows[2] = {"prompt": "repeat 2" if isinstance(empty, str) else [{"role": "user", "content": "repeat 2"}],
               "label": "2"}
    ds = load_prompt_file(write_jsonl(tmp_path / "p.jsonl", rows), tok, DataConfig(apply_chat_template=False))
    assert [tok.decode(x.prompt_ids) for x in ds] == [f"repeat {i}" for i in range(4)]


def test_the_empty_prompts_own_template_render_still_reads(tmp_path, tok):
    """With the chat template, an empty user message renders as the template's role markers: text to answer after,
    read as before."""
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": [{"role": "user", "content": ""}], "label": "0"}])
    ds = load_prompt_file(path, tok, DataConfig())
    assert ds[0].prompt_text == "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"


# --- a dotted data.label_key


def verl_rows():
    """Rows laid out as verl's examples/data_preprocess scripts write them."""
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"repeat {i}"}], "ability": "math",
             "reward_model": {"ground_truth": str(i + 10), "style": "rule"},
             "extra_info": {"split": "train", "index": i}} for i in range(3)]


def test_a_dotted_label_key_reads_verls_struct_column(tmp_path, tok):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows()), path)
    assert pa.types.is_struct(pq.read_schema(path).field("reward_model").type)
    ds = load_prompt_file(path, tok, DataConfig(label_key="reward_model.ground_truth"))
    assert [x.label for x in ds] == [r["reward_model"]["ground_truth"] for r in verl_rows()] == ["10", "11", "12"]
    assert ds[1].fields["extra_info"] == {"split": "train", "index": 1}
    assert ds[1].fields["data_source"] == "openai/gsm8k"
    # the eval set reads it the same way (data.eval_path: the same data.label_key)
    c = RelaxConfig(data=DataConfig(path=str(path), eval_path=str(path), num_eval_prompts=2,
                                    label_key="reward_model.ground_truth"), rollout=RolloutConfig(max_prompt_len=64))
    train, evals = build_datasets(c, tok)
    assert [x.label for x in train] == ["10", "11", "12"] and [x.label for x in evals] == ["10", "11"]


def test_a_dotted_label_key_in_jsonl_and_a_top_level_key_of_that_name_wins(tmp_path, tok):
    nested = {"prompt": "repeat 1", "meta": {"answer": {"value": 7}}}
    dotted = {"prompt": "repeat 2", "meta.answer.value": "top", "meta": {"answer": {"value": 8}}}
    ds = load_prompt_file(write_jsonl(tmp_path / "p.jsonl", [nested, dotted]), tok,
                          DataConfig(label_key="meta.answer.value"))
    assert [x.label for x in ds] == ["7", "top"]


@pytest.mark.parametrize("key", ["reward_model.ground_truh", "reward_model.style.x", "ground_truth"])
def test_a_missing_label_path_is_refused_naming_the_key_and_the_records_keys(tmp_path, tok, key):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows()), path)
    with pytest.raises(DataError, match=rf"train\.parquet row 1: missing key '{re.escape(key)}' \(data.label_key\), "
                                        r".*record has keys \['ability', 'data_source', 'extra_info', 'prompt', "
                                        r"'reward_model'\]"):
        load_prompt_file(path, tok, DataConfig(label_key=key))


# --- forms that are not read: refused with a conversion that works as printed


def run_conversion(message, cwd):
    """Runs the `python -c "..."` the message prints (with this interpreter) and returns the `data.path` it names."""
    found = re.search(r'convert it: python (-c ".*"), then data\.path=(\S+)$', message)
    assert found, message
    subprocess.run(f"{sys.executable} {found.group(1)}", shell=True, cwd=cwd, check=True, timeout=120)
    return found.group(2)


def csv_text(sep):
    return "prompt" + sep + "label\n" + "".join(f"{r['prompt']}{sep}{r['label']}\n" for r in ROWS)


def jsonl_bytes():
    return "".join(json.dumps(r) + "\n" for r in ROWS).encode()


@pytest.mark.parametrize("name, content, form", [
    ("p.csv", csv_text(",").encode(), "CSV"),
    ("p.tsv", csv_text("\t").encode(), "TSV"),
    ("p.json", json.dumps(ROWS, indent=1).encode(), "one JSON array"),
    ("p.jsonl.gz", gzip.compress(jsonl_bytes()), "gzip-compressed JSONL"),
    ("p.jsonl", gzip.compress(jsonl_bytes()), "gzip-compressed JSONL"),  # by its first bytes
    ("p.json.xz", lzma.compress(json.dumps(ROWS).encode()), "xz-compressed one JSON array"),
    ("p.csv.bz2", bz2.compress(csv_text(",").encode()), r"CSV \(bzip2-compressed\)"),
], ids=["csv", "tsv", "json-array", "jsonl.gz", "gzip-named-jsonl", "json.xz", "csv.bz2"])
def test_a_form_that_is_not_read_is_refused_with_a_conversion_that_works(tmp_path, name, content, form):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError, match=rf"data file .*{re.escape(name)} is {form}, which is not read: data files "
                                        r"are JSONL .* or Parquet; convert it: python -c") as e:
        read_records(path)
    converted = run_conversion(str(e.value), tmp_path)
    assert converted != str(path)
    assert [r for r, _ in read_records(converted)] == ROWS  # the rows, labels as the text they were


def test_a_conversion_never_overwrites_a_file_beside_it(tmp_path):
    (tmp_path / "p.jsonl").write_text("mine\n")
    (tmp_path / "p.json").write_text(json.dumps(ROWS))
    with pytest.raises(DataError) as e:
        read_records(tmp_path / "p.json")
    assert run_conversion(str(e.value), tmp_path).endswith("p.converted.jsonl")
    assert (tmp_path / "p.jsonl").read_text() == "mine\n"


def test_a_json_file_of_json_lines_is_read(tmp_path):
    """Control: a `.json` file that is JSONL (its first character `{`) reads as before."""
    (tmp_path / "p.json").write_bytes(jsonl_bytes())
    assert [r for r, _ in read_records(tmp_path / "p.json")] == ROWS


# --- a DatasetDict directory


@pytest.mark.parametrize("splits, example", [(("test", "train", "validation"), "train"), (("test", "validation"),
                                                                                         "test")])
def test_a_dataset_dicts_refusal_names_its_train_split(tmp_path, splits, example):
    datasets = pytest.importorskip("datasets")
    d = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({s: d for s in splits}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=rf"\(splits: {', '.join(splits)}\): point data.path at one split's "
                                        rf"directory, e.g. \S*dd/{example}$"):
        read_records(tmp_path / "dd")
    assert len(read_records(tmp_path / "dd" / example)) == len(ROWS)  # the split named reads

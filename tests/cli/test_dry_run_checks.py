"""`dry_run=true` runs every check a start runs before Ray (`relax.runner.preflight.CHECKS`): for each check, a
config that breaks it is reported by the dry run AND refused by the real start (`relax.runner.train.run`, with Ray
made to fail if it were reached) with the same message; a config that passes every check starts nothing in the dry
run and gets past every check in the real start (the negative control). A new check without a case here fails
`test_every_pre_ray_check_has_a_case`."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest
from relax_train_inprocess import relax_train

from relax.config import load_config
from relax.runner.errors import RunError
from relax.runner.preflight import CHECKS, INPUT_CHECKS, preflight

# a chat template that cannot render a tool message (the family of templates that raise on roles they do not know)
RAISES_ON_TOOL = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Only user, system and assistant roles are supported!') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _broken_template(tmp: Path, _: object) -> list[str]:
    from relax.data.tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    tok.chat_template = RAISES_ON_TOOL
    tok.save_pretrained(tmp / "tok")
    # the prompts list the calculator's schema (data.tools), about 300 tiny-tokenizer tokens: room for them
    return ["data.tools=[calculator]", "rollout.max_turns=2", f"model.tokenizer={tmp / 'tok'}",
            "rollout.max_prompt_len=400", "model.max_position_embeddings=1024"]


def _locked_save_dir(tmp: Path, _: object) -> list[str]:
    """A save directory another relax-train holds (its flock on .lock, taken here as that run would)."""
    save = tmp / "ckpt"
    save.mkdir()
    fd = os.open(save / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    _HELD.append(fd)
    return [f"train.save_dir={save}"]


_HELD: list[int] = []


# check name -> (overrides of a config that breaks it, given this test's tmp dir and its `closed_port` (a port where
# nothing listens, held for the test: a Ray cluster there cannot be joined); a text its problem contains)
CASES = {
    "model": (lambda tmp, _: ["model=qwen3_0.6b"], "$MODEL_DIR is not set"),  # a new user's first try
    "tokenizer": (lambda tmp, _: [f"model.tokenizer={tmp / 'missing'}"], "model.tokenizer="),
    "teacher": (lambda tmp, _: ["algorithm=opd", f"teacher.path={tmp / 'no-teacher'}"], "the teacher (teacher.path="),
    "data": (lambda tmp, _: ["data=jsonl", f"data.path={tmp / 'missing.jsonl'}"], "missing.jsonl"),
    "reward": (lambda tmp, _: ["data.reward=no_such_module:fn"], "no_such_module"),
    # an environment alone reads no tool call (tests/runner/test_unread_tool_parser.py: what reads it)
    "tool_parser": (lambda tmp, _: ["data=guess_number", "data.tool_parser=hermes"],
                    "data.tool_parser=hermes has no effect: data.env=guess_number without data.tools"),
    "agent": (_broken_template, "cannot render the observations"),
    "openai_agent": (lambda tmp, _: ["data.openai_agent=no_such_module:run", "rollout=sglang",
                                     "rollout.sglang.server=embedded"], "no_such_module"),
    "lora": (lambda tmp, _: ["model.lora_rank=4", "model.lora_target_modules=[q_proj,no_such_proj]"],
             "['no_such_proj'] are not linear layers of tiny"),
    "reward_model": (lambda tmp, _: ["reward_model=classifier", f"reward_model.path={tmp / 'no-rm'}"],
                     "reward_model.path="),
    "tracking": (lambda tmp, _: ["tracking.uri=sqlite:////proc/nope/mlflow.db"], "nothing can be created in /proc"),
    "endpoints": (lambda tmp, port: [f"cluster.address=127.0.0.1:{port()}"], "cluster.address=127.0.0.1:"),
    "gpus": (lambda tmp, _: ["cluster=1xgpu"], "torch sees 0 CUDA device(s)"),
    "checkpoints": (_locked_save_dir, "is in use by another running relax-train"),
}
RESUME_NOWHERE = "no checkpoint there"  # the resume point, the checkpoints check's other half


@pytest.fixture(autouse=True)
def _no_model_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("MODEL_DIR", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(tmp_path)  # the default save directory lands here
    yield
    while _HELD:
        os.close(_HELD.pop())


@pytest.fixture
def ray_never_starts(monkeypatch):
    """The real start, made to fail loudly if it got as far as starting Ray."""
    from relax.runner.cluster import RayRuntime

    def refuse(self):
        raise AssertionError("Ray started: a pre-Ray check did not stop the run")

    monkeypatch.setattr(RayRuntime, "__enter__", refuse)


def real_start(cfg, tmp_path: Path) -> str:
    """The message the real start (`relax.runner.train.run`) stops with before Ray."""
    from relax.runner.train import run

    with pytest.raises(RunError) as info:
        run(cfg, output_dir=tmp_path / "out")
    return str(info.value)


def test_every_pre_ray_check_has_a_case():
    assert set(CASES) == {c.name for c in CHECKS}
    assert set(INPUT_CHECKS) < set(CASES)  # `prepare` (tools, tests) runs a subset of them


@pytest.mark.parametrize("name", list(CASES))
def test_dry_run_reports_what_the_real_start_refuses(name, tmp_path, ray_never_starts, closed_port):
    if name == "gpus":
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU: cluster=1xgpu fits")
    overrides, needle = CASES[name]
    cfg = load_config(overrides(tmp_path, closed_port))
    dry = preflight(cfg)  # what dry_run=true runs: it changes nothing
    assert dry.status[name] == "failed", dry.render()
    assert needle in dry.problems[name]
    assert [n for n, s in dry.status.items() if s == "failed"] == [name], dry.render()  # only the broken one
    assert needle in dry.render()
    message = real_start(cfg, tmp_path)
    assert needle in message and message == dry.problems[name]


def test_a_resume_point_that_is_not_there_is_refused_by_both(tmp_path, ray_never_starts):
    cfg = load_config([f"train.resume={tmp_path}"])
    dry = preflight(cfg)
    assert dry.status["checkpoints"] == "failed" and RESUME_NOWHERE in dry.problems["checkpoints"]
    assert RESUME_NOWHERE in real_start(cfg, tmp_path)


def test_the_dry_run_changes_nothing_and_reports_every_problem_at_once(tmp_path, ray_never_starts):
    """Two independent problems: both in the dry run's report and in the start's one message; the save directory
    is neither created nor locked by the dry run; checks that need a failed one are skipped, and say why."""
    cfg = load_config(["model.lora_rank=4", "model.lora_target_modules=[no_such_proj]",
                       "data.reward=no_such_module:fn", f"train.save_dir={tmp_path / 'ckpt'}"])
    dry = preflight(cfg)
    assert sorted(dry.problems) == ["lora", "reward"]
    assert not (tmp_path / "ckpt").exists()
    message = real_start(cfg, tmp_path)
    assert message.startswith("2 problems:") and "no_such_proj" in message and "no_such_module" in message
    skipped = preflight(load_config(["model=qwen3_0.6b", "model.lora_rank=4"]))
    assert skipped.status["tokenizer"] == skipped.status["lora"] == "skipped"
    assert "not checked: needs model" in skipped.render()


def test_a_valid_config_passes_every_check_in_both(tmp_path, monkeypatch):
    """The negative control: a config that passes every check; the real start goes on to start Ray."""
    from relax.runner.cluster import RayRuntime

    class Reached(Exception):
        pass

    def reached(self):
        raise Reached

    monkeypatch.setattr(RayRuntime, "__enter__", reached)
    cfg = load_config([f"train.save_dir={tmp_path / 'ckpt'}"])
    dry = preflight(cfg)
    assert dry.ok, dry.render()
    assert {dry.status[n] for n in ("tokenizer", "data", "reward", "checkpoints")} == {"ok"}
    from relax.runner.train import run

    with pytest.raises(Reached):
        run(cfg, output_dir=tmp_path / "out")


def test_relax_train_dry_run_exits_2_naming_the_problem_and_prints_the_checks(tmp_path, capfd):
    code, out, err = relax_train(["dry_run=true", "model.lora_rank=4", "model.lora_target_modules=[no_such_proj]"],
                                 capfd)
    assert code == 2, out + err
    assert "Service graph" in out and "Checks before Ray" in out  # the plan, then each check's status
    assert "failed   lora" in out and "ok       tokenizer" in out
    assert "relax-train: error: dry run: a start would stop before Ray" in err and "no_such_proj" in err
    assert "Traceback" not in out + err and "config valid" not in out
    code, out, err = relax_train(["dry_run=true"], capfd)
    assert code == 0, err
    assert "every check a start runs before Ray passed" in out

"""Checkpoints are data, never code: a tampered or truncated checkpoint is refused with one message naming the file.

Two lines of defence, both tested here:
- the driver (`relax.runner.checkpoint.verify`, run when a resume is set up, before Ray, tracking or any role starts)
  checks every file against the size and SHA-256 that state.json recorded at commit, or, for a checkpoint written
  before manifests, parses every file a loader reads (safetensors headers, weights-only torch files, JSON);
- every loader (`TorchPolicy` / `TorchCritic.load_checkpoint`, `MegatronPolicy.load_checkpoint`,
  `read_rollout_state`) reads torch files with `weights_only=True` and names the file it refuses.

"Nothing executed" is checked with a pickle whose `__reduce__` would create a marker file when unpickled.
"""

from __future__ import annotations

import importlib.util
import json
import pickle
import sys
from pathlib import Path

import pytest
import torch

from relax.config import load_config
from relax.config.schema import ModelConfig
from relax.models.checkpoint_files import CheckpointFileError
from relax.runner import checkpoint
from relax.runner.checkpoint import Checkpoints
from relax.runner.errors import RunError
from relax.train.torch_policy import TorchPolicy

pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # the raw-pickle files' protocol
VOCAB, PAD = 40, 0  # the tiny tokenizer's vocabulary and pad id
TINY = ModelConfig(name="tiny-test", source="config", dtype="float32", hidden_size=32, num_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                   max_position_embeddings=64)


class RunsCode:
    """Unpickling this creates `marker` (via `builtins.open`): what a malicious checkpoint file would do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def write_malicious(path: Path, marker: Path, *, zip_format: bool = True) -> None:
    """A torch file (`torch.save`'s zip format) or a raw pickle that would run code when loaded unsafely."""
    payload = {"state": {0: {"exp_avg": RunsCode(marker)}}, "param_groups": []}
    if zip_format:
        torch.save(payload, path)
    else:
        path.write_bytes(pickle.dumps(payload))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def policy() -> TorchPolicy:
    return TorchPolicy(TINY, load_config([]).train, vocab_size=VOCAB, pad_token_id=PAD, seed=0, num_threads=1)


def params(p: TorchPolicy) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in p.model.state_dict().items()}


# ------------------------------------------------------------------------------------------------ the loaders


@pytest.mark.parametrize("zip_format", [True, False], ids=["torch-save", "raw-pickle"])
def test_a_pickle_that_runs_code_as_optimizer_file_is_refused_and_nothing_restored(tmp_path, zip_format):
    marker = tmp_path / "PWNED"
    trainer = policy()
    trainer.save_checkpoint(tmp_path / "ckpt")
    write_malicious(tmp_path / "ckpt" / "optimizer.pt", marker, zip_format=zip_format)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(1.0)  # differs from the checkpoint's weights
    before = params(trainer)
    with pytest.raises(CheckpointFileError, match=r"optimizer\.pt") as info:
        trainer.load_checkpoint(tmp_path / "ckpt")
    assert not marker.exists()  # nothing was executed
    assert "objects other than tensors" in str(info.value) or "damaged" in str(info.value)
    after = params(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)  # every file is read before anything is restored


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "scheduler.pt"])
def test_a_truncated_file_is_refused_naming_it(tmp_path, name):
    trainer = policy()
    trainer.save_checkpoint(tmp_path / "ckpt")
    truncate(tmp_path / "ckpt" / name)
    with pytest.raises(CheckpointFileError, match=rf"{name.replace('.', '[.]')} is damaged or truncated"):
        trainer.load_checkpoint(tmp_path / "ckpt")


def test_an_intact_checkpoint_still_loads(tmp_path):
    trainer = policy()
    trainer.save_checkpoint(tmp_path / "ckpt")
    other = policy()
    with torch.no_grad():
        for p in other.model.parameters():
            p.zero_()
    other.load_checkpoint(tmp_path / "ckpt")
    want, got = params(trainer), params(other)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_the_critics_value_head_is_checked_too(tmp_path):
    from relax.train.torch_critic import VALUE_HEAD_FILE, TorchCritic

    critic = TorchCritic(TINY, load_config([]).train, vocab_size=VOCAB, pad_token_id=PAD, seed=0, num_threads=1)
    with torch.no_grad():
        for p in critic.critic.value_head.parameters():
            p.normal_()
    saved = {k: v.clone() for k, v in critic.critic.state_dict().items()}
    critic.save_checkpoint(tmp_path / "critic")
    with torch.no_grad():
        for p in critic.critic.parameters():
            p.zero_()
    critic.load_checkpoint(tmp_path / "critic")  # intact: backbone and value head restored
    assert all(torch.equal(v, critic.critic.state_dict()[k]) for k, v in saved.items())
    truncate(tmp_path / "critic" / VALUE_HEAD_FILE)
    with pytest.raises(CheckpointFileError, match=VALUE_HEAD_FILE.replace(".", "[.]")):
        critic.load_checkpoint(tmp_path / "critic")


def test_the_rollout_state_is_loaded_weights_only(tmp_path):
    marker = tmp_path / "PWNED"
    write_malicious(tmp_path / checkpoint.ROLLOUT_STATE, marker)
    with pytest.raises(RunError, match=r"rollout\.pt holds objects other than tensors"):
        checkpoint.read_rollout_state(tmp_path)
    assert not marker.exists()
    truncate(tmp_path / checkpoint.ROLLOUT_STATE)
    with pytest.raises(RunError, match=r"rollout\.pt is damaged or truncated"):
        checkpoint.read_rollout_state(tmp_path)


# ------------------------------------------------------------------------- the driver, before anything starts

OVERRIDES = ["tracking.progress=false", "train.lr=0.002"]


def committed_checkpoint(cwd: Path, *, manifest: bool = True) -> Path:
    """A committed checkpoint as a run writes it (policy files, rollout state, state.json) at the default location
    of `OVERRIDES` under `cwd`. Without `manifest`: as written before checkpoints listed their files."""
    cfg = load_config(OVERRIDES)
    trainer = TorchPolicy(cfg.model, cfg.train, vocab_size=VOCAB, pad_token_id=PAD, seed=0, num_threads=1)
    with Checkpoints(cfg, cwd) as ckpts:
        staging = ckpts.staging(2)
        trainer.save_checkpoint(staging / "policy")
        checkpoint.write_rollout_state(staging, {"next_step": 2, "ahead": [torch.zeros(3)], "partial": []})
        path = ckpts.commit(staging, 2, {"sampler": {"epoch": 0, "position": 8}, "mlflow_run_id": None})
    if not manifest:
        state = json.loads((path / checkpoint.STATE).read_text())
        del state[checkpoint.FILES]
        (path / checkpoint.STATE).write_text(json.dumps(state))
    return path


def resume(cwd: Path) -> None:
    with Checkpoints(load_config([*OVERRIDES, "train.resume=auto"]), cwd):
        pass


def test_commit_records_every_file_and_an_intact_checkpoint_resumes(tmp_path):
    path = committed_checkpoint(tmp_path)
    files = json.loads((path / checkpoint.STATE).read_text())[checkpoint.FILES]
    assert {"policy/model.safetensors", "policy/optimizer.pt", "policy/scheduler.pt", "rollout.pt",
            "config.yaml"} <= set(files)
    assert all(len(e["sha256"]) == 64 and e["size"] > 0 for e in files.values())
    with Checkpoints(load_config([*OVERRIDES, "train.resume=auto"]), tmp_path) as ckpts:
        assert ckpts.resume.path == path and ckpts.resume.step == 2


def _flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, file, says", [
    (truncate, "state.json", "is damaged (not JSON"),
    (lambda f: f.write_text("[1, 2]"), "state.json", "is damaged (not a JSON object with an integer 'step')"),
    (truncate, "policy/model.safetensors", "is damaged: "),
    (truncate, "policy/optimizer.pt", "is damaged: "),
    (truncate, "rollout.pt", "is damaged: "),
    (_flip_a_byte, "policy/model.safetensors", "was changed after the checkpoint was committed"),
    (lambda f: f.unlink(), "policy/scheduler.pt", "is missing"),
    (lambda f: f.write_bytes(b"\0" * 16), "policy/extra.safetensors", "is not part of the checkpoint as committed"),
], ids=["state-truncated", "state-not-object", "weights-truncated", "optimizer-truncated", "rollout-truncated",
        "weights-bit-flip", "scheduler-deleted", "file-added"])
def test_a_damaged_checkpoint_is_refused_before_anything_starts(tmp_path, damage, file, says):
    path = committed_checkpoint(tmp_path)
    damage(path / file)
    with pytest.raises(RunError) as info:
        resume(tmp_path)
    message = str(info.value)
    assert f"{path / file} {says}" in message and "Nothing was loaded" in message
    if says == "is damaged: ":
        assert "bytes, " in message and "when it was committed (truncated)" in message


def test_a_malicious_optimizer_file_is_refused_by_its_checksum(tmp_path):
    path = committed_checkpoint(tmp_path)
    marker = tmp_path / "PWNED"
    write_malicious(path / "policy" / "optimizer.pt", marker)
    with pytest.raises(RunError, match=r"policy/optimizer\.pt"):
        resume(tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize("zip_format", [True, False], ids=["torch-save", "raw-pickle"])
def test_without_a_manifest_a_malicious_file_is_refused_by_format_without_running_it(tmp_path, zip_format):
    path = committed_checkpoint(tmp_path, manifest=False)
    marker = tmp_path / "PWNED"
    write_malicious(path / "policy" / "optimizer.pt", marker, zip_format=zip_format)
    with pytest.raises(RunError, match=r"policy/optimizer\.pt") as info:
        resume(tmp_path)
    assert not marker.exists()
    assert "objects other than tensors" in str(info.value) or "damaged" in str(info.value)


@pytest.mark.parametrize("file", ["policy/model.safetensors", "policy/scheduler.pt", "rollout.pt",
                                  "policy/trainer_state.json"])
def test_without_a_manifest_a_truncated_file_is_refused_naming_it(tmp_path, file):
    path = committed_checkpoint(tmp_path, manifest=False)
    resume(tmp_path)  # intact: resumes
    truncate(path / file)
    with pytest.raises(RunError, match="damaged or truncated") as info:
        resume(tmp_path)
    assert str(path / file) in str(info.value)


def test_relax_train_refuses_a_tampered_checkpoint_in_one_message(tmp_path, capfd, monkeypatch, ray_not_started):
    """As a user sees it: exit 2, one message naming the file, no traceback, nothing started, nothing executed.
    (A checkpoint without a manifest is refused by the same driver check, by format: the tests above.) `relax-train`
    runs in this process (tests/relax_train_inprocess.py): the refusal is a pre-Ray `RunError` of `run`, which the
    CLI turns into its message and exit code as for every other one; that path in a `relax-train` process of its
    own: tests/runner/test_training.py (`test_cli_reports_bad_data_without_traceback`)."""
    from relax_train_inprocess import relax_train

    path = committed_checkpoint(tmp_path)
    marker = tmp_path / "PWNED"
    write_malicious(path / "policy" / "optimizer.pt", marker)
    monkeypatch.chdir(tmp_path)  # the default checkpoint directory and tracking store are relative to it
    code, out, err = relax_train([*OVERRIDES, "train.resume=auto"], capfd)
    assert code == 2, err[-3000:]
    assert str(path / "policy" / "optimizer.pt") in err
    assert "Traceback" not in err + out
    assert not marker.exists()
    assert not (tmp_path / "mlflow.db").exists() and not ray_not_started  # refused before tracking and Ray started


@pytest.mark.slow
def test_a_role_that_refuses_a_file_is_one_message_too(tmp_path, fresh_store, ray_local, monkeypatch):
    """The second line: state.json rewritten to list the tampered file (its checksums recomputed), so the driver's
    check passes; the actor (a Ray role) refuses the file with weights_only, and the run stops with the role's
    CheckpointFileError (the cause of Ray's error), whose message is one line naming the file; relax-train shows it
    as the next test checks."""
    from relax.runner.train import run

    path = committed_checkpoint(tmp_path)
    marker = tmp_path / "PWNED"
    write_malicious(path / "policy" / "optimizer.pt", marker)
    state = json.loads((path / checkpoint.STATE).read_text())
    state[checkpoint.FILES] = checkpoint.manifest(path)
    (path / checkpoint.STATE).write_text(json.dumps(state))
    fresh_store(tmp_path)  # the run's default store, sqlite:///mlflow.db in its working directory
    monkeypatch.chdir(tmp_path)  # where the run's default paths are, as for relax-train started there
    with pytest.raises(CheckpointFileError) as info:
        run(load_config([*OVERRIDES, "train.resume=auto"]), output_dir=tmp_path / "out")
    message = str(getattr(info.value, "cause", info.value))
    assert f"{path / 'policy' / 'optimizer.pt'} holds objects other than tensors" in message
    assert "\n" not in message.strip()
    assert not marker.exists()


def test_relax_train_shows_a_roles_refusal_as_one_message(tmp_path, monkeypatch, capsys):
    """What relax-train prints when a role refuses a checkpoint file (the run raises Ray's error, whose cause is the
    role's CheckpointFileError): the role's message, exit 2, no traceback."""
    import ray

    from relax.cli import train as cli
    from relax.runner import train
    refused = CheckpointFileError("checkpoint file /ckpt/policy/optimizer.pt holds objects other than tensors")

    def run(*args, **kwargs):
        raise ray.exceptions.RayTaskError("PolicyWorker.load", "Traceback (most recent call last):\n  ...",
                                          refused).as_instanceof_cause()

    monkeypatch.setattr(train, "run", run)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["relax-train", *OVERRIDES, "train.save=false", "tracking.enabled=false"])
    with pytest.raises(SystemExit) as info:
        cli.main()
    out = capsys.readouterr()
    assert info.value.code == 2
    assert "/ckpt/policy/optimizer.pt holds objects other than tensors" in out.err
    assert "Traceback" not in out.err + out.out


# ------------------------------------------------------------------------------------------------- Megatron

@pytest.fixture(scope="module")
def megatron_checkpoints(request, tmp_path_factory) -> dict:
    """The `checkpoint_refusal` scenario (tests/megatron/fault_scenarios.py) of test_megatron_cpu's shared launch
    (TP=1 x DP=2 over gloo; no rank processes of this module's own): each rank's load outcomes, and the directory of
    the checkpoints."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "megatron"))
    from test_megatron_cpu import shared_launch  # tests/megatron/test_megatron_cpu.py

    return shared_launch(request, tmp_path_factory)["checkpoint_refusal"]


MEGATRON_WORLD = 2


# the shared launch's group: one xdist worker runs every test that reads it, and launches once
@pytest.mark.xdist_group("megatron_cpu")
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
                    reason="megatron-core is not installed")
def test_megatron_checkpoints_load_weights_only_and_refuse_tampered_files(megatron_checkpoints):
    """On both data-parallel ranks, with the plain and the distributed optimizer: a code-running pickle, a truncated
    optimizer file and a damaged trainer_state.json are each refused with a message naming the file, and nothing is
    unpickled. A tampered file on the last rank only makes every rank refuse (rank 0 naming no file of its own)."""
    ranks, out = megatron_checkpoints["ranks"], Path(megatron_checkpoints["dir"])
    assert len(ranks) == MEGATRON_WORLD
    assert not list(out.glob("PWNED*"))
    for rank, outcomes in enumerate(ranks):
        for dist in (0, 1):
            ckpt = out / f"ckpt{dist}"
            opt, meta = ckpt / f"optimizer_tp0_pp0_dp{rank}.pt", ckpt / "trainer_state.json"
            refused = outcomes[f"ckpt{dist}"]
            assert None not in refused.values(), refused  # a load that went through
            assert f"{opt} holds objects other than tensors" in refused["malicious"]
            assert f"{opt} is damaged or truncated" in refused["truncated"]
            assert f"{meta} is damaged" in refused["meta"]
            if rank == MEGATRON_WORLD - 1:
                assert f"{opt} holds objects other than tensors" in refused["last_rank_only"]
            else:
                assert "another rank of the trainer could not read its files" in refused["last_rank_only"]
                assert "optimizer_tp0" not in refused["last_rank_only"]

"""SGLang's LoRA protocol on the embedded server (`rollout.lora_sync=adapter` with `rollout=sglang`): a trainer's
adapters written as a PEFT directory (what `SGLangEngines` writes each update), loaded with `/load_lora_adapter`
and named by `lora_path` in `/generate`, give the trainer's log-probs; a request naming another adapter, or none
while one is loaded, is refused; unloading gives the base model back; PEFT itself reads the directory."""

from __future__ import annotations

import requests
import torch

from relax.algorithms.grpo import GRPOConfig
from relax.config import load_config
from relax.models import lora
from relax.models.hf import build_model, token_logprobs
from relax.serve.sglang.server import EmbeddedServer
from relax.train.torch_policy import TorchPolicy

PROMPT = [5, 6, 7, 8]
LORA = ["rollout=sglang", "rollout.sglang.server=embedded", "model.lora_rank=4", "model.lora_alpha=8",
        "rollout.lora_sync=adapter", "model.dtype=float32"]


def post(url: str, path: str, body: dict) -> requests.Response:
    return requests.post(url + path, json=body, timeout=120)


def logprobs(model, response: list[int]) -> torch.Tensor:
    ids = torch.tensor([PROMPT + response])
    with torch.no_grad():
        return token_logprobs(model, ids, torch.ones_like(ids), len(PROMPT), len(response))[0]


def trained_policy(cfg, make_batch) -> TorchPolicy:
    policy = TorchPolicy(cfg.model, cfg.train, vocab_size=40, pad_token_id=0, seed=cfg.seed, device="cpu",
                         lora_sync="adapter")
    policy.optimizer.param_groups[0]["lr"] = 0.05
    for i in range(3):
        policy.train_step(make_batch(i), GRPOConfig(), per_token=True, micro_batch_size=4)
    return policy


def batch(i: int):
    from relax.batch import TrainBatch

    g = torch.Generator().manual_seed(i)
    n, P, T = 4, 4, 6
    return TrainBatch(prompt_ids=torch.randint(4, 40, (n, P), generator=g),
                      prompt_mask=torch.ones(n, P, dtype=torch.long),
                      response_ids=torch.randint(4, 40, (n, T), generator=g),
                      response_mask=torch.ones(n, T, dtype=torch.long), rollout_logp=torch.zeros(n, T),
                      finish_reason=["stop"] * n, advantages=torch.randn(n, 1, generator=g).expand(n, T).clone())


def test_adapters_load_serve_refuse_and_unload_with_the_trainers_logprobs(tmp_path):
    from peft import PeftModel

    cfg = load_config(LORA)
    policy = trained_policy(cfg, batch)
    adapters = policy.state_dict_for_rollout()
    assert adapters and all(".lora_" in k for k in adapters)
    lora.write_adapter_dir(tmp_path / "v1", adapters, cfg.model)
    base = build_model(cfg.model, 40, 0, seed=cfg.seed).eval()
    peft_model = PeftModel.from_pretrained(build_model(cfg.model, 40, 0, seed=cfg.seed), str(tmp_path / "v1")).eval()

    server = EmbeddedServer(cfg, port=0, weight_dirs=(str(tmp_path),))  # the adapters of this job
    server.start()
    try:
        server.wait_ready(120)
        url = server.url
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 3},
                "return_logprob": True}
        loaded = post(url, "/load_lora_adapter", {"lora_name": "relax-v1", "lora_path": str(tmp_path / "v1")})
        assert loaded.status_code == 200 and loaded.json()["success"], loaded.text
        out = post(url, "/generate", {**body, "lora_path": "relax-v1"}).json()
        served = torch.tensor([p[0] for p in out["meta_info"]["output_token_logprobs"]])
        trainer = policy.compute_logprobs(_samples(out["output_ids"]), 4)[0]
        assert torch.allclose(served, trainer, atol=1e-4)
        assert torch.allclose(served, logprobs(peft_model, out["output_ids"]), atol=1e-4)  # PEFT reads the directory
        assert (served - logprobs(base, out["output_ids"])).abs().max() > 1e-3  # the adapters act
        for wrong in ({**body, "lora_path": "relax-v0"}, body):  # another adapter, or none while one is loaded
            refused = post(url, "/generate", wrong)
            assert refused.status_code == 400 and "lora_path" in refused.text
        # a newer adapter takes the place of the loaded one; unloading the replaced one succeeds, as with SGLang
        assert post(url, "/load_lora_adapter", {"lora_name": "relax-v2", "lora_path": str(tmp_path / "v1")}).ok
        assert post(url, "/unload_lora_adapter", {"lora_name": "relax-v1"}).ok
        assert post(url, "/unload_lora_adapter", {"lora_name": "relax-v2"}).ok
        again = post(url, "/generate", body).json()
        served = torch.tensor([p[0] for p in again["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(served, logprobs(base, again["output_ids"]), atol=1e-4)  # the base model again
        bad = post(url, "/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "missing")})
        assert bad.status_code == 400 and "missing" in bad.text
    finally:
        server.shutdown()


def _samples(response: list[int]):
    from relax.batch import Samples

    T = len(response)
    return Samples(prompt_ids=torch.tensor([PROMPT]), prompt_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                   response_ids=torch.tensor([response]), response_mask=torch.ones(1, T, dtype=torch.long),
                   rollout_logp=torch.zeros(1, T), finish_reason=["length"])


def test_a_server_without_adapters_refuses_to_load_one(tmp_path):
    server = EmbeddedServer(load_config(["rollout=sglang", "rollout.sglang.server=embedded"]), port=0)
    server.start()
    try:
        server.wait_ready(120)
        refused = post(server.url, "/load_lora_adapter", {"lora_name": "a", "lora_path": str(tmp_path)})
        assert refused.status_code == 400 and "no LoRA adapters" in refused.text
    finally:
        server.shutdown()


def test_the_launch_command_enables_sglangs_lora_for_adapter_updates(tmp_path):
    from relax.roles.sglang_server import server_command

    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "config.json").write_text("{}")
    cfg = load_config(["cluster=1xgpu", "rollout=sglang", "model=qwen3_0.6b", f"model.path={tmp_path / 'q'}",
                       "model.lora_rank=16", "rollout.lora_sync=adapter", "model.lora_target_modules=[q_proj,v_proj]"])
    cmd = server_command(cfg, host="127.0.0.1", port=1, threads=None, config_path=tmp_path / "c.json")
    joined = " ".join(cmd)
    assert "--enable-lora" in cmd and "--max-lora-rank 16" in joined and "--lora-target-modules q_proj v_proj" in joined

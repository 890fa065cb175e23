"""SGLang's routed experts (`--enable-return-routed-experts`, `return_routed_experts`) from the embedded server
(relax-serve) through the real sglang-router to the trainer: the routes a client receives are those of Hugging Face's
own router on the served model, every token the engine fed and only those, and the trainer replays them.
"""

from __future__ import annotations

import sys
import time

import pytest
import requests
import torch

from relax.rollout.sglang.process import free_port, start_server, stop_process
from relax.rollout.sglang.routes import decode, encode, place

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
OVERRIDES = ["model=tiny_moe", "model.dtype=float32", "rollout.routing_replay=true"]


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    """An embedded server of tiny_moe that returns routed experts, behind the real sglang-router: (cfg, server, the
    router's URL)."""
    from relax.config import load_config
    from relax.serve.sglang.server import EmbeddedServer

    cfg = load_config(OVERRIDES)
    server = EmbeddedServer(cfg, host="127.0.0.1", port=0, threads=1)
    server.start()
    log = tmp_path_factory.mktemp("router") / "router.log"
    proc = None
    try:
        # start_server: another port when the one picked free was taken before the router bound it
        proc, port = start_server(lambda port: [sys.executable, "-m", "sglang_router.launch_router", "--host",
                                                "127.0.0.1", "--port", str(port), "--policy", "round_robin",
                                                "--log-level", "warn", "--prometheus-host", "127.0.0.1",
                                                "--prometheus-port", str(free_port())],
                                  host="127.0.0.1", url_host="127.0.0.1", log_path=log, timeout_s=60,
                                  what="sglang-router")
        router = f"http://127.0.0.1:{port}"
        server.wait_ready(120)
        assert requests.post(f"{router}/workers", json={"url": server.url}, timeout=30).status_code in (200, 202)
        yield cfg, server, router
    finally:
        stop_process(proc)
        server.shutdown()


def _generate(router: str, server, *, routed_experts: bool = True) -> tuple[list, list]:
    """(raw answers, parsed answers) of one request per prompt (three samples each) through the router."""
    from relax.rollout.sglang.client import GenerateClient, Sampling, generate_payload, parse_answer

    sampling = Sampling(max_new_tokens=10, temperature=1.0, top_p=1.0, top_k=-1,
                        stop_token_ids=tuple(server.eos_token_ids))
    payloads = [generate_payload(p, sampling, max_new_tokens=10, seed=7 * i + k, routed_experts=routed_experts)
                for i, p in enumerate(PROMPTS) for k in range(3)]
    client = GenerateClient(router, request_timeout_s=60)
    deadline = time.monotonic() + 30
    while True:  # until the router has the worker
        try:
            raw = client.generate(payloads)
            break
        except Exception:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    return raw, [parse_answer(a, 0) for a in raw]


def _hf_routes(model: torch.nn.Module, samples) -> torch.Tensor:
    """[N, P+T, L, k] top-k experts of a plain Hugging Face forward over prompt + response (the top-k of each layer's
    softmax, as Qwen3MoeTopKRouter chooses)."""
    from relax.models.hf import position_ids_from_mask

    ids, mask = samples.sequences()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                    output_router_logits=True)
    k = model.config.num_experts_per_tok
    layers = [torch.softmax(z.float(), -1).topk(k, -1).indices.view(*ids.shape, k) for z in out.router_logits]
    return torch.stack(layers, dim=2)


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.long().sort(-1).values == b.long().sort(-1).values).all(-1)


def test_routes_through_the_router_are_hf_routers_and_the_trainer_replays_them(routed):
    """Through sglang-router: each answer's `routed_experts` decodes to [prompt + output - 1, layers, k] and, placed in
    the samples, equals Hugging Face's router on the served model at every fed token (the last output token and the
    padding have none); a trainer whose routers disagree (perturbed) routes every token to exactly those experts with
    replay (agreement 1, its own agreement lower), not without (the control)."""
    from relax.config.schema import TrainConfig
    from relax.models.hf import build_model
    from relax.models.moe import moe_routers, recorded_mask
    from relax.rollout.sglang.client import to_samples
    from relax.train.torch_policy import TorchPolicy

    cfg, server, router = routed
    raw, answers = _generate(router, server)
    layers, k, experts = cfg.model.num_layers, cfg.model.num_experts_per_tok, cfg.model.num_experts
    routes = [decode(a["meta_info"]["routed_experts"], layers, k) for a in raw]
    prompts = [p for p in PROMPTS for _ in range(3)]
    for p, (tokens, *_), r in zip(prompts, answers, routes, strict=True):
        assert r.shape == (len(p) + len(tokens) - 1, layers, k)
    s = to_samples(prompts, answers, sample_ids=torch.arange(len(prompts)), pad_token_id=server.pad_token_id,
                   engine_time=0.0, routes=(routes, (layers, k, experts)))
    P = s.prompt_ids.shape[1]
    fed = torch.cat([s.prompt_mask, s.response_mask], 1).bool()
    fed[torch.arange(len(s)), P + s.response_mask.sum(1) - 1] = False  # each row's last token: never fed
    known = recorded_mask(s.routed_experts, experts)
    assert torch.equal(known.all(-1), fed) and int(fed.sum()) > 100
    model = build_model(cfg.model, server.vocab_size, server.pad_token_id, seed=cfg.seed, dtype=torch.float32).eval()
    assert bool(_same(_hf_routes(model, s), s.routed_experts)[fed].all())

    used: dict[bool, list[torch.Tensor]] = {}
    metrics = {}
    for replay in (True, False):
        policy = TorchPolicy(cfg.model, TrainConfig(), vocab_size=server.vocab_size, pad_token_id=server.pad_token_id,
                             seed=cfg.seed, device="cpu", num_threads=1, routing_replay=replay)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():  # the trainer's routers disagree with the engine's
            for r in moe_routers(policy.model):
                r.weight.add_(0.3 * r.weight.std() * torch.randn(r.weight.shape, generator=g))
        calls: list[torch.Tensor] = []
        for layer in policy.model.model.layers:
            layer.mlp.experts.register_forward_hook(lambda m, args, out, calls=calls: calls.append(args[1].detach()))
        policy.compute_logprobs(s, micro_batch_size=len(s))
        used[replay], metrics[replay] = calls, policy.routing.metrics()
    from relax.train.routing import routes_in_layout
    from relax.train.trainer import length_sorted_micro_batches

    (rows,) = length_sorted_micro_batches(s, len(s))  # the one micro-batch, in the trainer's row order
    want = routes_in_layout(s.select(rows), packed=False)  # [M, L, k] in the trainer's layout, -1 where none
    for layer in range(layers):
        have = want[:, layer]
        ok = (have >= 0).all(-1)
        assert bool(_same(used[True][layer][ok], have[ok]).all())  # every fed token routed as the engine did
        assert not bool(_same(used[False][layer][ok], have[ok]).all())  # the control routes some otherwise
    assert metrics[True]["rollout/router_agreement"] == 1.0
    assert metrics[True]["rollout/router_own_agreement"] < 0.95
    assert metrics[False]["rollout/router_agreement"] < 0.95


def test_a_request_that_opts_out_has_no_routes_and_a_server_without_the_flag_refuses(routed):
    """`return_routed_experts: false` gets no routes (the router drops the field, so behind it every request gets them
    from a server with the flag); a server started without the flag answers a request for them 400, naming the
    flag, instead of ignoring it."""
    from relax.serve.sglang.request import RequestCodec, RequestError

    _, server, _ = routed
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
    answer = requests.post(f"{server.url}/generate", json={**body, "return_routed_experts": False}, timeout=60).json()
    assert "routed_experts" not in answer["meta_info"] and len(answer["output_ids"]) == 3
    answer = requests.post(f"{server.url}/generate", json=body, timeout=60).json()
    assert decode(answer["meta_info"]["routed_experts"], 2, 2).shape == (len(PROMPTS[0]) + 2, 2, 2)
    codec = RequestCodec(server.tokenizer, server.vocab_size, None, server.eos_token_ids)  # no flag
    with pytest.raises(RequestError, match="--enable-return-routed-experts"):
        codec.parse({"input_ids": [1, 2, 3], "return_routed_experts": True})


def test_wire_format_round_trip_and_placement():
    """SGLang's format (base64 int32 [tokens, layers, k]) round trips; placed rows put a prompt at the right of its
    columns and the response from column P, the last output token missing; malformed payloads are refused."""
    r = torch.randint(0, 4, (6, 2, 2))
    assert torch.equal(decode(encode(r), 2, 2), r.to(torch.int32))
    out = place([(3, 4, r), (2, 1, r[:2])], P=4, T=4, num_layers=2, top_k=2, num_experts=4)
    assert out.shape == (2, 8, 2, 2) and out.dtype == torch.uint8
    assert torch.equal(out[0, 1:7].long(), r.long()) and (out[0, 0] == 255).all() and (out[0, 7] == 255).all()
    assert torch.equal(out[1, 2:4].long(), r[:2].long()) and (out[1, 4:] == 255).all()
    with pytest.raises(ValueError, match="whole tokens"):
        decode(encode(r), 2, 5)
    with pytest.raises(ValueError, match="more than the 3 it fed"):
        place([(2, 2, r)], P=2, T=2, num_layers=2, top_k=2, num_experts=4)
    with pytest.raises(ValueError, match="outside"):
        place([(3, 4, r + 4)], P=4, T=4, num_layers=2, top_k=2, num_experts=4)

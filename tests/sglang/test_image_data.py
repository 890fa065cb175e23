"""SGLang's `image_data` on `/generate` with a vision-language model: the embedded server (in this process, real
HTTP) behind the real sglang-router, driven by rollout=sglang's own client code (`relax.rollout.sglang.client`). The
server's log-probs of the sampled tokens equal the trainer's forward on the same prompt ids and images (fp32); with
the images blanked on the trainer's side they do not (the images reach both sides). The placements SGLang accepts
(one pad per image, `text`) give the same tokens as the expanded ids; malformed image requests are 400s."""

from __future__ import annotations

import re
import sys
from dataclasses import replace

import pytest
import requests
import torch

from relax.config import load_config
from relax.data.datasets import PromptDataset
from relax.data.images import VisionData, build_tiny_vl_processor, build_tiny_vl_tokenizer, load_processor
from relax.data.shapes import generate_shapes
from relax.rollout.sglang.client import (
    EngineRequestError,
    GenerateClient,
    Sampling,
    generate_payload,
    parse_answer,
    payload_images,
    to_samples,
)
from relax.rollout.sglang.process import free_port, start_server, stop_process
from relax.serve.sglang.request import RequestCodec, RequestError
from relax.serve.sglang.server import EmbeddedServer
from relax.train.torch_policy import TorchPolicy

OVERRIDES = ["model=tiny_vl", "model.dtype=float32", "seed=3"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_vl_tokenizer()


@pytest.fixture(scope="module")
def items(tokenizer):
    """Two shape prompts with an image each (kept as PNG data URLs: `VisionData.wire`) and a text-only prompt."""
    records = [(r, f"shapes:{i}") for i, r in enumerate(generate_shapes(2, seed=0))]
    records.append(({"prompt": "what is the shape?", "label": "red"}, "text"))
    vision = VisionData(build_tiny_vl_processor(tokenizer), wire=True)
    return list(PromptDataset.from_records(records, tokenizer, vision=vision))


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    """The embedded server (tiny_vl, fp32, seed 3) and the real sglang-router in front of it: (router URL, server)."""
    server = EmbeddedServer(load_config(OVERRIDES), port=0, threads=1)
    server.start()
    proc = None
    try:
        # start_server: another port when the one picked free was taken before the router bound it
        proc, port = start_server(lambda port: [sys.executable, "-m", "sglang_router.launch_router", "--host",
                                                "127.0.0.1", "--port", str(port), "--worker-urls", server.url,
                                                "--policy", "round_robin", "--log-level", "warn",
                                                "--prometheus-host", "127.0.0.1", "--prometheus-port",
                                                str(free_port())],
                                  host="127.0.0.1", url_host="127.0.0.1", log_path=tmp_path_factory.mktemp(
                                      "router") / "router.log", timeout_s=120, what="sglang-router")
        server.wait_ready(120)
        url = f"http://127.0.0.1:{port}"
        client = GenerateClient(url, request_timeout_s=60)  # retries until the router has its worker
        client.generate([{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}])
        yield url, server
    finally:
        stop_process(proc)
        server.shutdown()


def _payloads(items, sampling, tokens: int = 6) -> list[dict]:
    return [generate_payload(i.prompt_ids, sampling, max_new_tokens=tokens, seed=100 + k,
                             image_data=payload_images(i.vision)) for k, i in enumerate(items)]


def test_trainer_logprobs_equal_the_servers_on_image_prompts_through_the_router(router, tokenizer, items):
    url, _ = router
    sampling = Sampling(6, 1.0, 1.0, -1, (tokenizer.eos_token_id,))
    payloads = _payloads(items, sampling)
    answers = GenerateClient(url, request_timeout_s=60).generate(payloads)
    parsed = [parse_answer(a, 0, len(p["input_ids"]) if p.get("image_data") else None)
              for p, a in zip(payloads, answers, strict=True)]
    out = to_samples([i.prompt_ids for i in items], parsed, sample_ids=torch.arange(len(items)),
                     pad_token_id=tokenizer.pad_token_id, engine_time=0.0)
    out = replace(out, vision=[i.vision for i in items])
    mask = out.response_mask.bool()
    assert int(mask.sum()) >= len(items)
    cfg = load_config(OVERRIDES).model
    policy = TorchPolicy(cfg, load_config(OVERRIDES).train, vocab_size=len(tokenizer),
                         pad_token_id=tokenizer.pad_token_id, seed=3, device="cpu")
    logp = policy.compute_logprobs(out, micro_batch_size=len(out))
    assert float((logp - out.rollout_logp)[mask].abs().max()) < 1e-5
    # negative control: the trainer without the images (blank pixels) disagrees on the image rows only
    blank = [None if v is None else {**v, "pixel_values": torch.zeros_like(v["pixel_values"])} for v in out.vision]
    other = policy.compute_logprobs(replace(out, vision=blank), micro_batch_size=len(out))
    pictured = mask.clone()
    pictured[2:] = False
    assert float((other - out.rollout_logp)[pictured].abs().max()) > 1e-3
    assert float((other - out.rollout_logp)[mask & ~pictured].abs().max()) < 1e-5


def test_image_placeholders_are_placed_as_sglang_places_them(router, tokenizer, items):
    """One `<|image_pad|>` per image (what a chat template renders), the expanded ids, and `text` give the same
    prompt tokens and, with one sampling_seed, the same output; the image as a file path too."""
    url, _ = router
    expanded = _payloads(items[:1], Sampling(6, 1.0, 1.0, -1, (tokenizer.eos_token_id,)))[0]
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ids = expanded["input_ids"]
    short = [t for k, t in enumerate(ids) if t != pad or ids[k - 1] != pad]  # one pad per image
    assert len(short) == len(ids) - 3  # the tiny processor's 4 image tokens for a 32x32 image
    text = tokenizer.decode(short, skip_special_tokens=False)
    direct = requests.post(f"{url}/generate", json=expanded, timeout=60).json()
    assert direct["meta_info"]["prompt_tokens"] == len(ids)
    for other in ({**expanded, "input_ids": short}, {**{k: v for k, v in expanded.items() if k != "input_ids"},
                                                      "text": text}):
        answer = requests.post(f"{url}/generate", json=other, timeout=60).json()
        assert answer["meta_info"]["prompt_tokens"] == len(ids)
        assert answer["output_ids"] == direct["output_ids"]
    # a prompt whose image is another one's: other tokens (the image reaches the sampler too)
    swapped = {**expanded, "image_data": payload_images(items[1].vision)}
    assert requests.post(f"{url}/generate", json=swapped, timeout=60).json()["output_ids"] != direct["output_ids"]


@pytest.mark.parametrize("change,message", [
    ({"image_data": []}, "image placeholders .* but no image_data"),
    ({"image_data": ["A", "B"]}, "2 images but the input holds 1 image placeholders"),
    ({"image_data": "http://example.com/x.png"}, "nothing is downloaded"),
    ({"image_data": [{"format": "processor_output"}]}, "format='processor_output' is not supported"),
    ({"top_logprobs_num": 2}, "not supported with image_data"),
])
def test_malformed_image_requests_are_400s(router, tokenizer, items, change, message):
    url, _ = router
    body = {**_payloads(items[:1], Sampling(2, 1.0, 1.0, -1, ()))[0], **change}
    r = requests.post(f"{url}/generate", json=body, timeout=60)
    assert r.status_code == 400
    assert re.search(message, r.json()["error"]["message"]), r.text


def test_image_data_for_a_text_model_and_a_miscounting_server_are_errors(tokenizer, items):
    """A text-only model's codec refuses image_data (400, naming the field); the client refuses an answer whose
    prompt_tokens differ from the prompt it sent (the server expanded the images differently)."""
    codec = RequestCodec(tokenizer, len(tokenizer), None, (tokenizer.eos_token_id,))
    with pytest.raises(RequestError, match="image_data=.*the model is text-only"):
        codec.parse({"input_ids": [1, 2], "image_data": payload_images(items[0].vision)})
    vl = RequestCodec(tokenizer, len(tokenizer), None, (tokenizer.eos_token_id,),
                      load_processor(load_config(OVERRIDES).model, tokenizer))
    rows = vl.parse({"input_ids": items[0].prompt_ids, "image_data": payload_images(items[0].vision)}).rows
    assert rows[0].prompt == items[0].prompt_ids and rows[0].vision["image_tokens"] == 4
    answer = {"output_ids": [5], "meta_info": {"prompt_tokens": 7, "finish_reason": {"type": "length"},
                                               "output_token_logprobs": [[-1.0, 5, None]]}}
    with pytest.raises(EngineRequestError, match="7 tokens, the trainer's prompt has 9"):
        parse_answer(answer, 0, prompt_len=9)
    with pytest.raises(ValueError, match="VisionData.wire"):
        payload_images({k: v for k, v in items[0].vision.items() if k != "image_data"})

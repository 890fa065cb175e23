"""Reward models and judges built and trained in the tests (nothing downloads), on the tiny model's tokenizer.

- `train_digit_classifier`: a tiny Qwen3ForSequenceClassification trained to score a digits-task response by the
  share of its units that are digits (a regression head: the logit), saved with its tokenizer.
- `train_digit_judge`: a tiny Qwen3 causal LM trained to answer a judge question with "1" when the response holds a
  digit and "0" when it does not, saved with its tokenizer.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from relax.batch import Samples
from relax.config import ConfigError, load_config
from relax.config.schema import ModelConfig
from relax.data.tokenizer import DIGITS, TINY_VOCAB, build_tiny_tokenizer
from relax.models.hf import qwen3_config
from relax.models.reward_model import conversation_text, judge_prompt_ids
from relax.rewards.digits import response_units

# pieces of random responses: the tiny vocabulary's words and symbols, and digits
PIECES = [t for t in TINY_VOCAB if not t.startswith("<|")]
WORDS = [t for t in PIECES if t not in DIGITS and t.strip()]
JUDGE_TEMPLATE = "what is the answer {response} ?"


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread while a model trains here: the tiny models gain nothing from more, and on a loaded machine
    spinning threads cost far more than they give."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def digit_share(response: str) -> float:
    units = response_units(response)
    return sum(u.isdigit() for u in units) / len(units) if units else 0.0


def random_response(rng: random.Random, digits: float | None = None) -> str:
    """1-8 pieces separated by spaces, each a digit with probability `digits` (None: a uniform draw per response)."""
    p = rng.random() if digits is None else digits
    # pieces apart: two words together would be one word the tiny tokenizer does not know
    return " ".join(rng.choice(DIGITS) if rng.random() < p else rng.choice(WORDS) for _ in range(rng.randint(1, 8)))


def prompt_messages(rng: random.Random) -> list[dict]:
    return [{"role": "user", "content": f"repeat {rng.choice(DIGITS)}"}]


def tiny_classifier(seed: int = 0):
    """An untrained tiny sequence-classification model (the tiny model's architecture, one label) and the
    tokenizer."""
    from transformers import Qwen3ForSequenceClassification

    tokenizer = build_tiny_tokenizer()
    config = qwen3_config(ModelConfig(), len(tokenizer), tokenizer.pad_token_id)
    config.num_labels = 1
    config.tie_word_embeddings = False
    torch.manual_seed(seed)
    return Qwen3ForSequenceClassification(config), tokenizer


def train_digit_classifier(directory: Path, steps: int = 300, seed: int = 0) -> Path:
    """The classifier trained (MSE on the logit) to output a response's digit share, saved to `directory`."""
    model, tokenizer = tiny_classifier(seed)
    rng = random.Random(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    with one_thread():
        _fit_classifier(model, tokenizer, opt, rng, steps)
    model.eval()
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


def _fit_classifier(model, tokenizer, opt, rng: random.Random, steps: int) -> None:
    for _ in range(steps):
        responses = [random_response(rng) for _ in range(32)]
        texts = [conversation_text(tokenizer, prompt_messages(rng), r) for r in responses]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        target = torch.tensor([digit_share(r) for r in responses])
        loss = torch.nn.functional.mse_loss(model(**batch).logits[:, 0], target)
        opt.zero_grad()
        loss.backward()
        opt.step()


def train_digit_judge(directory: Path, steps: int = 300, seed: int = 0) -> Path:
    """A tiny causal LM trained to answer JUDGE_TEMPLATE about a response with "1" (it holds a digit) or "0" (it
    does not), then its end-of-turn token; saved to `directory` with the tokenizer."""
    from transformers import Qwen3ForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = qwen3_config(ModelConfig(), len(tokenizer), tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    rng = random.Random(seed)
    opt = torch.optim.Adam(model.parameters(), lr=6e-3)
    model.train()
    with one_thread():
        _fit_judge(model, tokenizer, opt, rng, steps)
    model.eval()
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory


def _fit_judge(model, tokenizer, opt, rng: random.Random, steps: int) -> None:
    eos, one, zero = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "1", "0"))
    for _ in range(steps):
        rows, targets = [], []
        for _ in range(32):
            response = random_response(rng, digits=rng.choice([0.0, 0.3]))
            prompt = judge_prompt_ids(tokenizer, JUDGE_TEMPLATE.format(response=response))
            answer = one if any(c.isdigit() for c in response) else zero
            rows.append(prompt + [answer, eos])
            targets.append(len(prompt))
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        labels = torch.full((len(rows), width), -100)
        for r, (row, start) in enumerate(zip(rows, targets, strict=True)):
            ids[r, :len(row)] = torch.tensor(row)
            mask[r, :len(row)] = 1
            labels[r, start:len(row)] = torch.tensor(row[start:])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def yes_no(answer: str) -> float | None:
    """A parser named by import path in the tests: 1 for "1", 0 for "0", None for anything else."""
    return {"1": 1.0, "0": 0.0}.get(answer.strip())


def batch(tokenizer, responses: list[str]) -> Samples:
    """A single-turn rollout batch of `responses` (tokenized by `tokenizer`), for the scorer."""
    rows = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in responses]
    width = max(map(len, rows))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
    n = len(rows)
    return Samples(prompt_ids=torch.ones((n, 1), dtype=torch.long), prompt_mask=torch.ones((n, 1), dtype=torch.long),
                   response_ids=ids, response_mask=mask, rollout_logp=torch.zeros(ids.shape),
                   finish_reason=["stop"] * n, sample_id=torch.arange(n))


def refusals(*overrides: str) -> list[str]:
    """The messages validation gives `overrides` (none: accepted)."""
    try:
        load_config(list(overrides))
    except ConfigError as exc:
        return [v.message for v in exc.violations]
    return []


@contextlib.contextmanager
def recording_server(answer: Callable[[dict], dict]) -> Iterator[tuple[str, list[dict]]]:
    """A loopback HTTP server answering each POSTed JSON body with `answer(body)`: (its base URL, every body kept)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    bodies: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append(body)
            data = json.dumps(answer(body)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", bodies
    finally:
        server.shutdown()
        server.server_close()
        thread.join()

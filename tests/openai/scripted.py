"""A scripted engine behind the training gateway, for the OpenAI tests that check the protocol and the recording with
exact token counts rather than a model: `Script` answers fixed texts, `limits` are a session's, `ScriptedGateways`
makes gateways over scripts and closes them (the `scripted_gateway` fixture of conftest.py); `CutEngine` answers one
answer cut by max_tokens."""

from __future__ import annotations

from relax.serve.openai.chat import ChatFormat
from relax.serve.openai.gateway import Gateway
from relax.serve.openai.service import OpenAIService
from relax.serve.openai.sessions import Limits


def answer(ids: list[int], finish: str, logprob: float = -0.5) -> dict:
    """One /generate answer of `ids`, each token with `logprob`, ended as `finish` ("stop": the caller ends `ids` with
    the stop token; "length": cut by max_tokens)."""
    return {"meta_info": {"output_token_logprobs": [[logprob, t, None] for t in ids], "finish_reason": {"type": finish},
                          "weight_version": "0"}}


def limits(**kw) -> Limits:
    return Limits(**{"max_calls": 8, "max_tokens": 400, "max_new_tokens": 64, "temperature": 1.0, "top_p": 1.0,
                     "top_k": -1, "seed": 0, **kw})


class CutEngine:
    """/generate answering the tokens `ids` with no stop token and finish_reason length (the answer max_tokens cut);
    `stream` gives them token by token, then the finished answer, as relax-serve's engine does."""

    def __init__(self, ids: list[int]):
        self.ids = ids

    def send(self, payloads: list[dict]) -> list[dict]:
        pairs = [[-0.01, t, None] for t in self.ids]
        return [{"meta_info": {"output_token_logprobs": pairs, "finish_reason": {"type": "length"},
                               "weight_version": "0"}} for _ in payloads]

    def stream(self, payloads: list[dict]):
        answer = self.send(payloads)[0]
        pairs = answer["meta_info"]["output_token_logprobs"]
        for k in range(1, len(pairs)):
            yield {"index": 0, "meta_info": {"output_token_logprobs": pairs[:k], "finish_reason": None}}
        yield {"index": 0, **answer}


class Script:
    """An engine answering the k-th /generate payload with texts[k] (the last one again after them) and the stop
    token, each token with its own log-prob; records what it was asked and what it answered (`calls`)."""

    def __init__(self, fmt: ChatFormat, texts: list[str]):
        self.fmt, self.texts, self.calls = fmt, texts, []

    def __call__(self, payloads: list[dict]) -> list[dict]:
        out = []
        for p in payloads:
            ids = self.fmt.encode(self.texts[min(len(self.calls), len(self.texts) - 1)]) + [min(self.fmt.eos_token_ids)]
            answer = {"meta_info": {"output_token_logprobs": [[-0.01 * (k + 1), t, None] for k, t in enumerate(ids)],
                                    "finish_reason": {"type": "stop"}, "weight_version": "2"}}
            self.calls.append((p, answer))
            out.append(answer)
        return out

    def ids(self, k: int) -> list[int]:
        """The token ids the k-th call was answered with (the stop token included)."""
        return [q[1] for q in self.calls[k][1]["meta_info"]["output_token_logprobs"]]


class ScriptedGateways:
    """`make(fmt, texts)` -> (gateway, script, session, client): a gateway over a `Script`, a session opened on it
    and the official client with its key; `close()` closes every gateway made."""

    def __init__(self) -> None:
        self.made: list[Gateway] = []

    def make(self, fmt: ChatFormat, texts: list[str]):
        import openai

        script = Script(fmt, texts)
        gw = Gateway(OpenAIService(fmt, script, model="policy", context_length=None, max_tokens=64)).start()
        self.made.append(gw)
        session = gw.open(0, limits())
        return gw, script, session, openai.OpenAI(base_url=gw.base_url, api_key=session.key, max_retries=0)

    def close(self) -> None:
        for gw in self.made:
            gw.close()

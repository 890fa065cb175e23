"""The log-probs of a /generate row beyond its sampled tokens' (`relax.serve.sglang.request.Extras`): the likeliest
tokens (`top_logprobs_num`) and given tokens (`token_ids_logprob`) at each output position, under the distribution
the row was sampled from (log-softmax at its temperature, full vocabulary; greedy: temperature 1), and the prompt's
tokens (`logprob_start_len`) with the same two at temperature 1, as SGLang computes them. One forward pass over
prompt and output (`relax.models.hf.response_logprobs_all`, the trainer's definition), from the first prompt
position reported on. The output's likeliest tokens come from the engine as it drew each token (`Row.top`, what a
stream sends as it goes); computed here only for a row without them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from relax.models.hf import response_logprobs_all
from relax.serve.sglang.request import GREEDY_EPS, Alts, Extras, Row


def row_extras(model: Any, device: torch.device, row: Row) -> Extras:
    """The `Extras` of an ended row (call under no_grad, holding the model)."""
    o, prompt, T = row.options, row.prompt, len(row.tokens)
    first = (o.logprob_start if o.logprob_start >= 0 else len(prompt) - 1) + 1  # the first token with a log-prob
    n_in = len(prompt) - first
    if n_in + T == 0:
        return Extras()
    temperature = row.key[0] if row.key[0] >= GREEDY_EPS else 1.0
    ids = torch.tensor([prompt + row.tokens], dtype=torch.long, device=device)
    logp = response_logprobs_all(model, ids, torch.ones_like(ids), first, n_in + T,
                                 1.0 if n_in else temperature)[0]
    inputs, outputs = logp[:n_in], logp[n_in:]
    if n_in and T and temperature != 1.0:  # log-softmax is shift-invariant: the output's at the row's temperature
        outputs = torch.log_softmax(outputs / temperature, dim=-1)
    return Extras(input_tokens=inputs.gather(-1, ids[0, first:len(prompt), None]).squeeze(-1).tolist(),
                  input_top=_top(inputs, o.top_logprobs), input_ids=_given(inputs, o.token_ids),
                  output_top=[] if row.engine_top() else _top(outputs, o.top_logprobs),
                  output_ids=_given(outputs, o.token_ids))


def _top(logp: torch.Tensor, k: int) -> list[Alts]:
    """The `k` likeliest (log-prob, token id) at each position of `logp` [T, V] (none when k = 0)."""
    if not k:
        return []
    values, index = logp.topk(k, dim=-1)
    return [list(zip(v, i, strict=True)) for v, i in zip(values.tolist(), index.tolist(), strict=True)]


def _given(logp: torch.Tensor, token_ids: Optional[tuple[int, ...]]) -> list[Alts]:
    """(log-prob, token id) of `token_ids` at each position of `logp` [T, V] (none when not asked)."""
    if token_ids is None:
        return []
    values = logp[:, list(token_ids)].tolist()
    return [list(zip(v, token_ids, strict=True)) for v in values]

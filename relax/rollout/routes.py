"""The experts a mixture-of-experts model routed each token to, as the embedded engine generates
(`rollout.routing_replay`, `rollout.record_routes`; docs/training.md, "Mixture of experts").

`RecordingDecoder` wraps the engine's decoder (`_LlamaFamilyDecoder` or `GenericDecoder` of
`relax.rollout.embedded`, or a vision-language model's `relax.rollout.vision.VisionDecoder`, whose prefill routes the
image placeholders through the text MoE layers like any token): around each of its forwards (the prompts' prefill,
a decode step, an observation fed in one forward) it reads what every router chose
(`relax.models.moe.router_control`, recording) and writes it at the columns of `Samples.sequences()` those tokens
occupy: the prompt's P columns at prefill (image placeholders included), response column t when response token t is
fed. A token the engine never fed (a row's last token, padding) keeps the missing value.

Rows: the engine prefills each distinct prompt once and forks it into its group with `keep(rows)` (rows repeated);
later `keep`s only drop finished rows. So a `keep` with a repeated row is the fork into the output rows 0..N-1 in
order, and any other maps the batch's rows onto the output rows they hold.
"""

from __future__ import annotations

from typing import Optional

import torch

from relax.models.moe import route_dtype, route_fill, router_control, stack_recorded


class RecordingDecoder:
    """A decoder (start/step/extend/keep) that records the routes of every token it feeds; `routes(width)` gives
    them as [N, P + width, L, k] in the compact dtype (`relax.models.moe.route_dtype`)."""

    def __init__(self, decoder, model: torch.nn.Module) -> None:
        self.inner = decoder
        self.control = router_control(model)
        self.dtype = route_dtype(self.control.num_experts)
        self.table: Optional[torch.Tensor] = None  # [rows, P + max_new, L, k]
        self.out = torch.zeros(0, dtype=torch.long)  # batch row -> table row
        self.col = 0  # the column of the next token fed (every running row is at the same one)
        self.prompt_width = 0

    def __getattr__(self, name: str):
        # what the engine reads of the decoder beyond start/step/extend/keep (a VisionDecoder's observe, encode_time,
        # added) is the wrapped decoder's; "inner" itself is never looked up here once set
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _run(self, fn, tokens: torch.Tensor, *args):
        B, S = tokens.shape
        self.control.recording = True
        try:
            logits = fn(tokens, *args)
        finally:
            self.control.recording = False
        routes = stack_recorded(self.control, B, S).to("cpu", self.dtype)
        self.table[self.out, self.col:self.col + S] = routes
        self.col += S
        return logits

    def start(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_len: int) -> torch.Tensor:
        B, P = prompt_ids.shape
        c = self.control
        self.table = torch.full((B, max_len, c.num_layers, c.top_k), route_fill(self.dtype), dtype=self.dtype)
        self.out, self.col, self.prompt_width = torch.arange(B), 0, P
        logits = self._run(lambda ids: self.inner.start(ids, prompt_mask, max_len), prompt_ids)
        pad = prompt_mask.cpu() == 0  # left padding: no token there
        self.table[:, :P][pad] = route_fill(self.dtype)
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._run(lambda ids: self.inner.step(ids[:, 0]), tokens[:, None])

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._run(self.inner.extend, tokens)

    def keep(self, rows: torch.Tensor) -> None:
        self.inner.keep(rows)
        rows = rows.cpu()
        if len(torch.unique(rows)) < len(rows):  # the fork of each prompt into its group
            self.table = self.table.index_select(0, self.out[rows])
            self.out = torch.arange(len(rows))
        else:
            self.out = self.out[rows]

    def routes(self, width: int) -> torch.Tensor:
        """[N, P + width, L, k]: the recorded routes of the prompt and the first `width` response columns."""
        return self.table[:, :self.prompt_width + width].clone()

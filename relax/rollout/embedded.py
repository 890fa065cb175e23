"""The embedded rollout engine: a batched sampler with a KV cache around a Hugging Face causal LM.

Why not `model.generate`: RL rollouts are many short samples from a few prompts, on CPUs or one GPU.
This engine (1) prefills each distinct prompt once and copies its cache to the n samples of its group,
(2) for Llama-family models (llama, qwen2, qwen3) runs its own decode step over the model's own modules
with a preallocated KV cache, grouped-query attention without repeating K/V and a precomputed padding
mask (no per-step mask building, no cache concatenation), (3) computes logits at the last position only,
(4) drops finished rows from the batch, and (5) stops as soon as every row has finished. Other
architectures fall back to the model's own forward with a `DynamicCache` (same results, less speed).

Layout of the result (`Samples`): prompts left-padded to P, responses right-padded to T (the longest
response), `response_mask` 1 on generated tokens including the stop token. `rollout_logp` is defined in
`relax.rollout.sampling`: full-vocabulary log-softmax at `temperature` (1 for greedy).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from relax import progress
from relax.agents.episode import turn_ends
from relax.batch import FinishReason, Samples
from relax.models.vision import is_vision_model
from relax.rollout.decoders import GenericDecoder
from relax.rollout.grammar import advance, mask_logits
from relax.rollout.routes import RecordingDecoder
from relax.rollout.sampling import counter_uniforms, sample_tokens

_FAST_MODEL_TYPES = {"llama", "qwen2", "qwen3", "qwen3_moe"}  # qwen3_moe: its sparse blocks run as they are
_STOP, _LENGTH, _ABORT = 1, 2, 3
_FINISH = {_STOP: FinishReason.STOP, _LENGTH: FinishReason.LENGTH, _ABORT: FinishReason.ABORT}  # of each status


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _at_place_of(tensor: torch.Tensor, storage: torch.UntypedStorage) -> torch.Tensor:
    """A tensor over `storage` at the offset, shape and strides `tensor` has in its own storage."""
    out = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return out.set_(storage, tensor.storage_offset(), tensor.shape, tensor.stride())


def _fuse(linears: list[nn.Linear]) -> torch.Tensor | None:
    """One weight holding the weights of `linears` (bias-free, same input) stacked by output rows; each module's
    weight becomes a view of its rows, so that loading weights into the modules (copy_) updates it. None when
    they cannot be fused."""
    if any(type(m) is not nn.Linear for m in linears):  # a wrapped layer (LoRA adapters) computes more than x W^T
        return None
    weights = [m.weight for m in linears]
    if any(m.bias is not None for m in linears) or len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
        return None
    with torch.inference_mode(False), torch.no_grad():  # plain tensors: the model may be trained elsewhere
        fused = torch.cat([w.detach() for w in weights])
        row = 0
        for w in weights:
            w.data = fused[row:row + w.shape[0]]
            row += w.shape[0]
    return fused


def _views_of(fused: torch.Tensor | None, linears: list[nn.Linear]) -> bool:
    """Whether the modules' weights are still the views of `fused` that `_fuse` made (a weight replaced since,
    e.g. released and resumed by relax-serve, is not)."""
    if fused is None:
        return False
    row, ptr, size = 0, fused.data_ptr(), fused.element_size() * fused.shape[1]
    for m in linears:
        if m.weight.data_ptr() != ptr + row * size:
            return False
        row += m.weight.shape[0]
    return row == fused.shape[0]


def fused_weights(layer: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(q|k|v weight, gate|up weight) of a Llama-family decoder layer, fused once and kept in step with the
    modules (rebuilt when a module's weight was replaced); None for a part that cannot be fused."""
    attn, mlp = layer.self_attn, layer.mlp
    # a sparse MoE block (no gate_proj) runs its own forward: routers, experts (relax.models.moe)
    qkv_mods = [attn.q_proj, attn.k_proj, attn.v_proj]
    gu_mods = [mlp.gate_proj, mlp.up_proj] if hasattr(mlp, "gate_proj") else []
    qkv, gu = getattr(layer, "_relax_fused", (None, None))
    if not _views_of(qkv, qkv_mods):
        qkv = _fuse(qkv_mods)
    if gu_mods and not _views_of(gu, gu_mods):
        gu = _fuse(gu_mods)
    layer._relax_fused = (qkv, gu)
    return qkv, gu


class _LlamaFamilyDecoder:
    """Prefill/decode over a Llama-family model's own modules with a static KV cache [B, Hkv, L, D] per layer."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.base = model.model
        cfg = model.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        attn0 = self.base.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.scale = attn0.scaling
        self.fused = [fused_weights(layer) for layer in self.base.layers]  # weights do not change during a call

    @staticmethod
    def supports(model: nn.Module) -> bool:
        cfg = getattr(model, "config", None)
        if getattr(cfg, "model_type", None) not in _FAST_MODEL_TYPES or not hasattr(model, "model"):
            return False
        if set(getattr(cfg, "layer_types", None) or ["full_attention"]) != {"full_attention"}:
            return False  # sliding-window layers: leave them to the model's own forward
        return all(hasattr(model.model, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb"))

    def start(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_len: int) -> torch.Tensor:
        """Prefill left-padded prompts [B, P] into a cache with room for `max_len` tokens; last logits [B, V]."""
        B, P = prompt_ids.shape
        w = self.base.embed_tokens.weight
        shape = (B, self.n_kv, max_len, self.head_dim)
        self.k = [torch.empty(shape, dtype=w.dtype, device=w.device) for _ in self.base.layers]
        self.v = [torch.empty(shape, dtype=w.dtype, device=w.device) for _ in self.base.layers]
        self.kv_mask = torch.ones(B, max_len, dtype=torch.bool, device=w.device)  # which slots a row attends to
        self.kv_mask[:, :P] = prompt_mask.bool()
        self.pos = prompt_mask.long().sum(-1)  # position of the next token of each row
        positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
        causal = torch.ones(P, P, dtype=torch.bool, device=w.device).tril()
        eye = torch.eye(P, dtype=torch.bool, device=w.device)  # padding queries see themselves: no NaN rows
        mask = (causal & self.kv_mask[:, None, :P]) | eye
        self.len = 0
        return self._forward(prompt_ids, positions, mask[:, None])

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row [B]; logits [B, V] for the next one."""
        logits = self._forward(tokens[:, None], self.pos[:, None], self.kv_mask[:, None, None, : self.len + 1])
        self.pos = self.pos + 1
        return logits

    def extend(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append S tokens per row [B, S] in one forward (an episode's observation); logits [B, V] for the next."""
        B, S = tokens.shape
        end = self.len + S
        new = torch.arange(S, device=tokens.device)
        causal = torch.arange(end, device=tokens.device)[None, :] <= (self.len + new)[:, None]  # [S, end]
        mask = self.kv_mask[:, None, :end] & causal[None]
        logits = self._forward(tokens, self.pos[:, None] + new[None, :], mask[:, None])
        self.pos = self.pos + S
        return logits

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only `rows` of the batch (repeat a row to fork it)."""
        self.k = [c.index_select(0, rows) for c in self.k]
        self.v = [c.index_select(0, rows) for c in self.v]
        self.kv_mask = self.kv_mask.index_select(0, rows)
        self.pos = self.pos.index_select(0, rows)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """S tokens per row into cache slots `self.len`.. (the prompts from slot 0, a decode step, an extension);
        `self.len` advances by S."""
        B, S = ids.shape
        start, end = self.len, self.len + S
        one = S == 1 and start > 0  # a decode step
        x = self.base.embed_tokens(ids)
        cos, sin = self.base.rotary_emb(x, positions)
        cos, sin = cos[:, None], sin[:, None]
        nq, nkv = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        for i, layer in enumerate(self.base.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            qkv_weight, gate_up_weight = self.fused[i]
            if qkv_weight is not None:  # one matmul for q, k and v
                q, k, v = F.linear(h, qkv_weight).split([nq, nkv, nkv], dim=-1)
            else:
                q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
            q = q.view(B, S, self.n_heads, self.head_dim)
            k = k.view(B, S, self.n_kv, self.head_dim)
            v = v.view(B, S, self.n_kv, self.head_dim)
            if hasattr(attn, "q_norm"):  # qwen3
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.k[i][:, :, start:end] = k
            self.v[i][:, :, start:end] = v
            keys, values = self.k[i][:, :, :end], self.v[i][:, :, :end]
            if one:  # one query: fold the query heads of a K/V head into the query axis, no K/V copies
                q = q.reshape(B, self.n_kv, self.n_heads // self.n_kv, self.head_dim)
                o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)
            else:
                o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True)
            o = o.reshape(B, self.n_heads, S, self.head_dim).transpose(1, 2).reshape(B, S, -1)
            x = x + attn.o_proj(o)
            h = layer.post_attention_layernorm(x)
            if gate_up_weight is not None:  # one matmul for gate and up
                gate, up = F.linear(h, gate_up_weight).chunk(2, dim=-1)
                x = x + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
            else:
                x = x + layer.mlp(h)
        self.len = end
        return self.model.lm_head(self.base.norm(x[:, -1]))


class EmbeddedEngine:
    """Batched sampling from `model` (an HF causal LM the caller built), returning `Samples`."""

    def __init__(
        self,
        model: nn.Module,
        *,
        eos_token_ids: list[int],
        pad_token_id: int,
        device: Optional[torch.device | str] = None,
        dtype: Optional[torch.dtype] = None,
        fast_path: Optional[bool] = None,
        drop_finished: bool = True,
    ):
        """`dtype`/`device` move the model in place; `fast_path=None` uses the Llama-family path when supported."""
        if dtype is not None or device is not None:
            model.to(device=device, dtype=dtype)
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = int(pad_token_id)
        self.drop_finished = drop_finished
        supported = _LlamaFamilyDecoder.supports(model)
        if fast_path and not supported:
            raise ValueError(f"fast_path=True: model_type {getattr(model.config, 'model_type', None)!r} unsupported")
        self.fast_path = supported if fast_path is None else fast_path
        self.weight_version = 0
        # the names of LoRA adapter tensors injected into `model` (relax.models.lora.inject_adapters): a weight
        # update may then hold exactly these, the base weights staying as they are
        self.adapter_keys: frozenset[str] = frozenset()
        # weights staged beside generation (`stage_weights`): name -> tensor, their version (-1: none)
        self._staged: dict[str, torch.Tensor] = {}
        self._staged_version = -1
        self._weights_lock = threading.Lock()
        self.swapped_loads = 0  # loads that swapped staged weights in
        # a mixture-of-experts model: record each token's experts into Samples.routed_experts (relax.rollout.routes)
        self.record_routes = False

    def _decoder(self):
        decoder = _LlamaFamilyDecoder(self.model) if self.fast_path else GenericDecoder(self.model)
        return RecordingDecoder(decoder, self.model) if self.record_routes else decoder

    def _targets(self, state_dict: dict[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
        """The model's tensor for each key of `state_dict` (one per distinct tensor: a tied weight, which may come
        under either of its names, once), after a strict key match: every weight, or exactly the injected adapters."""
        targets = self.model.state_dict(keep_vars=True)
        unexpected = sorted(k for k in state_dict if k not in targets)
        given = {id(targets[k]) for k in state_dict if k in targets}
        missing = [] if self.adapter_keys and set(state_dict) == self.adapter_keys else \
            sorted(k for k, v in targets.items() if k not in state_dict and id(v) not in given)
        if missing or unexpected:
            raise KeyError(f"{what}: missing keys {missing}, unexpected keys {unexpected}")
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for key, tensor in state_dict.items():
            target = targets[key]
            if target.shape != tensor.shape:
                raise ValueError(f"{what}: {key} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            if id(target) not in seen:
                seen.add(id(target))
                out[key] = target
        return out

    def stage_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> bool:
        """Copy `state_dict` into new memory laid out as the model's (each weight at its place in a storage like the
        one it lies in, so that the fast path's fused weights stay fused) without touching the model: safe while
        another thread generates. `load_weights` of this version then swaps it in instead of copying, and the old
        memory is freed. A version not newer than the one staged or loaded is skipped (returns False)."""
        with self._weights_lock:
            if version <= max(self.weight_version, self._staged_version):
                return False
            targets = self._targets(state_dict, "stage_weights")
            self._staged, self._staged_version = {}, -1
            storages: dict[int, torch.UntypedStorage] = {}
            for key, target in targets.items():  # (plain tensors, as `_fuse` makes: not inference-mode ones)
                live = target.untyped_storage()
                storage = storages.get(live.data_ptr())
                if storage is None:
                    storage = storages[live.data_ptr()] = torch.UntypedStorage(live.nbytes(), device=target.device)
                with torch.no_grad():
                    staged = _at_place_of(target, storage)
                    staged.copy_(state_dict[key])
                self._staged[key] = staged
            self._staged_version = int(version)
            return True

    @torch.inference_mode()
    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Make `state_dict` the model's weights (strict key match: every weight, or exactly the injected adapters)
        and set the version: swapped in when `stage_weights` staged this version, else copied into the existing
        parameters and buffers. Call it between generations."""
        with self._weights_lock:
            targets = self._targets(state_dict, "load_weights")
            if self._staged_version == int(version) and set(self._staged) == set(targets):
                moved: dict[int, torch.UntypedStorage] = {}  # old storage -> the staged one in its place
                for key, target in targets.items():
                    staged = self._staged[key]
                    moved[target.untyped_storage().data_ptr()] = staged.untyped_storage()
                    target.data = staged
                self._repoint_fused(moved)
                self.swapped_loads += 1
            else:
                for key, target in targets.items():
                    target.copy_(state_dict[key])
            self._staged, self._staged_version = {}, -1
            self.weight_version = int(version)

    def _repoint_fused(self, moved: dict[int, torch.UntypedStorage]) -> None:
        """The fast path's fused q|k|v and gate|up weights (`fused_weights`) lie in storages the model's weights
        just left: the same place in the storages they moved to (still fused, nothing copied)."""
        for layer in getattr(getattr(self.model, "model", None), "layers", []):
            fused = getattr(layer, "_relax_fused", None)
            if fused is None:
                continue
            out = []
            for f in fused:
                storage = None if f is None else moved.get(f.untyped_storage().data_ptr())
                if storage is not None:
                    with torch.inference_mode(False), torch.no_grad():
                        f = _at_place_of(f, storage)
                out.append(f)
            layer._relax_fused = tuple(out)

    @torch.inference_mode()
    def generate(
        self,
        prompts: list[list[int]],
        *,
        n_samples_per_prompt: int = 1,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        seed: int,
        sample_ids: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
        budgets: Optional[torch.Tensor] = None,
        should_abort: Optional[Callable[[], bool]] = None,
        episodes: Optional[list] = None,
        turn_limit: Optional[int] = None,
        grammars: Optional[list] = None,
        vision: Optional[list] = None,
    ) -> Samples:
        """Sample `n_samples_per_prompt` responses per prompt (a group's responses consecutive).

        Row r (prompt r // n) draws its tokens from the random stream of (`seed`, `sample_ids[r]`), the token at
        response position `positions[r] + t` with the uniform of that position (`counter_uniforms`), so a sample
        is the same in any batch. Defaults: sample ids 0..N-1, positions 0. `budgets` [N]: per-row limits on new
        tokens (default `max_new_tokens`; a row that reaches its budget ends with "length"). `should_abort`,
        checked after every token, interrupts generation: the rows still running end with "abort" and keep the
        tokens drawn so far (partial rollout continues them from there).

        `episodes` (one `relax.agents.episode.Episode` per row): multi-turn rows. When a row samples a stop token,
        its episode answers with observation tokens, which are fed to the model one per step without sampling (the
        KV cache keeps every earlier turn), or ends the row with its reason. `max_new_tokens` and `budgets` then
        limit the whole episode (observations included) and `turn_limit` each model turn (a turn at its limit ends
        like one with a stop token, and its episode goes on; a final answer so cut ends it "length":
        `Episode.turn_end`). Observation tokens are in
        `token_mask`, not in `response_mask`; an aborted row keeps the observation it was fed in full. Without
        `episodes`, every stop token ends its row ("stop"): the one-turn case.

        `grammars` (one `relax.rollout.grammar.Matcher` or None per row): constrained decoding. At each step a row
        with a matcher draws from its logits with the tokens its grammar disallows at -inf (the log-probs reported
        are those of this masked distribution; the uniforms are the row's own, as without a grammar), the matcher
        accepts the token drawn, and the row ends ("stop") once its grammar is complete (a stop token accepted).
        The matchers are the caller's and keep their state: a row continued in a later call goes on from there.
        Rows without a matcher sample exactly as without `grammars` (no masking work when no row has one).

        `vision` (one entry per prompt: its images as the processor gave them, or None): prompts with images, whose
        image tokens `prompts` holds (a vision-language model: `relax.rollout.vision.VisionDecoder`); each prompt's
        images are encoded once and its samples share them (`Samples.vision`; `Samples.vision_time`: the seconds the
        vision tower took).
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate: every prompt needs at least one token")
        if max_new_tokens < 1 or n_samples_per_prompt < 1:
            raise ValueError("generate: max_new_tokens and n_samples_per_prompt must be >= 1")
        dev, n = self.device, n_samples_per_prompt
        P = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), P), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(prompts), P, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, P - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, P - len(p) :] = 1
        N, T = len(prompts) * n, max_new_tokens
        sample_ids = torch.arange(N) if sample_ids is None else torch.as_tensor(sample_ids, dtype=torch.long)
        positions = torch.zeros(N, dtype=torch.long) if positions is None else torch.as_tensor(positions).long()
        budgets = torch.full((N,), T, dtype=torch.long) if budgets is None else torch.as_tensor(budgets).long()
        if not (len(sample_ids) == len(positions) == len(budgets) == N):
            raise ValueError(f"generate: sample_ids, positions and budgets need {N} rows (prompts x samples)")
        if bool((budgets < 1).any()) or bool((budgets > T).any()):
            raise ValueError(f"generate: budgets must be in [1, max_new_tokens={T}]")
        if episodes is not None and len(episodes) != N:
            raise ValueError(f"generate: {len(episodes)} episodes for {N} rows")
        if grammars is not None and len(grammars) != N:
            raise ValueError(f"generate: {len(grammars)} grammars for {N} rows")
        constrained = grammars is not None and any(g is not None for g in grammars)
        eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=dev)
        turns = _Turns(episodes, mask.sum(1).repeat_interleave(n) + positions, turn_limit, T)

        if vision is not None or is_vision_model(self.model):  # a vision-language model (relax.rollout.vision)
            from relax.rollout.vision import VisionDecoder

            vision = [None] * len(prompts) if vision is None else vision
            if len(vision) != len(prompts):
                raise ValueError(f"generate: {len(vision)} vision inputs for {len(prompts)} prompts")
            decoder = VisionDecoder(self.model, vision)
            turns.observer = decoder.observe  # observations' positions and images (relax.rollout.vision)
            if self.record_routes:  # a vision-language MoE (Qwen3-VL-MoE): image tokens' experts too
                decoder = RecordingDecoder(decoder, self.model)
        else:
            decoder = self._decoder()
        logits = decoder.start(ids.to(dev), mask.to(dev), P + T)  # each distinct prompt once
        if n > 1:
            fork = torch.arange(len(prompts), device=dev).repeat_interleave(n)
            decoder.keep(fork)
            logits = logits.index_select(0, fork)

        out_ids = torch.full((N, T), self.pad_token_id, dtype=torch.long, device=dev)
        out_logp = torch.zeros(N, T, dtype=torch.float32, device=dev)
        lengths = torch.zeros(N, dtype=torch.long)
        status = torch.zeros(N, dtype=torch.long)  # 0 running, then one of _FINISH
        rows = torch.arange(N)  # batch row -> output row (CPU)
        dropped_mass = torch.zeros((), dtype=torch.float32, device=dev)  # summed over drawn tokens
        t = -1
        while t + 1 < T:
            t += 1
            S = turns.chunk(rows)
            if S > 1 and t + S < T:  # every running row is fed its observation: S tokens of it in one forward
                chunk = turns.take(rows, S)
                out_ids[rows.to(dev), t:t + S] = chunk.to(dev)
                progress.tick(tokens=len(rows) * S)
                logits = decoder.extend(chunk.to(dev))
                t += S - 1
                continue
            u = counter_uniforms(seed, sample_ids[rows], positions[rows] + t)
            if constrained:  # the matchers of the rows still generating
                row_grammars = [grammars[r] if status[r] == 0 else None for r in rows.tolist()]
                logits = mask_logits(logits, row_grammars)
            tokens, logp, dropped = sample_tokens(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                                  uniforms=u)
            forced = turns.force(rows, tokens, logp)  # observation tokens replace the draws of their rows
            out_ids[rows.to(dev), t] = tokens
            out_logp[rows.to(dev), t] = logp
            live = status[rows] == 0  # rows still generating (all of them with drop_finished)
            drawn = live & ~forced
            if turns.wants_top:  # rows whose episode takes each drawn token's likeliest alternatives
                turns.note_top(rows, logits, temperature, drawn)
            dropped_mass += dropped[drawn.to(dev)].sum()
            hit_eos = torch.isin(tokens, eos).cpu() & drawn
            if constrained:  # a complete answer ends like a stop token
                hit_eos |= advance(row_grammars, tokens, drawn)
            if episodes is not None:  # a turn ends at a stop token or its limit; its episode may go on
                turn_over = hit_eos | turns.over_limit(rows, drawn)
                hit_eos = turn_over & ~turns.continue_after(rows, turn_over, hit_eos, out_ids, t, budgets, out_logp)
            hit_budget = (budgets[rows] <= t + 1) & live & ~hit_eos
            status[rows[hit_eos]] = _STOP
            status[rows[hit_budget]] = _LENGTH
            lengths[rows[hit_eos | hit_budget]] = t + 1
            turns.cut(rows[hit_budget])
            running = status[rows] == 0
            progress.tick(tokens=len(rows))  # a token for each row of this decoding step
            if not bool(running.any()):
                break
            if should_abort is not None and should_abort():
                stopped = rows[running]
                status[stopped] = _ABORT
                lengths[stopped] = t + 1 + turns.interrupt(stopped, out_ids, t)
                break
            done = (hit_eos | hit_budget)
            if self.drop_finished and bool(done.any()):  # a smaller batch from now on
                live_rows = running.nonzero().squeeze(-1)
                rows = rows[live_rows]
                decoder.keep(live_rows.to(dev))
                tokens = tokens[live_rows.to(dev)]
            if t + 1 < T:
                logits = decoder.step(tokens)
        vision_time = getattr(decoder, "encode_time", 0.0)
        if vision is not None:  # each row's prompt images, then its observations' (relax.rollout.vision)
            from relax.rollout.vision import merge_vision

            vision = [merge_vision(vision[r // n], decoder.added.get(r, [])) for r in range(N)]
        width = int(lengths.max())
        resp_mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
        out_ids = out_ids[:, :width].cpu().masked_fill(resp_mask == 0, self.pad_token_id)
        generated = resp_mask if episodes is None else resp_mask * (1 - turns.observed[:, :width])
        out_logp = out_logp[:, :width].cpu() * generated
        finish = [_FINISH[s] for s in status.tolist()]
        return Samples(
            prompt_ids=ids.repeat_interleave(n, dim=0),
            prompt_mask=mask.repeat_interleave(n, dim=0),
            response_ids=out_ids,
            response_mask=generated,
            rollout_logp=out_logp,
            finish_reason=finish if episodes is None else turns.reasons(finish),
            weight_version=self.weight_version,
            dropped_mass=float(dropped_mass) / max(1, int(generated.sum())),
            sample_id=sample_ids.clone(),
            vision=vision,
            vision_time=vision_time,
            token_version=generated * self.weight_version,
            token_mask=None if episodes is None else resp_mask,
            episodes=None if episodes is None else [e.record() for e in episodes],
            routed_experts=decoder.routes(width) if self.record_routes else None,
        )


class _Turns:
    """The turns of the rows of one `EmbeddedEngine.generate` call: observation tokens waiting to be fed, where
    each row's current model turn started and how long it is. Without episodes it does nothing (one turn)."""

    def __init__(self, episodes: Optional[list], context: torch.Tensor, turn_limit: Optional[int], width: int):
        self.episodes, self.turn_limit = episodes, turn_limit
        self.context = context  # [N] tokens before this call's first new token (prompt + earlier response)
        N = len(context)
        self.pending: dict[int, list[int]] = {}  # row -> observation tokens still to feed
        self.start = torch.zeros(N, dtype=torch.long)  # column where each row's current model turn started
        partial = [len(e.partial) for e in episodes] if episodes is not None else [0] * N
        self.length = torch.tensor(partial, dtype=torch.long)  # model tokens of the current turn (resumed part too)
        self.observed = torch.zeros(N, width if episodes is not None else 0, dtype=torch.long)  # 1 on observations
        # per row: how many alternatives its episode takes with each drawn token (`wants_top`; 0: none), and those
        # of its current turn's tokens so far (`note_top`), handed over with the turn (`turn_top`)
        self.top_wanted = [int(getattr(e, "wants_top", 0) or 0) for e in episodes] if episodes is not None else []
        self.wants_top = any(self.top_wanted)
        self.tops: dict[int, list[list[tuple[float, int]]]] = {}
        # told each observation queued: (batch row, output row, its tokens, its images or None); a vision-language
        # model's decoder places and encodes it (relax.rollout.vision)
        self.observer: Optional[Callable[[int, int, list[int], Optional[dict]], None]] = None

    def chunk(self, rows: torch.Tensor) -> int:
        """Observation tokens every row of `rows` still has to be fed (0 unless all of them have some)."""
        if not self.pending or any(not self.pending.get(r) for r in rows.tolist()):
            return 0
        return min(len(self.pending[r]) for r in rows.tolist())

    def take(self, rows: torch.Tensor, n: int) -> torch.Tensor:
        """[B, n]: the next `n` observation tokens of each row of `rows` (see `chunk`), taken off their queues."""
        out = []
        for r in rows.tolist():
            queue = self.pending[r]
            out.append(queue[:n])
            del queue[:n]
            if not queue:
                del self.pending[r]
        return torch.tensor(out, dtype=torch.long)

    def force(self, rows: torch.Tensor, tokens: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        """Put the next observation token of each waiting row into `tokens` (log-prob 0); [B] bool: which rows."""
        forced = torch.zeros(len(rows), dtype=torch.bool)
        if not self.pending:
            return forced
        for k, r in enumerate(rows.tolist()):
            queue = self.pending.get(r)
            if queue:
                tokens[k], logp[k], forced[k] = queue.pop(0), 0.0, True
                if not queue:
                    del self.pending[r]
        return forced

    def note_top(self, rows: torch.Tensor, logits: torch.Tensor, temperature: float, drawn: torch.Tensor) -> None:
        """Record, for each row of `rows[drawn]` whose episode asks (`wants_top` k), the k likeliest (log-prob,
        token id) of the distribution whose log-prob `sample_tokens` reports for the token drawn: `logits` (a
        grammar's mask applied), log-softmax at `temperature` (greedy: 1), before top-k/top-p truncation (the token
        itself is drawn from the truncated one). Tokens a grammar disallows (-inf) are none of them: they could not
        be drawn."""
        picks = [k for k, r in enumerate(rows.tolist()) if bool(drawn[k]) and self.top_wanted[r]]
        if not picks:
            return
        x = logits.index_select(0, torch.tensor(picks, device=logits.device)).float()
        if temperature != 0.0 and temperature != 1.0:
            x = x / temperature
        k_max = max(self.top_wanted[int(rows[k])] for k in picks)
        values, ids = torch.log_softmax(x, -1).topk(min(k_max, x.shape[-1]), dim=-1)
        for j, k in enumerate(picks):
            r = int(rows[k])
            pairs = zip(values[j, :self.top_wanted[r]].tolist(), ids[j, :self.top_wanted[r]].tolist(), strict=True)
            self.tops.setdefault(r, []).append([(v, i) for v, i in pairs if v != float("-inf")])

    def continue_after(self, rows: torch.Tensor, turn_over: torch.Tensor, stopped: torch.Tensor,
                       out_ids: torch.Tensor, t: int, budgets: torch.Tensor,
                       out_logp: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[B] bool: the rows whose turn ended at column `t` (`turn_over`: a stop token (`stopped`) or the turn's
        limit) but not their episode (their observation is queued). An observation that leaves no room for a model
        token in the row's budget ends the episode with "length". An episode with `wants_logps` gets its turn's
        log-probs (`turn_logps`) before `turn_end` (a server's streamed row that reports them as they are drawn), one
        with `wants_top` its tokens' alternatives (`turn_top`, see `note_top`) too."""
        going = torch.zeros(len(rows), dtype=torch.bool)
        if not bool(turn_over.any()):
            return going
        ended, turns = turn_over.nonzero().squeeze(-1).tolist(), []
        for k in ended:
            r = int(rows[k])
            episode = self.episodes[r]
            turn = out_ids[r, int(self.start[r]):t + 1].tolist()
            if out_logp is not None and getattr(episode, "wants_logps", False):
                episode.turn_logps(out_logp[r, int(self.start[r]):t + 1].tolist())
            if self.top_wanted and self.top_wanted[r]:
                episode.turn_top(self.tops.pop(r, []))
            turns.append((episode, turn, turn[-1] if bool(stopped[k]) else None, int(self.context[r]) + t + 1))
        # the episodes' answers started together: steps that hang together cost one data.env_timeout_s
        for k, obs in zip(ended, turn_ends(turns), strict=True):
            r = int(rows[k])
            episode = self.episodes[r]
            if obs is None:
                continue
            if t + 1 + len(obs) >= int(budgets[r]):
                episode.end = FinishReason.LENGTH
                continue
            self.pending[r] = list(obs)
            if self.observer is not None:
                self.observer(k, r, list(obs), getattr(obs, "vision", None))
            self.observed[r, t + 1:t + 1 + len(obs)] = 1
            self.start[r], self.length[r] = t + 1 + len(obs), 0
            going[k] = True
        return going

    def over_limit(self, rows: torch.Tensor, drawn: torch.Tensor) -> torch.Tensor:
        """A token drawn for rows `rows[drawn]` (one more in their current model turn); [B] bool: the rows whose
        current turn reached `turn_limit` with it."""
        self.length[rows[drawn]] += 1
        if self.turn_limit is None:
            return torch.zeros(len(rows), dtype=torch.bool)
        return drawn & (self.length[rows] >= self.turn_limit)

    def cut(self, rows: torch.Tensor) -> None:
        """Episodes of `rows` ended by a token limit."""
        if self.episodes is not None:
            for r in rows.tolist():
                self.episodes[r].end = FinishReason.LENGTH

    def interrupt(self, rows: torch.Tensor, out_ids: torch.Tensor, t: int) -> torch.Tensor:
        """Rows `rows` stop after column `t` (an abort): each keeps its queued observation in full (returned: [len]
        tokens added after `t`) and its episode the tokens of its unfinished turn."""
        extra = torch.zeros(len(rows), dtype=torch.long)
        if self.episodes is None:
            return extra
        for k, r in enumerate(rows.tolist()):
            queue = self.pending.pop(r, [])
            if queue:
                out_ids[r, t + 1:t + 1 + len(queue)] = torch.tensor(queue, dtype=torch.long, device=out_ids.device)
                extra[k] = len(queue)
            elif int(self.start[r]) <= t:
                self.episodes[r].partial += out_ids[r, int(self.start[r]):t + 1].tolist()
        return extra

    def reasons(self, finish: list[str]) -> list[str]:
        """Each row's finish reason: "abort", or why its episode ended."""
        return [f if f == FinishReason.ABORT else (e.end or f) for f, e in zip(finish, self.episodes, strict=True)]

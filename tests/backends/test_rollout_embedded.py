"""The embedded rollout engine against brute force: full forward passes without cache or padding."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from relax.rollout.embedded import EmbeddedEngine
from relax.rollout.sampling import draw, filter_logits

VOCAB, PAD = 48, 0
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [3]]


def tiny_model(arch: str = "qwen3", seed: int = 0) -> torch.nn.Module:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        initializer_range=0.2,  # sharp distributions: greedy has no near-ties
        pad_token_id=PAD,
        attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if arch == "llama":
            return LlamaForCausalLM(LlamaConfig(**common)).eval()
        return Qwen3ForCausalLM(Qwen3Config(**common, tie_word_embeddings=True)).eval()


def engine(fast: bool = True, arch: str = "qwen3", eos: list[int] | None = None, **kw) -> EmbeddedEngine:
    return EmbeddedEngine(tiny_model(arch), eos_token_ids=eos or [], pad_token_id=PAD, fast_path=fast, **kw)


@torch.inference_mode()
def brute_greedy(model, prompt: list[int], n: int, eos: list[int]) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        tok = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(tok)
        if tok in eos:
            break
    return ids[len(prompt) :]


@torch.inference_mode()
def brute_logp(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    logits = model(torch.tensor([prompt + response])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
    return logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def responses(samples) -> list[list[int]]:
    return [r[m.bool()].tolist() for r, m in zip(samples.response_ids, samples.response_mask, strict=True)]


FAST = pytest.mark.parametrize("fast", [True, False], ids=["fast", "generic"])


@FAST
def test_layout_matches_samples_contract(fast):
    s = engine(fast).generate(PROMPTS, n_samples_per_prompt=2, max_new_tokens=5, seed=1)
    N, P = 8, max(map(len, PROMPTS))
    assert s.prompt_ids.shape == s.prompt_mask.shape == (N, P)
    assert s.response_ids.shape == s.response_mask.shape == s.rollout_logp.shape == (N, 5)
    assert s.prompt_ids.dtype == s.response_ids.dtype == torch.long and s.rollout_logp.dtype == torch.float32
    for i, p in enumerate(PROMPTS):  # left padding, groups consecutive
        for row in (2 * i, 2 * i + 1):
            assert s.prompt_ids[row, P - len(p) :].tolist() == p
            assert s.prompt_mask[row].tolist() == [0] * (P - len(p)) + [1] * len(p)
            assert (s.prompt_ids[row, : P - len(p)] == PAD).all()
    assert s.response_mask.all() and s.finish_reason == ["length"] * N
    assert (s.rollout_logp < 0).all() and s.weight_version == 0


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@FAST
def test_greedy_with_left_padding_equals_each_prompt_alone(fast, arch):
    eng = engine(fast, arch)
    s = eng.generate(PROMPTS, max_new_tokens=6, temperature=0.0, seed=0)
    assert responses(s) == [brute_greedy(eng.model, p, 6, []) for p in PROMPTS]


@FAST
def test_rollout_logp_equals_full_forward_logprob_at_temperature_one(fast):
    eng = engine(fast)
    s = eng.generate(PROMPTS, n_samples_per_prompt=2, max_new_tokens=6, seed=3)
    for row, resp in enumerate(responses(s)):
        expected = brute_logp(eng.model, PROMPTS[row // 2], resp)
        torch.testing.assert_close(s.rollout_logp[row, : len(resp)], expected, atol=1e-4, rtol=0)
    # and the trainer's own function over the padded batch
    from relax.models.hf import token_logprobs

    ids, mask = s.sequences()
    with torch.inference_mode():
        trainer = token_logprobs(eng.model, ids, mask, ids.shape[1] - 6, 6)
    torch.testing.assert_close(trainer * s.response_mask, s.rollout_logp, atol=1e-4, rtol=0)


def test_rollout_logp_is_full_vocab_logsoftmax_at_temperature():
    eng = engine()
    s = eng.generate(PROMPTS[:1], max_new_tokens=4, temperature=0.7, top_k=5, seed=2)
    resp = responses(s)[0]
    with torch.inference_mode():
        logits = eng.model(torch.tensor([PROMPTS[0] + resp])).logits[0, len(PROMPTS[0]) - 1 : -1]
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(resp)[:, None]).squeeze(-1)
    torch.testing.assert_close(s.rollout_logp[0], expected, atol=1e-4, rtol=0)


@FAST
@pytest.mark.parametrize("drop", [True, False])
def test_eos_stops_a_row_and_length_otherwise(fast, drop):
    eng = engine(fast)
    free = eng.generate(PROMPTS, max_new_tokens=6, temperature=0.0, seed=0)
    stop_tok = int(free.response_ids[0, 2])
    eng = engine(fast, eos=[stop_tok], drop_finished=drop)
    s = eng.generate(PROMPTS, max_new_tokens=6, temperature=0.0, seed=0)
    for row, p in enumerate(PROMPTS):
        expected = brute_greedy(eng.model, p, 6, [stop_tok])
        n = len(expected)
        assert s.response_ids[row, :n].tolist() == expected
        assert s.response_mask[row].tolist() == [1] * n + [0] * (s.response_mask.shape[1] - n)
        assert (s.response_ids[row, n:] == PAD).all() and (s.rollout_logp[row, n:] == 0).all()
        assert s.finish_reason[row] == ("stop" if expected[-1] == stop_tok else "length")
    assert s.finish_reason[0] == "stop" and s.response_mask[0].sum() <= 3


def test_all_rows_stopping_ends_early_with_narrow_responses():
    eng = engine()
    first = eng.generate(PROMPTS[:1], max_new_tokens=1, temperature=0.0, seed=0).response_ids[0, 0]
    eng = engine(eos=[int(first)])
    s = eng.generate(PROMPTS[:1], n_samples_per_prompt=3, max_new_tokens=8, temperature=0.0, seed=0)
    assert s.response_ids.shape == (3, 1) and s.finish_reason == ["stop"] * 3


@FAST
def test_top_k_1_and_tiny_top_p_equal_greedy(fast):
    eng = engine(fast)
    greedy = eng.generate(PROMPTS, n_samples_per_prompt=2, max_new_tokens=5, temperature=0.0, seed=0)
    for kw in (dict(top_k=1), dict(top_p=1e-6)):
        s = eng.generate(PROMPTS, n_samples_per_prompt=2, max_new_tokens=5, seed=7, **kw)
        assert torch.equal(s.response_ids, greedy.response_ids), kw
        torch.testing.assert_close(s.rollout_logp, greedy.rollout_logp)


def test_filter_logits_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    keep = lambda **kw: torch.isfinite(filter_logits(logits, **kw))[0].tolist()  # noqa: E731
    assert keep(top_p=0.5) == [True, False, False, False]
    assert keep(top_p=0.79) == [True, True, False, False]
    assert keep(top_p=0.81) == [True, True, True, False]
    assert keep(top_k=3) == [True, True, True, False]
    assert keep(top_k=2, top_p=0.99) == [True, True, False, False]


def test_draw_follows_the_distribution_and_never_picks_zero_probability():
    probs = torch.tensor([[0.0, 0.1, 0.0, 0.6, 0.3, 0.0]]).repeat(20000, 1)
    tokens = draw(probs, torch.rand(len(probs), generator=torch.Generator().manual_seed(0)).clamp_(min=1e-9))
    freq = torch.bincount(tokens, minlength=6).float() / len(tokens)
    torch.testing.assert_close(freq, probs[0], atol=0.015, rtol=0)
    assert freq[[0, 2, 5]].sum() == 0


@FAST
def test_same_seed_same_samples_different_seed_different(fast):
    eng = engine(fast)
    kw = dict(n_samples_per_prompt=4, max_new_tokens=6, top_p=0.9, top_k=20)
    a, b, c = (eng.generate(PROMPTS, seed=s, **kw) for s in (11, 11, 12))
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.rollout_logp, b.rollout_logp)
    assert not torch.equal(a.response_ids, c.response_ids)
    rng_before = torch.get_rng_state()
    eng.generate(PROMPTS, seed=11, **kw)
    assert torch.equal(rng_before, torch.get_rng_state())  # the global RNG is untouched


def test_group_of_greedy_samples_is_the_single_sample_repeated():
    eng = engine()
    one = eng.generate(PROMPTS, max_new_tokens=5, temperature=0.0, seed=0)
    three = eng.generate(PROMPTS, n_samples_per_prompt=3, max_new_tokens=5, temperature=0.0, seed=0)
    assert torch.equal(three.response_ids, one.response_ids.repeat_interleave(3, dim=0))
    assert torch.equal(three.prompt_ids, one.prompt_ids.repeat_interleave(3, dim=0))


def test_load_weights_changes_outputs_and_bumps_version():
    eng = engine()
    before = eng.generate(PROMPTS, max_new_tokens=6, temperature=0.0, seed=0)
    other = tiny_model(seed=1).state_dict()
    params_before = {id(p) for p in eng.model.parameters()}
    eng.load_weights(other, version=3)
    assert eng.weight_version == 3 and {id(p) for p in eng.model.parameters()} == params_before
    after = eng.generate(PROMPTS, max_new_tokens=6, temperature=0.0, seed=0)
    assert after.weight_version == 3 and not torch.equal(before.response_ids, after.response_ids)
    assert responses(after) == [brute_greedy(tiny_model(seed=1), p, 6, []) for p in PROMPTS]

    other.pop("lm_head.weight")  # tied to the embeddings: either name is enough
    eng.load_weights(other, version=4)
    with pytest.raises(KeyError, match="model.norm.weight"):
        eng.load_weights({k: v for k, v in other.items() if k != "model.norm.weight"}, version=5)
    with pytest.raises(KeyError, match="bogus"):
        eng.load_weights({**other, "bogus": torch.zeros(1)}, version=5)
    with pytest.raises(ValueError, match="model.norm.weight"):
        eng.load_weights({**other, "model.norm.weight": torch.zeros(3)}, version=5)
    assert eng.weight_version == 4


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_staged_weights_are_swapped_in_without_a_copy_and_keep_the_fused_matmuls(arch):
    """stage_weights copies a version into new memory while the model keeps its weights (a generation in another
    thread sees only the old ones); load_weights of that version swaps it in: the parameters then lie in the staged
    memory (no copy), the fast path's fused weights stay views of them (not fused again), and the outputs are the
    new weights' (brute force)."""
    eng = engine(arch=arch)
    before = eng.generate(PROMPTS, max_new_tokens=6, temperature=0.0, seed=0)  # fuses q|k|v and gate|up
    fused_before = [f.data_ptr() for layer in eng.model.model.layers for f in layer._relax_fused]
    other = tiny_model(arch, seed=1).state_dict()
    assert eng.stage_weights(other, version=1)
    assert eng.weight_version == 0
    assert responses(eng.generate(PROMPTS, max_new_tokens=6, temperature=0.0, seed=0)) == responses(before)
    staged = {k: t.data_ptr() for k, t in eng._staged.items()}
    eng.load_weights(other, version=1)
    assert eng.weight_version == 1 and eng.swapped_loads == 1
    after = eng.generate(PROMPTS, max_new_tokens=6, temperature=0.0, seed=0)
    params = dict(eng.model.named_parameters())  # (a generation that fused them again would have moved them)
    assert all(params[k].data_ptr() == ptr for k, ptr in staged.items() if k in params)
    assert responses(after) == [brute_greedy(tiny_model(arch, seed=1), p, 6, []) for p in PROMPTS]
    layer = eng.model.model.layers[0]
    qkv, gate_up = layer._relax_fused
    assert layer.self_attn.k_proj.weight.data_ptr() == qkv[layer.self_attn.q_proj.weight.shape[0]:].data_ptr()
    assert layer.mlp.up_proj.weight.data_ptr() == gate_up[layer.mlp.gate_proj.weight.shape[0]:].data_ptr()
    assert not {f.data_ptr() for layer in eng.model.model.layers for f in layer._relax_fused} & set(fused_before)

    # older than what is loaded: skipped; staged, but another version loaded: copied, the staged one dropped
    assert not eng.stage_weights(tiny_model(arch, seed=2).state_dict(), version=1)
    assert eng.stage_weights(tiny_model(arch, seed=2).state_dict(), version=2)
    eng.load_weights(tiny_model(arch, seed=3).state_dict(), version=3)
    assert eng.swapped_loads == 1 and eng._staged == {}
    again = eng.generate(PROMPTS, max_new_tokens=6, temperature=0.0, seed=0)
    assert responses(again) == [brute_greedy(tiny_model(arch, seed=3), p, 6, []) for p in PROMPTS]
    with pytest.raises(KeyError, match="stage_weights: missing keys"):
        eng.stage_weights({"model.norm.weight": other["model.norm.weight"]}, version=4)


def test_weights_replaced_under_the_fused_matmuls_are_picked_up():
    """The fast path multiplies q|k|v and gate|up as one weight each, whose rows the modules' weights are views of
    (so load_weights' copy_ reaches them); a weight replaced outright (relax-serve's memory release and resume)
    is noticed and fused again."""
    eng = engine(arch="llama")
    eng.generate(PROMPTS, max_new_tokens=6, temperature=0.0, seed=0)  # fused here
    layer = eng.model.model.layers[0]
    qkv, _ = layer._relax_fused
    assert layer.self_attn.k_proj.weight.data_ptr() == qkv[layer.self_attn.q_proj.weight.shape[0]:].data_ptr()
    other = tiny_model("llama", seed=1)
    with torch.no_grad():
        for name, param in eng.model.named_parameters():
            param.data = other.get_parameter(name).detach().clone()
    after = eng.generate(PROMPTS, max_new_tokens=6, temperature=0.0, seed=0)
    assert responses(after) == [brute_greedy(tiny_model("llama", seed=1), p, 6, []) for p in PROMPTS]


def test_bf16_engine_runs_and_reports_fp32_logp():
    eng = engine(dtype=torch.bfloat16)
    s = eng.generate(PROMPTS, n_samples_per_prompt=2, max_new_tokens=4, seed=0)
    assert next(eng.model.parameters()).dtype == torch.bfloat16
    assert s.rollout_logp.dtype == torch.float32 and torch.isfinite(s.rollout_logp).all()


def test_bad_arguments():
    eng = engine()
    with pytest.raises(ValueError):
        eng.generate([[1], []], max_new_tokens=2, seed=0)
    with pytest.raises(ValueError):
        eng.generate([[1]], max_new_tokens=0, seed=0)


# ---- per-sample random streams and interrupted responses (partial rollout)


@FAST
def test_a_sample_is_the_same_whatever_batch_it_is_in(fast):
    """A sample's tokens depend on (seed, sample id, position) and the weights only: generated alone, with other
    prompts, or on another replica, it is the same response."""
    eng = engine(fast)
    ids = torch.arange(100, 100 + 2 * len(PROMPTS))
    together = eng.generate(PROMPTS, n_samples_per_prompt=2, max_new_tokens=6, seed=5, sample_ids=ids)
    for k, prompt in enumerate(PROMPTS):
        alone = eng.generate([prompt], n_samples_per_prompt=2, max_new_tokens=6, seed=5,
                             sample_ids=ids[2 * k:2 * k + 2])
        assert responses(alone) == responses(together)[2 * k:2 * k + 2]
    assert together.sample_id.tolist() == ids.tolist()
    other = eng.generate(PROMPTS, n_samples_per_prompt=2, max_new_tokens=6, seed=5, sample_ids=ids + 1000)
    assert responses(other) != responses(together)


def test_an_interrupted_response_continues_from_its_prefix_with_the_new_weights():
    from relax.batch import continuation, extend_responses

    eng = engine()
    ids = torch.arange(len(PROMPTS))
    whole = eng.generate(PROMPTS, max_new_tokens=8, seed=3, sample_ids=ids)
    ticks = iter(range(100))
    cut = eng.generate(PROMPTS, max_new_tokens=8, seed=3, sample_ids=ids, should_abort=lambda: next(ticks) == 2)
    assert cut.finish_reason == ["abort"] * len(PROMPTS) and cut.response_mask.sum(1).tolist() == [3] * len(PROMPTS)
    assert torch.equal(cut.response_ids, whole.response_ids[:, :3])

    # the same weights: the continuation is the uninterrupted response (same random stream, same context)
    job = continuation(cut, 8)
    more = eng.generate(job.prompts, max_new_tokens=int(job.budgets.max()), seed=3, sample_ids=job.sample_ids,
                        positions=job.positions, budgets=job.budgets)
    same = extend_responses(cut, more)
    assert responses(same) == responses(whole)
    torch.testing.assert_close(same.rollout_logp, whole.rollout_logp, atol=1e-5, rtol=0)

    # new weights (version 1): the prefix keeps version 0, the rest is sampled from the new model given the prefix
    eng.load_weights(tiny_model(seed=1).state_dict(), version=1)
    more = eng.generate(job.prompts, max_new_tokens=int(job.budgets.max()), seed=3, sample_ids=job.sample_ids,
                        positions=job.positions, budgets=job.budgets)
    mixed = extend_responses(cut, more)
    assert mixed.response_mask.sum(1).tolist() == [8] * len(PROMPTS)
    assert mixed.versions()[:, :3].eq(0).all() and mixed.versions()[:, 3:].eq(1).all()
    new_model = tiny_model(seed=1)
    for i, (prompt, resp) in enumerate(zip(PROMPTS, responses(mixed), strict=True)):
        assert resp[:3] == responses(whole)[i][:3]
        expected = brute_logp(new_model, prompt + resp[:3], resp[3:])
        torch.testing.assert_close(mixed.rollout_logp[i, 3:], expected, atol=1e-4, rtol=0)


def test_budgets_end_rows_early_with_length():
    eng = engine()
    s = eng.generate(PROMPTS, max_new_tokens=6, seed=0, budgets=torch.tensor([1, 6, 3, 2]))
    assert s.response_mask.sum(1).tolist() == [1, 6, 3, 2] and s.finish_reason == ["length"] * 4

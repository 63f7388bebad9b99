"""The gated delta rule's exportable math against transformers' own Qwen3.5 functions (the reference)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from qeff_evs.models import gated_delta as gd


def _inputs(seq_len: int, heads: int = 3, k_dim: int = 16, v_dim: int = 8, batch: int = 2, seed: int = 0,
            decay_scale: float = 1.0):
    """transformers' layout ``(B, S, H, D)``; log-decays spanning slow (-1e-3) to fast (-decay_scale * 3)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_len, heads, k_dim, generator=gen)
    k = torch.randn(batch, seq_len, heads, k_dim, generator=gen)
    v = torch.randn(batch, seq_len, heads, v_dim, generator=gen)
    rates = torch.logspace(-3, 0, heads)[None, None, :] * decay_scale
    g = -rates * torch.rand(batch, seq_len, heads, generator=gen) * 3
    beta = torch.rand(batch, seq_len, heads, generator=gen)
    state = torch.randn(batch, heads, k_dim, v_dim, generator=gen)
    return q, k, v, g, beta, state


def _ours(q, k, v, g, beta):
    """Our layout ``(B, H, S, D)`` with q/k normalised and q scaled, as the layer feeds the rule."""
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    return (t(gd.l2_normalize(q)) * q.shape[-1] ** -0.5, t(gd.l2_normalize(k)), t(v), t(g), t(beta))


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_rule_matches_transformers(chunk):
    # 200 tokens: several chunks and a partial last one (padded inside the rule), from a non-zero state.
    q, k, v, g, beta, state = _inputs(200)
    ref_out, ref_state = hf.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, chunk_size=chunk, initial_state=state,
                                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, final = gd.chunked_gated_delta_rule(*_ours(q, k, v, g, beta), state, chunk_size=chunk)
    torch.testing.assert_close(out.transpose(1, 2), ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(final, ref_state, atol=1e-5, rtol=0)


def test_recurrent_rule_matches_transformers():
    q, k, v, g, beta, state = _inputs(24)
    ref_out, ref_state = hf.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state,
                                                             output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, final = gd.recurrent_gated_delta_rule(*_ours(q, k, v, g, beta), state)
    torch.testing.assert_close(out.transpose(1, 2), ref_out, atol=1e-6, rtol=0)
    torch.testing.assert_close(final, ref_state, atol=1e-6, rtol=0)


def test_chunked_rule_equals_the_recurrence_under_fast_decay():
    # log-decays down to -3000 per token: exp of a positive difference would overflow to inf (and
    # inf * 0 = NaN); only non-positive differences are exponentiated, so everything stays finite.
    q, k, v, g, beta, state = _inputs(64, decay_scale=1000.0)
    args = _ours(q, k, v, g, beta)
    out, final = gd.chunked_gated_delta_rule(*args, state, chunk_size=64)
    ref_out, ref_state = gd.recurrent_gated_delta_rule(*args, state)
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(final, ref_state, atol=1e-5, rtol=0)


def test_padding_tokens_leave_the_state_unchanged():
    q, k, v, g, beta, state = _inputs(20)
    args = list(_ours(q, k, v, g, beta))
    for i in range(5):  # zero the last 12 tokens as the layer masks padding
        args[i] = args[i].clone()
        args[i][:, :, 8:] = 0
    _, final = gd.chunked_gated_delta_rule(*args, state, chunk_size=16)
    _, ref_state = gd.recurrent_gated_delta_rule(*(a[:, :, :8] for a in args), state)
    torch.testing.assert_close(final, ref_state, atol=1e-6, rtol=0)


@pytest.mark.parametrize("size", [1, 2, 16, 64])
def test_unit_lower_inverse_is_exact(size):
    gen = torch.Generator().manual_seed(size)
    strict = torch.randn(5, size, size, generator=gen, dtype=torch.float64).tril(-1)
    identity = torch.eye(size, dtype=torch.float64)
    expected = torch.linalg.solve_triangular(identity + strict, identity.expand(5, -1, -1), upper=False)
    torch.testing.assert_close(gd.unit_lower_inverse(strict), expected, atol=1e-10, rtol=1e-10)


def test_unit_lower_inverse_stays_accurate_when_keys_are_alike():
    # Identical unit keys, beta = 1, no decay: A = strictly-lower ones, whose inverse (I + A)^-1 is
    # bidiagonal, but the series sum (-A)^k has binomial terms up to C(62, 31) ~ 5e17 that would
    # cancel: a truncated or product series loses everything in fp32, block doubling does not.
    strict = torch.ones(64, 64).tril(-1)
    identity = torch.eye(64, dtype=torch.float64)
    expected = torch.linalg.solve_triangular(identity + strict.double(), identity, upper=False)
    torch.testing.assert_close(gd.unit_lower_inverse(strict).double(), expected, atol=1e-6, rtol=0)


def test_l2_normalize_and_softplus_do_not_overflow_in_fp16():
    x = torch.full((2, 128), 300.0)
    x[1] = 1e-3
    ref = hf.l2norm(x.double(), dim=-1, eps=gd.L2_EPS)
    # transformers' form: sum(x^2) = 300^2 * 128 overflows fp16 and rsqrt(inf) = 0 wipes the vector.
    assert (hf.l2norm(x.half(), dim=-1, eps=gd.L2_EPS).double() - ref).abs().max() > 0.05
    torch.testing.assert_close(gd.l2_normalize(x.half()).double(), ref, atol=1e-3, rtol=0)
    torch.testing.assert_close(gd.l2_normalize(x).double(), ref, atol=1e-7, rtol=0)
    assert torch.equal(gd.l2_normalize(torch.zeros(3, 16)), torch.zeros(3, 16))  # padding stays zero
    a = torch.tensor([-30.0, -1.0, 0.0, 1.0, 15.0, 30.0])
    torch.testing.assert_close(gd.softplus(a), torch.nn.functional.softplus(a), atol=1e-6, rtol=1e-6)
    assert torch.isfinite(gd.softplus(a.half())).all()


@pytest.mark.parametrize("seq_len, chunk", [(1, 1), (16, 16), (24, 32), (64, 64), (100, 64), (512, 64)])
def test_chunk_size_for(seq_len, chunk):
    assert gd.chunk_size_for(seq_len) == chunk


def test_chunk_size_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power-of-two"):
        gd.chunk_size_for(16, 48)


def test_causal_conv_carries_the_last_valid_inputs():
    gen = torch.Generator().manual_seed(0)
    channels, width, chunk_len, valid = 6, 4, 10, 7
    weight = torch.randn(channels, 1, width, generator=gen)
    stream = torch.randn(1, channels, 3 * valid, generator=gen)
    # The valid tokens in one call with K - 1 zeros of left context are the reference.
    ref = torch.nn.functional.conv1d(stream, weight, padding=width - 1, groups=channels)[..., :3 * valid]
    state = torch.zeros(1, channels, width - 1)
    outs = []
    for start in range(0, 3 * valid, valid):  # 7 valid tokens, then 3 padding columns of garbage
        chunk = torch.randn(1, channels, chunk_len, generator=gen) * 1e3
        chunk[..., :valid] = stream[..., start:start + valid]
        out, state = gd.causal_conv(chunk, state, weight, torch.tensor([valid]))
        outs.append(out[..., :valid])
    torch.testing.assert_close(torch.cat(outs, dim=-1), ref, atol=1e-5, rtol=0)
    assert torch.equal(state, stream[..., -(width - 1):])
    _, kept = gd.causal_conv(torch.randn(1, channels, chunk_len, generator=gen), state, weight, torch.tensor([0]))
    assert torch.equal(kept, state)  # a row without valid tokens keeps its state


def test_log1p_and_expm1_keep_small_arguments_in_fp16():
    # A slow head: softplus(a + dt_bias) ~ 1e-4 and g ~ -1e-4 per token. In fp16 1 + 1e-4 == 1 and
    # exp(-1e-4) == 1: the plain forms lose the decay entirely; ours keep it to fp16 precision.
    small = torch.logspace(-7, 0, 400)
    torch.testing.assert_close(gd.log1p(small), torch.log1p(small), atol=0, rtol=1e-6)
    half = small.half()
    half = half[half > 0]
    exact = torch.log1p(half.double())
    assert ((torch.log(1 + half).double() - exact) / exact).abs().max() > 0.5
    assert ((gd.log1p(half).double() - exact) / exact).abs().max() < 2e-3
    g = -torch.logspace(-7, 2, 400)
    torch.testing.assert_close(gd.expm1(g), torch.expm1(g), atol=0, rtol=1e-6)
    half = g.half()
    exact = torch.expm1(half.double())
    assert ((torch.exp(half) - 1).double().sub(exact).div(exact).abs().max() > 0.5)
    assert ((gd.expm1(half).double() - exact) / exact).abs().max() < 2e-3
    assert torch.equal(gd.decay(torch.ones(3), torch.zeros(3)), torch.ones(3))  # g = 0 (padding) is exact

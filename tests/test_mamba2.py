"""``models.mamba2``: a Mamba2 layer step over retained conv/SSM state, against transformers' own mixer.

The reference is transformers' ``NemotronHMamba2Mixer`` with its ``DynamicCache`` (its chunked scan for a prompt,
its one-token update after it). The step must give the same outputs and states whether the prompt arrives whole or
in chunks, right-padded to the compiled length (padding leaves both states as they were), one token at a time;
a chunk holding slot 0 starts from zero whatever its row held; under continuous batching each batch row reads and
writes its own state row and every other row comes back bit for bit. The two scan forms agree with each other.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache, NemotronHConfig
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHForCausalLM

from qeff_evs.models.mamba2 import Mamba2Step, chunked_scan, recurrent_scan

ATOL = 1e-5
HIDDEN = 32


@pytest.fixture(scope="module")
def mixer():
    config = NemotronHConfig(vocab_size=64, hidden_size=HIDDEN, layers_block_type=["linear_attention"],
                             mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=6, conv_kernel=4,
                             chunk_size=8, time_step_min=1e-6, initializer_range=0.3)
    torch.manual_seed(0)
    layer = NemotronHForCausalLM(config).eval().model.layers[0].mixer
    with torch.no_grad():  # steps from 1e-2 to 0.5: slow and fast heads
        dt = torch.exp(torch.linspace(math.log(1e-2), math.log(0.5), layer.num_heads))
        layer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
    return layer


def zero_states(step: Mamba2Step, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(step.spec.conv_shape(rows)), torch.zeros(step.spec.ssm_shape(rows))


def test_scan_forms_agree():
    generator = torch.Generator().manual_seed(1)
    b, h, s, p, n = 2, 4, 13, 8, 6
    x, b_, c = (torch.randn(b, h, s, d, generator=generator) for d in (p, n, n))
    dt = torch.rand(b, h, s, generator=generator) * 0.5
    a, state = -torch.arange(1, h + 1, dtype=torch.float32), torch.randn(b, h, p, n, generator=generator)
    y, final = recurrent_scan(x, dt, a, b_, c, state)
    for chunk in (1, 4, 5, 64):
        y_chunked, final_chunked = chunked_scan(x, dt, a, b_, c, state, chunk)
        torch.testing.assert_close(y_chunked, y, rtol=0, atol=ATOL)
        torch.testing.assert_close(final_chunked, final, rtol=0, atol=ATOL)


@torch.no_grad()
def test_chunks_padding_and_decode_equal_transformers(mixer):
    generator = torch.Generator().manual_seed(2)
    prompt, decoded = torch.randn(1, 19, HIDDEN, generator=generator), torch.randn(1, 3, HIDDEN, generator=generator)
    cache = DynamicCache(config=mixer.config)
    reference = [mixer(prompt, cache_params=cache)] + [mixer(decoded[:, i:i + 1], cache_params=cache) for i in range(3)]
    reference = torch.cat(reference, dim=1)

    step = Mamba2Step(mixer, prefill_seq_len=8)
    conv, ssm = zero_states(step, 1)
    outputs, at = [], 0
    for size in (8, 5, 6):  # chunks of the compiled length and shorter ones, right-padded to it
        chunk = torch.cat([prompt[:, at:at + size], torch.randn(1, 8 - size, HIDDEN, generator=generator)], dim=1)
        slots = torch.tensor([[*range(at, at + size)] + [-1] * (8 - size)])
        out = step(chunk, slots, conv, ssm)
        outputs.append(out.hidden_states[:, :size])
        conv, ssm, at = out.conv_state, out.ssm_state, at + size
    for i in range(3):
        out = step(decoded[:, i:i + 1], torch.tensor([[at + i]]), conv, ssm)
        outputs.append(out.hidden_states)
        conv, ssm = out.conv_state, out.ssm_state
    torch.testing.assert_close(torch.cat(outputs, dim=1), reference, rtol=0, atol=ATOL)
    torch.testing.assert_close(ssm, cache.layers[0].recurrent_states[0], rtol=0, atol=ATOL)


@torch.no_grad()
def test_a_request_start_drops_the_rows_state_and_other_rows_stay(mixer):
    """Three state rows holding garbage (NaN in one); batch row 0 starts a request in state row 2 (slot 0), batch row
    1 continues nothing (all padding) in row 0: row 2 ends as a fresh run's, rows 0 and 1 come back bit for bit."""
    generator = torch.Generator().manual_seed(3)
    step = Mamba2Step(mixer, prefill_seq_len=6)
    conv, ssm = torch.randn(step.spec.conv_shape(3), generator=generator), torch.randn(step.spec.ssm_shape(3))
    conv[2, 0, 0] = float("nan")
    hidden = torch.randn(2, 6, HIDDEN, generator=generator)
    slots = torch.tensor([[0, 1, 2, 3, -1, -1], [-1] * 6])
    out = step(hidden, slots, conv, ssm, batch_index=torch.tensor([[2], [0]]))
    fresh = step(hidden[:1], slots[:1], *zero_states(step, 1))
    torch.testing.assert_close(out.hidden_states[0, :4], fresh.hidden_states[0, :4], rtol=0, atol=0)
    torch.testing.assert_close(out.ssm_state[2], fresh.ssm_state[0], rtol=0, atol=0)
    torch.testing.assert_close(out.conv_state[2], fresh.conv_state[0], rtol=0, atol=0)
    assert torch.equal(out.conv_state[:2], conv[:2]) and torch.equal(out.ssm_state[:2], ssm[:2])


def test_padding_before_a_token_is_refused(mixer):
    step = Mamba2Step(mixer, prefill_seq_len=4)
    with pytest.raises(ValueError, match="padding \\(-1\\) before a valid token"):
        step(torch.zeros(1, 4, HIDDEN), torch.tensor([[0, -1, 1, 2]]), *zero_states(step, 1))

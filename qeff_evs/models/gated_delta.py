"""The gated delta rule (Gated DeltaNet, a hybrid model's linear attention) in standard ONNX ops, fp32 inside.

Per value head the recurrent state ``S`` is a ``(dk, dv)`` matrix; token ``t`` with query ``q_t``,
key ``k_t`` (both L2-normalised, ``q`` also scaled by ``dk ** -0.5``), value ``v_t``, log-decay
``g_t <= 0`` and write strength ``beta_t`` in (0, 1) does::

    S <- exp(g_t) * S
    S <- S + k_t (beta_t (v_t - S^T k_t))^T        (the delta rule: write the part S does not predict)
    o_t = S^T q_t

Two exact forms of this, both as in transformers' ``torch_recurrent_gated_delta_rule`` and
``torch_chunk_gated_delta_rule`` (in the transformers model folders that use them), the independent reference of the tests:

* :func:`recurrent_gated_delta_rule`: the loop above, one step per token (decode, ``S = 1``);
* :func:`chunked_gated_delta_rule`: chunks of ``C`` tokens. Inside a chunk the ``C`` sequential
  updates are one unit-lower-triangular system ``(I + A) X = B`` (the "UT transform", A strictly lower,
  ``A_ij = beta_i (k_i . k_j) exp(G_i - G_j)`` with ``G`` the chunk's cumulative log-decay); then one
  state update per chunk. The chunks are a Python loop, unrolled when traced: trace with the compiled
  sequence length itself.

ONNX has no triangular solve, so :func:`unit_lower_inverse` builds ``(I + A)^-1`` by block doubling
with matmuls only, exact in exact arithmetic (no truncated series; a Neumann/product series is exact
only with all ``log2 C`` factors and its terms grow like binomials when keys are alike) and as
stable as a triangular solve: ``T <- T - T O T`` where ``T`` inverts the diagonal blocks of size
``b`` and ``O`` holds the off-diagonal blocks that join pairs of them into blocks of size ``2b``.

For ``qaic-compile -convert-to-fp16`` (docs/design.md#numerics-on-the-card) nothing here overflows: only non-positive
log-decay differences are exponentiated (positive ones are clamped to 0 before ``exp`` and masked after it --
no ``-inf``, whose product with a zero mask would be NaN); the L2 norm divides by the vector's largest
entry before squaring; softplus is written as ``relu(x) + log1p(exp(-|x|))`` with a ``log1p`` that
keeps small arguments (a slow head's decay) in fp16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2_EPS = 1e-6  # transformers' l2norm epsilon (FLA's)
MAX_CHUNK = 64  # transformers' and FLA's chunk size
# Floor of the L2 norm's pre-scale: an all-zero vector (a padding token) stays zero instead of 0/0.
# The smallest normal fp16 number, so the card's converted graph divides by the same value.
SCALE_FLOOR = 2.0 ** -14


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """``x * rsqrt(sum(x^2, -1) + eps)`` (transformers' ``l2norm``), overflow-free in fp16.

    Any positive ``s`` gives the same value: ``(x / s) * rsqrt(sum((x / s)^2) + (sqrt(eps) / s)^2)``.
    With ``s`` the largest entry (floored at ``SCALE_FLOOR``) every square is at most 1, so a 128-wide
    sum cannot overflow fp16 (``sum(x^2)`` does once an entry passes 256), and ``sqrt(eps) / s`` stays
    at most 16.4 (``eps / s^2`` would be formed as ``eps * (1 / s^2)``, whose reciprocal overflows).
    """
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=SCALE_FLOOR)
    scaled = x / scale
    floor = eps ** 0.5 / scale
    return scaled * torch.rsqrt((scaled * scaled).sum(dim=-1, keepdim=True) + floor * floor)


def log1p(y: torch.Tensor) -> torch.Tensor:
    """``log(1 + y)`` for ``y >= 0`` without a Log1p op (ONNX has none), accurate in fp16 too.

    ``Log(1 + y)`` loses ``y`` below the spacing of numbers near 1 (fp16: ``1 + 1e-4 == 1``, so a slow
    head's ``softplus`` -- hence its decay -- became 0 in a converted graph). Goldberg's correction:
    with ``u = 1 + y`` rounded, ``log(u) * y / (u - 1)`` is accurate to a few ulps, and ``y`` itself
    where ``u`` rounded to 1.
    """
    u = 1 + y
    step = u - 1
    exact = step == 0
    return torch.where(exact, y, torch.log(u) * (y / torch.where(exact, torch.ones_like(step), step)))


def softplus(x: torch.Tensor) -> torch.Tensor:
    """``log(1 + exp(x))`` as ``relu(x) + log1p(exp(-|x|))``: no ``exp`` of a positive number."""
    return torch.relu(x) + log1p(torch.exp(-x.abs()))


def expm1(x: torch.Tensor) -> torch.Tensor:
    """``exp(x) - 1`` without an Expm1 op (ONNX has none), accurate in fp16 too (the ``log1p`` trick).

    A slow head decays its state by ``exp(g)`` with ``g ~ -1e-4`` per token: ``exp(g)`` rounds to 1 in
    fp16 (no decay at all), while ``expm1(g)`` keeps ``g``'s own precision. With ``u = exp(x)``
    rounded, ``(u - 1) * x / log(u)``; ``x`` where ``u`` rounded to 1, and ``-1`` where ``u - 1`` did
    (``u`` below half an ulp of 1: ``-1`` is then the nearest value anyway).
    """
    u = torch.exp(x)
    step = u - 1
    special = (step == 0) | (step == -1)
    ratio = x / torch.log(torch.where(special, torch.full_like(u, 2.0), u))
    return torch.where(special, torch.where(step == 0, x, step), step * ratio)


def decay(state: torch.Tensor, log_decay: torch.Tensor) -> torch.Tensor:
    """``state * exp(log_decay)`` as ``state + state * expm1(log_decay)``: the decrement of a slow head
    survives even where ``exp(log_decay)`` would round to 1 (the state kept in fp32 on an fp16 card)."""
    return state + state * expm1(log_decay)


def gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, beta)`` of the ``in_proj_a`` / ``in_proj_b`` outputs ``(..., Hv)``, fp32.

    ``g = -exp(A_log) * softplus(a + dt_bias)`` (log-decay, <= 0), ``beta = sigmoid(b)``, as
    transformers' Gated DeltaNet ``forward``. Computed in fp32 as transformers forces it.
    """
    g = -a_log.float().exp() * softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def causal_conv(mixed: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                valid_count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d over a chunk continuing ``conv_state``; returns ``(out, new_state)``.

    Args:
        mixed: ``(B, channels, S)`` the chunk's inputs, valid tokens first (right padding).
        conv_state: ``(B, channels, K - 1)`` the inputs of the ``K - 1`` tokens before the chunk
            (zeros before a request's first token).
        weight: ``(channels, 1, K)`` the ``nn.Conv1d`` weight (no bias in Qwen3.5).
        valid_count: ``(B,)`` int64 number of valid tokens of each row.
    Returns:
        ``out (B, channels, S)`` before the activation (valid where the token is valid) and
        ``new_state (B, channels, K - 1)``: the inputs of the row's last ``K - 1`` *valid* tokens
        (columns ``valid_count .. valid_count + K - 2`` of ``[conv_state, mixed]``), so right padding
        never enters the state and a row without valid tokens keeps its state exactly.
    """
    history = conv_state.shape[-1]
    width = weight.shape[-1]
    full = torch.cat([conv_state.to(mixed.dtype), mixed], dim=-1)  # (B, channels, K - 1 + S)
    # K shifted products (a depthwise conv; ONNX Runtime's grouped Conv is slow at this shape).
    seq_len = mixed.shape[-1]
    taps = weight.to(mixed.dtype)[:, 0]  # (channels, K)
    out = sum(full[:, :, i:i + seq_len] * taps[:, i:i + 1] for i in range(width))
    columns = valid_count.reshape(-1, 1, 1) + torch.arange(history, device=mixed.device).reshape(1, 1, history)
    new_state = torch.gather(full, 2, columns.expand(full.shape[0], full.shape[1], history))
    return out, new_state


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule token by token; returns ``(out (B, H, S, dv), final state (B, H, dk, dv))``.

    ``q``/``k`` ``(B, H, S, dk)`` normalised (``q`` scaled), ``v`` ``(B, H, S, dv)``, ``g``/``beta``
    ``(B, H, S)``, ``state`` ``(B, H, dk, dv)``, all fp32. Unrolled over ``S`` when traced (``S = 1``
    in a decode graph).
    """
    outputs = []
    for t in range(int(q.shape[2])):
        k_t = k[:, :, t:t + 1]  # (B, H, 1, dk)
        state = decay(state, g[:, :, t, None, None])
        delta = (v[:, :, t:t + 1] - k_t @ state) * beta[:, :, t, None, None]  # (B, H, 1, dv): v - S^T k
        state = state + k_t.transpose(-1, -2) @ delta
        outputs.append(q[:, :, t:t + 1] @ state)
    return torch.cat(outputs, dim=2), state


def chunk_size_for(seq_len: int, max_chunk: int = MAX_CHUNK) -> int:
    """The chunk size for a compiled length: ``max_chunk``, or the power of two covering a shorter ``seq_len``."""
    if seq_len < 1 or max_chunk < 1 or max_chunk & (max_chunk - 1):
        raise ValueError(
            f"need seq_len >= 1 and a power-of-two chunk size, got seq_len={seq_len}, chunk={max_chunk}")
    return min(max_chunk, 1 << (seq_len - 1).bit_length())


def _triangle_masks(size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inclusive, strict)`` fp32 lower-triangular masks ``(size, size)``: ``j <= i`` and ``j < i``."""
    rows = torch.arange(size, device=device)[:, None]
    cols = torch.arange(size, device=device)[None, :]
    return (cols <= rows).float(), (cols < rows).float()


def _doubling_masks(size: int, device) -> list[torch.Tensor]:
    """Per block size ``b`` = 1, 2, 4, .., size/2: the entries joining two ``b``-blocks into one ``2b``-block.

    ``(i, j)`` with ``i`` in the lower and ``j`` in the upper half of the same ``2b``-block.
    """
    rows = torch.arange(size, device=device)[:, None]
    cols = torch.arange(size, device=device)[None, :]
    masks, block = [], 1
    while block < size:
        same_pair = (rows // (2 * block)) == (cols // (2 * block))
        masks.append((same_pair & ((rows // block) % 2 == 1) & ((cols // block) % 2 == 0)).float())
        block *= 2
    return masks


def unit_lower_inverse(strict_lower: torch.Tensor) -> torch.Tensor:
    """``(I + A)^-1`` for strictly lower-triangular ``A (..., C, C)``, ``C`` a power of two; matmuls only.

    Block doubling: ``T`` starts as ``I`` (the inverse of the unit 1x1 diagonal blocks). With ``O`` the
    part of ``A`` that joins neighbouring ``b``-blocks (lower-left block of each ``2b``-block),
    ``T - T O T`` inverts the ``2b``-blocks, since
    ``[[X, 0], [L, Y]]^-1 = [[X^-1, 0], [-Y^-1 L X^-1, Y^-1]]``. ``log2 C`` rounds of two matmuls.
    """
    size = strict_lower.shape[-1]
    if size & (size - 1):
        raise ValueError(f"unit_lower_inverse needs a power-of-two size, got {size}; pad the chunk")
    inverse = torch.eye(size, dtype=strict_lower.dtype, device=strict_lower.device).expand_as(strict_lower)
    for mask in _doubling_masks(size, strict_lower.device):
        inverse = inverse - inverse @ ((strict_lower * mask) @ inverse)
    return inverse


def chunked_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor,
                             chunk_size: int = MAX_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over ``S`` tokens in chunks of ``chunk_size``; same I/O as :func:`recurrent_gated_delta_rule`.

    ``S`` is padded to a multiple of ``chunk_size`` with ``g = beta = 0`` and ``q = k = v = 0`` (tokens
    that leave the state exactly as it is); the caller masks its own padding the same way. Every
    exponent is ``<= 0`` (``G`` is non-increasing since ``g <= 0``).
    """
    if chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    batch, heads = k.shape[:2]  # symbols under tracing
    seq_len = int(k.shape[2])  # a constant of the traced graph: the chunk loop is unrolled for it
    pad = (-seq_len) % chunk_size
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    chunks = (seq_len + pad) // chunk_size

    def split(x: torch.Tensor) -> torch.Tensor:  # (B, H, S, D) -> (B, H, N, C, D)
        return x.reshape(batch, heads, chunks, chunk_size, x.shape[-1])

    q, k, v = split(q), split(k), split(v)
    g, beta = split(g[..., None]), split(beta[..., None])  # (B, H, N, C, 1)
    inclusive, strict = _triangle_masks(chunk_size, q.device)
    # Cumulative log-decay inside each chunk as a matmul with a triangle of ones: (B, H, N, C, 1).
    log_decay = inclusive @ g
    # exp(G_i - G_j) for j <= i; the other half is clamped to exp(0) and masked off, never exp(+x).
    pairwise = torch.exp(torch.clamp(log_decay - log_decay.transpose(-1, -2), max=0.0)) * strict
    k_beta, v_beta = k * beta, v * beta
    system = (k_beta @ k.transpose(-1, -2)) * pairwise  # strictly lower (B, H, N, C, C)
    solve = unit_lower_inverse(system)
    new_values = solve @ v_beta  # what each token writes before the state's own prediction
    decayed_keys = solve @ (k_beta * torch.exp(log_decay))  # how the start state enters those writes
    intra = (q @ k.transpose(-1, -2)) * (pairwise + torch.eye(chunk_size, device=q.device))
    last = log_decay[:, :, :, -1:]  # (B, H, N, 1, 1)
    q_decayed = q * torch.exp(log_decay)
    k_decayed = k * torch.exp(last - log_decay)

    outputs = []
    for i in range(chunks):
        v_new = new_values[:, :, i] - decayed_keys[:, :, i] @ state
        outputs.append(q_decayed[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = decay(state, last[:, :, i]) + k_decayed[:, :, i].transpose(-1, -2) @ v_new
    out = torch.cat(outputs, dim=2)  # (B, H, N * C, dv)
    return out[:, :, :seq_len], state

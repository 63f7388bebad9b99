"""The PyTorch reference language session keeps its retained state on its device between calls
(docs/design.md#the-runtime).

On CUDA a call must move only its per-call inputs to the GPU and its logits back, never the KV cache. No GPU here,
so the checks run on the CPU: a request through the engine gives bit-equal logits and state to the same calls made
the way the session made them before (every retained input fed from host arrays, every output read back), and a
call brings back to the host its logits only (``Tensor.cpu``, which on CUDA is the device-to-host copy).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qeff_evs.models.graph_io import RETAINED_SUFFIX, state_shapes
from qeff_evs.runtime.builders import engine_config
from qeff_evs.runtime.engine.single_request import Engine
from qeff_evs.runtime.export_bundle import open_export
from qeff_evs.runtime.inputs.prompt import video_question_pieces
from qeff_evs.runtime.media import video_from_file
from qeff_evs.runtime.sessions import sessions_for

NEW_TOKENS = 4


def host_state_run(module, shape, calls: list[dict[str, np.ndarray]]) -> tuple[list[np.ndarray], dict]:
    """The calls made as the session made them before: state in host arrays, fed whole and read back each call."""
    state = {name: np.zeros(dims, np.float32) for name, dims in state_shapes(shape).items()}
    logits = []
    for inputs in calls:
        feeds = {**state, **{name: np.asarray(value, np.float32) if name in state else value
                             for name, value in inputs.items()}}
        with torch.no_grad():
            outputs = {name: value.cpu().numpy() for name, value in module.run(feeds).items()}
        state = {name: outputs[name + RETAINED_SUFFIX] for name in state}
        logits.append(outputs["logits"])
    return logits, state


@pytest.fixture(scope="module")
def request_run(tiny_export, video_npy, question):
    """A request through the engine on the torch backend: every call's per-call inputs and logits, the session."""
    bundle = open_export(tiny_export)
    vision, language = sessions_for(bundle, "torch")
    calls, logits = [], []
    inner = language._call

    def recorded(inputs):
        calls.append({name: np.array(value) for name, value in inputs.items()})
        logits.append(np.array(inner(inputs)))
        return logits[-1]

    language._call = recorded  # an instance attribute: records this session's calls only
    engine = Engine(bundle.family, vision, language, engine_config(bundle, max_new_tokens=NEW_TOKENS))
    pieces = video_question_pieces(bundle.tokenizer, question, bundle.family.token_strings)
    engine.generate(engine.prepare(pieces, [video_from_file(video_npy, bundle)]), eos_ids=())
    return calls, logits, language


def test_state_on_the_device_gives_the_host_fed_logits_and_state(request_run):
    calls, logits, language = request_run
    assert len(calls) > NEW_TOKENS  # prefill chunks, then the decode steps
    reference, state = host_state_run(language.module, language.shape, calls)
    for got, want in zip(logits, reference, strict=True):
        np.testing.assert_array_equal(got, want)
    assert sorted(language.state) == sorted(state)
    for name, value in language.state.items():
        np.testing.assert_array_equal(value, state[name], err_msg=name)
    assert all(tensor.device == language.device for tensor in language.tensors.values())


def test_a_call_brings_back_only_its_logits(request_run, monkeypatch):
    calls, _, language = request_run
    moved = []
    to_host = torch.Tensor.cpu

    def spied(tensor, *args, **kwargs):
        moved.append(tuple(tensor.shape))
        return to_host(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", spied)
    decode = calls[-1]  # the last decode step, run again on the state the request left
    language._call(decode)
    assert moved == [(1, 1, language.shape.vocab)]  # the logits; no KV cache, no window


def test_state_writes_reach_the_next_call(tiny_export):
    """``state`` is the tensors' own memory on the CPU: a write into it is what the next call reads (the contract
    the ORT session keeps, which tests that plant garbage in a used cache rely on)."""
    language = sessions_for(open_export(tiny_export), "torch")[1]
    language.state["past_key.0"][...] = 7.0
    assert float(language.tensors["past_key.0"].min()) == 7.0

"""Run by QEfficient's own Python (a child process), never imported by qeff-evs: QEfficient's side of the comparison.

``python qefficient_driver.py REQUEST_JSON``. QEfficient pins its own transformers, so it lives in its own
environment; this script imports QEfficient, torch and numpy only (not qeff_evs), reads the request
written by ``qeff_evs.bench.vs_qefficient`` and writes back, next to it:

* ``qefficient.json``: the two ONNX graphs QEfficient exported (dual QPC: vision + language), its version,
  the export's seconds, or ``error`` (one line) where QEfficient failed;
* ``qefficient_positions.npy``: the ``(4, 1, N_padded)`` position ids QEfficient's host computes for the
  prompt (``prepare_inputs_for_generation``: token index, then M-RoPE t/h/w; padding -1).

The graphs are exported through QEfficient's public pieces as ``QEFFAutoModelForImageTextToText.export`` does
(its dummy inputs, dynamic axes and output names), with one change of inputs, not of code: the vision graph's
example image is the comparison's own frame size. Its stock example (a 14308-patch image for Qwen2.5-VL) traces
a (windows, 14308, 14308) attention mask, more memory than the export needs; the axes are dynamic either way.
Nothing of QEfficient is patched.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path


def export_graphs(request: dict, out: Path) -> dict:
    import numpy as np
    import torch

    import QEfficient
    from QEfficient import QEFFAutoModelForImageTextToText

    started = time.perf_counter()
    model = QEFFAutoModelForImageTextToText.from_pretrained(request["checkpoint"], kv_offload=True,
                                                            torch_dtype=torch.float32)
    hf = model.model
    seq_len = int(request["prefill_seq_len"])
    ids = torch.from_numpy(np.load(out / "qefficient_input_ids.npy"))
    grids = torch.tensor(request["image_grid_thw"], dtype=torch.int64)
    prepared = hf.prepare_inputs_for_generation(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "image_grid_thw": grids},
        prefill_seq_len=seq_len, batch_size=1)
    np.save(out / "qefficient_positions.npy", prepared["position_ids"].numpy().astype(np.int64))

    inputs = hf.get_dummy_inputs(kv_offload=True, prefill_seq_len=seq_len)
    axes = hf.get_onnx_dynamic_axes(kv_offload=True)
    names = hf.get_output_names(kv_offload=True)
    _, grid_h, grid_w = (int(v) for v in request["image_grid_thw"][0])
    patch_dim = int(inputs["vision"]["pixel_values"].shape[1])
    inputs["vision"]["pixel_values"] = torch.zeros((grid_h * grid_w, patch_dim), dtype=torch.float32)
    inputs["vision"]["image_grid_thw"] = torch.zeros((1, 1, grid_h, grid_w), dtype=torch.int64)
    export_dir = out / "qefficient_onnx"
    vision = model.vision_model.export(inputs["vision"], names["vision"], axes["vision"], export_dir=str(export_dir),
                                       offload_pt_weights=False)
    language = model.lang_model.export(inputs["lang"], names["lang"], axes["lang"], export_dir=str(export_dir),
                                       offload_pt_weights=True)
    return {"vision_onnx": str(Path(vision).resolve()), "language_onnx": str(Path(language).resolve()),
            "version": QEfficient.__version__,
            "transformers": __import__("transformers").__version__, "torch": torch.__version__,
            "export_seconds": time.perf_counter() - started}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: qefficient_driver.py REQUEST_JSON", file=sys.stderr)
        return 2
    request_path = Path(argv[1])
    request = json.loads(request_path.read_text())
    out = request_path.parent
    try:
        result = export_graphs(request, out)
    except BaseException as error:  # noqa: BLE001 - every failure becomes the report's one line
        traceback.print_exc()
        last = str(error).strip().splitlines()
        result = {"error": f"{type(error).__name__}: {last[-1] if last else ''}"[:300]}
    (out / "qefficient.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))

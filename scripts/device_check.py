"""The reference path on a GPU: the PyTorch backend on CUDA against ONNX Runtime on the CPU, one line per check.

Run by ``scripts/device_check.sh`` (which installs from local wheels first). Two kinds of check:

* ``pytest``: the test suite's PyTorch-backend parity tests (``-k torch`` over the files below); their torch
  sessions run on CUDA when it is present (``backends.torch_reference.torch_device``), and each compares
  against ONNX Runtime or transformers as it does on the CPU;
* ``e2e <family>``: per family, a tiny checkpoint saved with ``save_pretrained``, exported, and one video
  question answered by the engine on the torch backend on ``--device`` and on ONNX Runtime on the CPU: the
  greedy tokens must be equal and the prefill's top logits within ``--atol`` (fp32; TF32 is switched off, so
  cuBLAS and cuDNN run fp32 arithmetic).

Each check prints one line ``device_check <name>: PASS|FAIL <numbers>``; the exit status is the number of
checks that failed. ``--device cpu`` runs the same checks with no GPU (the test suite does, with
``--no-pytest``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5")
PARITY_TESTS = ("tests/test_continuous_batching.py", "tests/test_e2e_qwen2_5.py", "tests/test_e2e_qwen3.py",
                "tests/test_e2e_qwen3_5.py", "tests/test_kv_zero_once.py", "tests/test_serving.py")
# Tiny exports: one resolution (the merged grid divides for every family's patch size), one frame bucket.
RESOLUTION = {"qwen2_5_vl": (112, 112), "qwen3_vl": (128, 128), "qwen3_5": (128, 128)}
FRAMES, PREFILL, CTX_LEN, NEW_TOKENS = 4, 32, 256, 8
QUESTION = "What happens in this video?"


def line(name: str, ok: bool, detail: str) -> bool:
    print(f"device_check {name}: {'PASS' if ok else 'FAIL'} {detail}", flush=True)
    return ok


def environment(device: str) -> None:
    import onnxruntime
    import torch

    where = torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu"
    print(f"device_check environment: torch {torch.__version__} (cuda {torch.version.cuda}), onnxruntime "
          f"{onnxruntime.__version__}, device {device} ({where})", flush=True)


def pytest_check(device: str) -> bool:
    started = time.perf_counter()
    # The tests pick CUDA themselves when it is present; CUDA_VISIBLE_DEVICES="" keeps a CPU run on the CPU.
    env = None if device.startswith("cuda") else {**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:warnings", "-k", "torch", *PARITY_TESTS],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    tail = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    if done.returncode:
        sys.stdout.write(done.stdout[-4000:] + done.stderr[-2000:])
    return line("pytest torch parity", done.returncode == 0, f"{tail} ({time.perf_counter() - started:.0f} s)")


def e2e_check(family: str, device: str, workdir: Path, atol: float) -> bool:
    import numpy as np

    from qeff_evs.export.pipeline import ExportOptions, export_checkpoint
    from qeff_evs.models.tiny import save_tiny_checkpoint
    from qeff_evs.runtime.builders import answer, build_engine
    from qeff_evs.runtime.export_bundle import open_export
    from qeff_evs.runtime.inputs.synthetic import moving_square_video
    from qeff_evs.runtime.media import video_from_frames

    started = time.perf_counter()
    checkpoint = save_tiny_checkpoint(family, workdir / family / "checkpoint", seed=0)
    height, width = RESOLUTION[family]
    options = ExportOptions(0.5, (FRAMES,), ((height, width),), PREFILL, CTX_LEN, video_pruning_methods=("evs",))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_checkpoint(checkpoint, workdir / family / "export", options)
    bundle = open_export(workdir / family / "export")
    frames = moving_square_video(FRAMES, height, width, seed=3)
    results = {}
    for backend, on in (("ort", None), ("torch", device)):
        video = video_from_frames(frames, {"total_num_frames": FRAMES, "fps": 2.0}, bundle)
        engine = build_engine(bundle, backend, NEW_TOKENS, device=on)
        results[backend] = answer(bundle, engine, video, QUESTION)
        engine.close()
    ort, torch_ = results["ort"], results["torch"]
    ort_top, torch_top = np.asarray(ort.prefill_top_logits), np.asarray(torch_.prefill_top_logits)
    same_ids = ort_top[:, 0].tolist() == torch_top[:, 0].tolist()
    gap = float(np.abs(ort_top[:, 1] - torch_top[:, 1]).max()) if same_ids else float("inf")
    same_tokens = ort.generated_token_ids == torch_.generated_token_ids
    ok = same_tokens and gap <= atol and len(ort.generated_token_ids) > 0
    return line(f"e2e {family}", ok,
                f"torch on {device} vs ONNX Runtime on cpu: tokens {'equal' if same_tokens else 'DIFFER'} "
                f"({len(torch_.generated_token_ids)}), max top-logit gap {gap:.2e} (atol {atol:g}), "
                f"{len(ort.prompt_token_ids)} prompt tokens, {time.perf_counter() - started:.0f} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="torch device of the reference path (default: cuda if present)")
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"e2e families (default {','.join(FAMILIES)})")
    parser.add_argument("--no-pytest", action="store_true", help="skip the parity tests (the suite's own run)")
    parser.add_argument("--atol", type=float, default=1e-4, help="top-logit tolerance (default 1e-4, fp32)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the checkpoints and exports here")
    args = parser.parse_args(argv)

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"device_check environment: FAIL --device {device} but torch {torch.__version__} sees no CUDA device; "
              "install a CUDA build of torch from the wheels, or pass --device cpu")
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 arithmetic, as ONNX Runtime's CPU kernels
    torch.backends.cudnn.allow_tf32 = False
    environment(device)
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        parser.error(f"--families {unknown}: choose among {', '.join(FAMILIES)}")
    failed = 0
    if not args.no_pytest:
        failed += not pytest_check(device)
    with tempfile.TemporaryDirectory(prefix="device_check_") as scratch:
        workdir = args.workdir or Path(scratch)
        for family in families:
            try:
                failed += not e2e_check(family, device, workdir, args.atol)
            except Exception as error:  # one line per check, even when it raises
                traceback.print_exc()
                failed += not line(f"e2e {family}", False, f"{type(error).__name__}: {error}")
    print(f"device_check summary: {failed} of {len(families) + (not args.no_pytest)} checks failed", flush=True)
    return failed


if __name__ == "__main__":
    raise SystemExit(main())

"""vLLM's own reading of an export's quantization, in a fresh process: for each folder given, the engine config vLLM
builds before it starts an engine (``EngineArgs(model=folder).create_engine_config()``, with our platform's
start-up checks) and the quantization method it chose, or the error it raised.

Usage: ``python tests/vllm_quantization_child.py RESULT.json FOLDER...``; RESULT.json maps each folder to
``{"quantization": <method or None>}`` or ``{"error": <text>, "frames": <the files its traceback passed>}``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def main(result_path: str, *folders: str) -> None:
    os.environ["QEFF_EVS_BACKEND"] = "ort"
    from vllm.engine.arg_utils import EngineArgs

    results = {}
    for folder in folders:
        try:
            config = EngineArgs(model=folder, max_num_seqs=1).create_engine_config()
            results[folder] = {"quantization": config.model_config.quantization}
        except Exception as error:  # noqa: BLE001 - the text is the result
            frames = [frame.filename for frame in traceback.extract_tb(error.__traceback__)]
            results[folder] = {"error": f"{type(error).__name__}: {error}", "frames": frames}
    with open(result_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:])

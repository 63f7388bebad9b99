"""Runs vLLM's ``LLM.generate`` over a qeff-evs export in a fresh process and writes what came back.

vLLM resolves its platform once per process, at first use, from the installed platform plugins and the
environment; the plugin tests therefore run vLLM in a child process with ``QEFF_EVS_BACKEND`` set (the
parent pytest process may already hold vLLM's unspecified platform from other tests).

Usage: ``python tests/vllm_child.py JOB.json RESULT.json``. The job names the export, the engine
arguments and the requests (prompt token ids with ``video``/``image`` pads, ``.npy`` media, sampling
parameters); the result holds each request's prompt ids, generated ids and logprobs.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np


def main(job_path: str, result_path: str) -> None:
    job = json.loads(open(job_path).read())
    os.environ["QEFF_EVS_BACKEND"] = job["backend"]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    from vllm import LLM, SamplingParams

    llm = LLM(model=job["export"], **job["engine"])
    prompts, params = [], []
    for request in job["requests"]:
        media = {}
        for kind in ("video", "image"):
            arrays = [np.load(path) for path in request.get(kind, [])]
            if arrays:
                media[kind] = arrays if len(arrays) > 1 else arrays[0]
        prompt = {"prompt_token_ids": request["prompt_token_ids"]}
        if media:
            prompt["multi_modal_data"] = media
        prompts.append(prompt)
        params.append(SamplingParams(**request["sampling"]))
    results = []
    for output in llm.generate(prompts, params, use_tqdm=False):
        completion = output.outputs[0]
        logprobs = None if completion.logprobs is None else [
            {str(token): entry.logprob for token, entry in step.items()} for step in completion.logprobs]
        results.append(dict(prompt_token_ids=list(output.prompt_token_ids), token_ids=list(completion.token_ids),
                            text=completion.text, finish_reason=completion.finish_reason, logprobs=logprobs))
    with open(result_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

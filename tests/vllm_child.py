"""Runs vLLM's ``LLM`` over a qeff-evs export in a fresh process and writes what came back.

vLLM resolves its platform once per process, at first use, from the installed platform plugins and the
environment; the plugin tests therefore run vLLM in a child process with ``QEFF_EVS_BACKEND`` set (the
parent pytest process may already hold vLLM's unspecified platform from other tests).

Usage: ``python tests/vllm_child.py JOB.json RESULT.json``. The job names the export, the engine
arguments and:

* ``requests``: generated in one ``LLM.generate`` call (prompt token ids with ``video``/``image`` pads,
  ``.npy`` media, sampling parameters; ``structured_outputs`` as a dict);
* ``alone`` (optional): requests run one at a time after that call: each one's completion, or its error text;
* ``beam`` (optional): ``LLM.beam_search`` over token-id prompts.

The result holds, under ``generate``, each request's prompt ids and completions (token ids, text, finish
reason, logprobs); under ``alone`` the same, or ``{"error": text}``; under ``beam`` each prompt's beams.
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
    from vllm.sampling_params import BeamSearchParams, StructuredOutputsParams

    def prompt_of(request: dict) -> dict:
        media = {}
        for kind in ("video", "image"):
            arrays = [np.load(path) for path in request.get(kind, [])]
            if arrays:
                media[kind] = arrays if len(arrays) > 1 else arrays[0]
        prompt = {"prompt_token_ids": request["prompt_token_ids"]}
        if media:
            prompt["multi_modal_data"] = media
        if request.get("mm_processor_kwargs"):
            prompt["mm_processor_kwargs"] = request["mm_processor_kwargs"]
        return prompt

    def params_of(request: dict) -> SamplingParams:
        sampling = dict(request["sampling"])
        if "logit_bias" in sampling:  # JSON keys are strings; vLLM's are token ids
            sampling["logit_bias"] = {int(k): v for k, v in sampling["logit_bias"].items()}
        if "structured_outputs" in sampling:
            sampling["structured_outputs"] = StructuredOutputsParams(**sampling["structured_outputs"])
        return SamplingParams(**sampling)

    def completion(c) -> dict:
        logprobs = None if c.logprobs is None else [
            {str(token): entry.logprob for token, entry in step.items()} for step in c.logprobs]
        return dict(token_ids=list(c.token_ids), text=c.text, finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason, logprobs=logprobs)

    llm = LLM(model=job["export"], **job["engine"])
    results: dict = {"generate": []}
    requests = job.get("requests", [])
    if requests:
        outputs = llm.generate([prompt_of(r) for r in requests], [params_of(r) for r in requests], use_tqdm=False)
        for output in outputs:
            completions = [completion(c) for c in output.outputs]
            results["generate"].append(dict(completions[0], prompt_token_ids=list(output.prompt_token_ids),
                                            completions=completions))
    results["alone"] = []
    for request in job.get("alone", []):
        try:
            (output,) = llm.generate([prompt_of(request)], [params_of(request)], use_tqdm=False)
            results["alone"].append(completion(output.outputs[0]))
        except Exception as error:  # noqa: BLE001 - the text is the result
            results["alone"].append({"error": f"{type(error).__name__}: {error}"})
    if "beam" in job:
        beam = job["beam"]
        outputs = llm.beam_search([{"prompt_token_ids": ids} for ids in beam["prompts"]],
                                  BeamSearchParams(**beam["params"]))
        results["beam"] = [[dict(tokens=list(s.tokens), cum_logprob=s.cum_logprob) for s in o.sequences]
                           for o in outputs]
    with open(result_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""Every vLLM engine argument and sampling parameter is honoured or refused, one line each.

``qeff_evs.vllm.settings.table`` holds one row per ``EngineArgs`` field and per ``SamplingParams`` field; these
tests hold every row to what it says:

* the rows are exactly vLLM 0.32's arguments and parameters, and docs/settings.md's tables are rendered from them;
* start-up: for every row with an example value, vLLM builds its config over the export with it (a child
  process with the plugin active): a refused row fails with its own line, a row vLLM refuses fails in vLLM,
  an honoured one starts;
* behaviour: one vLLM engine (``LLM.generate``, child process) answers a batch of greedy requests, each
  using one honoured sampling parameter, and each answer equals vLLM's documented rule applied to the
  language graph's own logits, run on ONNX Runtime outside vLLM (``helpers.graph_oracle``): penalties,
  min_tokens, stop strings and token ids, ignore_eos, logit_bias, allowed_token_ids, bad_words, n, min_p,
  special tokens in the text, structured outputs, a custom logits processor with extra_args, a thinking
  budget, beam search; logprobs equal ``log_softmax`` of the graph's logits within 1e-4; the refused
  parameters fail alone with their line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm.v1.worker.worker_base")
pytest.importorskip("blake3", reason="vLLM's engine packages are missing: run bash scripts/install.sh --test")

from transformers import AutoConfig, AutoTokenizer, GenerationConfig  # noqa: E402
from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.tokenizers import get_tokenizer  # noqa: E402

from conftest import SERVED_CTX_LEN as CTX_LEN, SERVED_FULL_BATCH as FULL_BATCH, SERVED_PREFILL  # noqa: E402
from helpers.graph_oracle import GraphOracle  # noqa: E402
from helpers.vllm_noise import reference_noise  # noqa: E402
from qeff_evs.runtime.inputs.prompt import chat_pieces  # noqa: E402
from qeff_evs.runtime.inputs.synthetic import moving_square_video  # noqa: E402
from qeff_evs.runtime.export_bundle import open_export  # noqa: E402
from qeff_evs.runtime.media import video_from_file  # noqa: E402
from qeff_evs.vllm.settings import table as settings  # noqa: E402
from qeff_evs.vllm.settings.table import ENGINE_SETTINGS, HONOURED, NO_EFFECT, REFUSED, SAMPLING_SETTINGS, VLLM_REFUSES  # noqa: E402

TESTS = Path(__file__).parent
SETTINGS_PAGE = TESTS.parent / "docs" / "settings.md"
NEW_TOKENS = 6
# Thinking markers that are one token each in the tiny vocabulary (vLLM 0.32's budget counts the extra tokens of a
# multi-token start marker as thinking; "<think>" is 6 tokens here, 1 in Qwen's vocabulary).
THINK = ("@", "#")
ENGINE = dict(max_model_len=CTX_LEN, max_num_seqs=FULL_BATCH, max_num_batched_tokens=SERVED_PREFILL,
              enable_prefix_caching=False, video_pruning_rate=0.5, seed=0, max_logprobs=20,
              logits_processors=["helpers.logits_processors:ForceToken"],
              reasoning_config={"reasoning_start_str": THINK[0], "reasoning_end_str": THINK[1]})


def child(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "QEFF_EVS_BACKEND"}
    return subprocess.run([sys.executable, str(TESTS / script), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


# --- the table ---------------------------------------------------------------------------------------


def test_rows_are_exactly_vllms_arguments_and_parameters():
    engine_args = [f.name for f in dataclasses.fields(AsyncEngineArgs)]  # the server's: EngineArgs + request logging
    sampling = [name for name in SamplingParams.__struct_fields__ if not name.startswith("_")]
    assert sorted(s.name for s in ENGINE_SETTINGS) == sorted(engine_args)
    assert sorted(s.name for s in SAMPLING_SETTINGS) == sorted(sampling)
    for s in ENGINE_SETTINGS + SAMPLING_SETTINGS:
        assert s.verdict in (HONOURED, REFUSED, VLLM_REFUSES, NO_EFFECT), s
        assert s.verdict != REFUSED or s.read is not None or s.via, f"{s.name}: a refused row needs its check"
        assert s.verdict == NO_EFFECT or s.verdict == HONOURED or s.example is not settings._UNSET or \
            s in SAMPLING_SETTINGS, f"{s.name}: a refused row needs an example the tests set"


def test_every_named_test_exists():
    for s in ENGINE_SETTINGS + SAMPLING_SETTINGS:
        if not s.test:
            continue
        file, _, name = s.test.partition("::")
        source = (TESTS / file.split(" ")[0]).read_text()
        assert not name or re.search(rf"^def {name}\(", source, flags=re.M), f"{s.name}: {s.test} does not exist"


def test_settings_page_table_is_the_code_table():
    text = SETTINGS_PAGE.read_text()
    assert settings.settings_table(ENGINE_SETTINGS, "engine argument") in text
    assert settings.settings_table(SAMPLING_SETTINGS, "sampling parameter") in text
    assert settings.settings_table(settings.named(ENGINE_SETTINGS, settings.NAMED_ENGINE), "engine argument") in text
    assert settings.settings_table(settings.named(SAMPLING_SETTINGS, settings.NAMED_SAMPLING), "sampling parameter") in text
    assert settings.settings_groups(ENGINE_SETTINGS) in text
    # The counts too: the whole page as scripts/render_settings_page.py renders it.
    assert settings.settings_page(text) == text, "run .venv/bin/python scripts/render_settings_page.py"


def test_refused_sampling_parameters_name_themselves():
    assert settings.sampling_refusals(SamplingParams(max_tokens=4)) == []
    lines = settings.sampling_refusals(SamplingParams(max_tokens=4, prompt_logprobs=2))
    assert lines == ["prompt_logprobs=2: the language graph returns the last position's logits only; drop "
                     "prompt_logprobs"]


def test_additional_config_keys_other_than_qeff_evs_own_are_refused():
    """--additional-config: qeff-evs's own keys (plugin.ADDITIONAL_CONFIG_KEYS) and the keys vLLM fills from its own
    arguments pass this row; any other key is named in one line (a key meant for another platform would do nothing)."""
    from types import SimpleNamespace

    from qeff_evs.vllm.plugin import ADDITIONAL_CONFIG_KEYS, DEVICE_IDS_KEY

    row = next(s for s in ENGINE_SETTINGS if s.name == "additional_config")
    assert DEVICE_IDS_KEY in ADDITIONAL_CONFIG_KEYS
    for fine in (None, {}, {DEVICE_IDS_KEY: "0"}, {"gdn_prefill_backend": "triton"}):
        assert row.refusal(SimpleNamespace(additional_config=fine)) is None, fine
    line = row.refusal(SimpleNamespace(additional_config={DEVICE_IDS_KEY: "0", "devices": "0+1", "x": 2}))
    assert line.startswith("additional_config={'devices': '0+1', 'x': 2}: keys the qeff-evs platform does not read "
                           f"(it reads {', '.join(ADDITIONAL_CONFIG_KEYS)};")


# --- start-up: every engine argument with an example --------------------------------------------------


def old_layout(export: Path, folder: Path) -> Path:
    """A copy of ``export`` laid out as older exports were: the tokenizer (and a config) in tokenizer/."""
    old = folder / "old_export"
    shutil.copytree(export, old)
    (old / "tokenizer").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        if (old / name).is_file():
            shutil.copy2(old / name, old / "tokenizer" / name)
            if name != "config.json":
                (old / name).unlink()
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["files"]["tokenizer"] = "tokenizer"
    (old / "manifest.json").write_text(json.dumps(manifest))
    assert open_export(old).tokenizer.encode("hello") == open_export(export).tokenizer.encode("hello")
    return old


@pytest.fixture(scope="module")
def export(served_export):
    return served_export("qwen2_5_vl")


@pytest.fixture(scope="module")
def start_up(export, tmp_path_factory):
    checkpoint, folder = export
    base = tmp_path_factory.mktemp("settings") / "base.json"
    base.write_text(json.dumps(dict(max_num_seqs=FULL_BATCH, video_pruning_rate=0.5,
                                    checkpoint=str(checkpoint), old_export=str(old_layout(folder, base.parent)))))
    result = base.with_name("result.json")
    done = child("vllm_settings_child.py", str(folder), str(base), str(result))
    assert done.returncode == 0, done.stderr[-5000:]
    return json.loads(result.read_text())


def test_every_engine_argument_is_honoured_or_refused_at_start_up(start_up):
    assert start_up.pop("<baseline>") == "ok"
    wrong = []
    for s in ENGINE_SETTINGS:
        if s.name not in start_up:
            continue
        outcome = start_up[s.name]
        ours = re.findall(r"^  - (\w+)=", outcome, flags=re.M)
        if s.verdict == HONOURED and outcome != "ok":
            wrong.append(f"{s.name} is honoured but start-up failed: {outcome[:300]}")
        elif s.verdict == REFUSED and ours != [s.via or s.name]:
            wrong.append(f"{s.name} must be refused with exactly its own line, got: {outcome[:400]}")
        elif s.verdict == REFUSED and not s.via and s.how not in outcome:
            wrong.append(f"{s.name}: its refusal line is not the table's: {outcome[:400]}")
        elif s.verdict == VLLM_REFUSES and (outcome == "ok" or ours):
            wrong.append(f"{s.name}: vLLM itself must refuse it, got: {outcome[:300]}")
    assert not wrong, "\n".join(wrong)


def test_the_headline_refusals_at_start_up(start_up):
    """The headline settings that are refused: each with a line that says why and what to do."""
    assert "LoRA is not supported for QeffEvs" in start_up["enable_lora"]  # vLLM's own refusal (0.34)
    assert "enable_prompt_embeds=True: the language graph embeds token ids itself" in start_up["enable_prompt_embeds"]
    assert "num_gpu_blocks_override=3: the KV cache lives in the export's graphs" in start_up["num_gpu_blocks_override"]
    assert "kv_cache_dtype='fp8': the KV cache lives in the export's graphs" in start_up["kv_cache_dtype"]
    assert "speculative_config=" in start_up["speculative_config"]


# --- the export folder is a model folder ---------------------------------------------------------------


def test_export_folder_is_a_model_folder(export):
    """transformers' Auto classes read the checkpoint's tokenizer, config and generation config from the export."""
    checkpoint, folder = export
    ours, theirs = AutoTokenizer.from_pretrained(folder), AutoTokenizer.from_pretrained(checkpoint)
    text = "what moves here? <|video_pad|> 12 frames"
    assert ours.encode(text) == theirs.encode(text) and len(ours.encode(text)) > 3
    assert ours.chat_template == theirs.chat_template
    messages = [{"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(messages, tokenize=False)
    config = AutoConfig.from_pretrained(folder)
    assert config.model_type == AutoConfig.from_pretrained(checkpoint).model_type
    assert GenerationConfig.from_pretrained(folder).eos_token_id == list(open_export(folder).manifest.special_tokens.eos)


def test_an_older_export_still_serves(start_up):
    """Exports whose tokenizer sits in ``tokenizer/`` (manifest role "tokenizer"): the platform points vLLM there."""
    assert start_up["<old layout tokenizer>"].endswith("/tokenizer")


# --- behaviour through LLM.generate ----------------------------------------------------------------------


class Case:
    """One request: its prompt, its sampling parameters, and vLLM's documented rule for its greedy tokens."""

    def __init__(self, text: str, sampling: dict, video: str | None = None):
        self.text, self.sampling, self.video = text, dict(dict(temperature=0.0, max_tokens=NEW_TOKENS), **sampling), video


@pytest.fixture(scope="module")
def world(export, tmp_path_factory):
    """The export, its tokenizer, a clip, the graph oracle and every request's prompt."""
    folder = export[1]
    bundle = open_export(folder)
    clip = tmp_path_factory.mktemp("settings_media") / "clip.npy"
    np.save(clip, moving_square_video(8, 112, 112, seed=11))
    tok = bundle.tokenizer

    def pieces(text: str, video: bool = False):
        content = ([{"type": "video"}] if video else []) + [{"type": "text", "text": text}]
        return chat_pieces(tok, content)

    def vllm_ids(text: str, video: bool = False) -> list[int]:
        ids = []
        for piece in pieces(text, video):
            ids += list(piece.ids) if piece.media_item is None else [bundle.family.special_tokens().video_pad]
        return ids

    return dict(bundle=bundle, tok=tok, clip=clip, pieces=pieces, vllm_ids=vllm_ids, oracle=GraphOracle(bundle),
                media=lambda video: [video_from_file(clip, bundle)] if video else [])


PROMPT = "count the frames and say why"
JSON_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
               "required": ["answer"], "additionalProperties": False}


@pytest.fixture(scope="module")
def plain(world):
    """Greedy tokens of PROMPT with no parameter: the oracle's, the base every rule starts from."""
    return world["oracle"].greedy(world["pieces"](PROMPT), [], 12, lambda logits, _: logits)


@pytest.fixture(scope="module")
def cases(world, plain):
    tok, eos = world["tok"], list(world["bundle"].manifest.special_tokens.eos)
    special = world["bundle"].family.special_tokens().vision_start
    word = tok.decode([plain[0]]).strip() or "frames"
    stop_text = tok.decode(plain[2:4])
    return {
        "repetition": Case(PROMPT, dict(repetition_penalty=0.2)),  # below 1: the prompt's tokens are favoured
        "frequency_presence": Case(PROMPT, dict(frequency_penalty=0.9, presence_penalty=0.6, max_tokens=10)),
        "stop_token_ids": Case(PROMPT, dict(stop_token_ids=[plain[1]])),
        "min_tokens": Case(PROMPT, dict(stop_token_ids=[plain[1]], min_tokens=4)),
        "eos_biased": Case(PROMPT, dict(logit_bias={eos[0]: 100.0})),
        "ignore_eos": Case(PROMPT, dict(logit_bias={eos[0]: 100.0}, ignore_eos=True)),
        "logit_bias": Case(PROMPT, dict(logit_bias={plain[0]: -100.0, 5: 3.0})),
        "allowed": Case(PROMPT, dict(allowed_token_ids=[5, 17, 40, plain[3]])),
        "bad_words": Case(PROMPT, dict(bad_words=[word])),
        "n": Case(PROMPT, dict(n=2, temperature=1.0, min_p=1.0)),  # min_p 1: only the most likely token survives
        "min_p": Case(PROMPT, dict(temperature=1.0, min_p=1.0, seed=3)),
        "stop": Case(PROMPT, dict(stop=[stop_text], max_tokens=10)),
        "stop_included": Case(PROMPT, dict(stop=[stop_text], include_stop_str_in_output=True, max_tokens=10)),
        "special_skipped": Case(PROMPT, dict(logit_bias={special: 100.0}, max_tokens=3)),
        "special_kept": Case(PROMPT, dict(logit_bias={special: 100.0}, max_tokens=3, skip_special_tokens=False)),
        "structured": Case("answer yes or no", dict(structured_outputs={"choice": ["yes", "no"]}, max_tokens=8)),
        "json_schema": Case("answer in JSON", dict(structured_outputs={"json": JSON_SCHEMA, "disable_any_whitespace": True},
                                                         max_tokens=24)),
        "custom_processor": Case(PROMPT, dict(extra_args={"force_token": 40})),
        "logprobs_text": Case(PROMPT, dict(logprobs=5, logprob_token_ids=None)),
        "logprobs_video": Case("what moves?", dict(logprobs=4, max_tokens=4), video="clip"),
        "budget": Case(PROMPT + " " + THINK[0], dict(thinking_token_budget=2, max_tokens=8)),
        "seeded": Case(PROMPT, dict(temperature=0.8, top_k=40, top_p=0.9, seed=1234, max_tokens=8)),
    }


# Run one at a time after the batch: refused ones, and logprob_token_ids (vLLM 0.32's sampler gives the whole batch
# the specific-token logprobs once one request asks for them, whatever the others asked: the same on a GPU).
ALONE = {"prompt_logprobs": dict(prompt_logprobs=1), "prompt_logprob_start": dict(prompt_logprob_start=1),
         "prompt_logprob_token_ids": dict(prompt_logprob_token_ids=[[1]]),
         "logprob_token_ids": dict(logprobs=2, logprob_token_ids=[5, 17], max_tokens=3),
         "max_logprobs": dict(logprobs=25, max_tokens=2), "mm_processor_kwargs": dict(max_tokens=2)}


@pytest.fixture(scope="module")
def answers(world, cases, export, tmp_path_factory):
    def job(case: Case) -> dict:
        sampling = {k: v for k, v in case.sampling.items() if v is not None}
        if "logit_bias" in sampling:
            sampling["logit_bias"] = {int(k): v for k, v in sampling["logit_bias"].items()}
        ids = world["vllm_ids"](case.text, case.video is not None)
        if case.text.endswith(THINK[0]):  # the thinking marker as the tokenizer encodes it alone (vLLM's rule)
            ids = world["vllm_ids"](case.text[:-len(THINK[0])].rstrip()) + world["tok"].encode(
                THINK[0], add_special_tokens=False)
        return dict(prompt_token_ids=ids, video=[str(world["clip"])] if case.video else [], sampling=sampling)

    folder = tmp_path_factory.mktemp("settings_run")
    payload = dict(export=str(export[1]), backend="ort", engine=ENGINE, requests=[job(c) for c in cases.values()],
                   alone=[dict(job(Case("what moves?", s, video="clip")), mm_processor_kwargs={"fps": 2, "num_frames": 4})
                          if name == "mm_processor_kwargs" else job(Case(PROMPT, s)) for name, s in ALONE.items()],
                   beam=dict(prompts=[world["vllm_ids"](PROMPT)], params=dict(beam_width=2, max_tokens=3,
                                                                             ignore_eos=True)))
    (folder / "job.json").write_text(json.dumps(payload))
    done = child("vllm_child.py", str(folder / "job.json"), str(folder / "result.json"))
    assert done.returncode == 0, done.stderr[-6000:]
    result = json.loads((folder / "result.json").read_text())
    result["by_case"] = dict(zip(cases, result["generate"]))
    result["jobs"] = dict(zip(cases, payload["requests"]))
    result["alone"] = dict(zip(ALONE, result["alone"]))
    result["by_case"]["logprob_token_ids"] = result["alone"]["logprob_token_ids"]
    return result


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def mask(logits: np.ndarray, tokens) -> np.ndarray:
    logits[list(tokens)] = -np.inf
    return logits


def rules(world, plain, case_name: str, case: Case):
    """vLLM's documented rule for one request: ``(rule(logits, generated), stop ids)`` for the oracle's greedy."""
    s, eos = case.sampling, list(world["bundle"].manifest.special_tokens.eos)
    stops = ([] if s.get("ignore_eos") else eos) + list(s.get("stop_token_ids") or [])
    prompt = np.asarray(world["vllm_ids"](case.text), dtype=np.int64)

    def rule(logits, generated):
        if "logit_bias" in s:  # vLLM's LogitBiasLogitsProcessor: added to the logits
            for token, bias in s["logit_bias"].items():
                logits[int(token)] += bias
        if "allowed_token_ids" in s:  # everything else masked
            logits = mask(logits, set(range(len(logits))) - set(s["allowed_token_ids"]))
        if "bad_words" in s:  # the last token of a bad word whose prefix the output ends with
            params = SamplingParams(bad_words=s["bad_words"])
            params.update_from_tokenizer(get_tokenizer(str(world["bundle"].export_dir)))  # vLLM's tokenization
            for seq in params._bad_words_token_ids:
                if len(seq) == 1 or generated[-(len(seq) - 1):] == seq[:-1]:
                    logits = mask(logits, [seq[-1]])
        if len(generated) < s.get("min_tokens", 0):  # MinTokensLogitsProcessor: every stop token masked
            logits = mask(logits, eos + list(s.get("stop_token_ids") or []))
        counts = np.bincount(np.asarray(generated, dtype=np.int64), minlength=len(logits))[:len(logits)]
        if s.get("repetition_penalty", 1.0) != 1.0:  # prompt and output tokens: divide positive, multiply negative
            seen = np.zeros(len(logits), dtype=bool)
            seen[prompt] = True
            seen[counts > 0] = True
            p = s["repetition_penalty"]
            logits = np.where(seen, np.where(logits > 0, logits / p, logits * p), logits)
        logits = logits - s.get("frequency_penalty", 0.0) * counts - s.get("presence_penalty", 0.0) * (counts > 0)
        return logits

    return rule, stops


GREEDY_CASES = ["repetition", "frequency_presence", "stop_token_ids", "min_tokens", "eos_biased", "ignore_eos",
                "logit_bias", "allowed", "bad_words", "min_p", "logprobs_text"]


def test_plain_greedy_is_long_enough_to_tell_the_rules_apart(plain):
    assert len(plain) >= 8, plain


@pytest.mark.parametrize("name", GREEDY_CASES)
def test_sampling_parameter_follows_vllms_rule_on_the_graph_logits(name, world, plain, cases, answers):
    case = cases[name]
    rule, stops = rules(world, plain, name, case)
    expected = world["oracle"].greedy(world["pieces"](case.text), [], case.sampling["max_tokens"], rule, stops)
    got = answers["by_case"][name]
    assert got["token_ids"] == expected, (name, got, expected)
    finish = "stop" if expected and expected[-1] in stops else "length"
    assert got["finish_reason"] == finish


def test_the_rules_changed_the_tokens(world, plain, cases, answers):
    """Each parameter above really acted: its tokens differ from plain greedy where the rule says they must."""
    by = answers["by_case"]
    assert by["stop_token_ids"]["token_ids"] == plain[:2]
    assert plain[1] not in by["min_tokens"]["token_ids"][:4] and len(by["min_tokens"]["token_ids"]) > 2
    eos = world["bundle"].manifest.special_tokens.eos[0]
    assert by["eos_biased"]["token_ids"] == [eos] and by["ignore_eos"]["token_ids"] == [eos] * NEW_TOKENS
    assert by["logit_bias"]["token_ids"][0] != plain[0]
    assert set(by["allowed"]["token_ids"]) <= {5, 17, 40, plain[3]}
    for name in ("repetition", "frequency_presence", "bad_words"):
        assert by[name]["token_ids"] != plain[:len(by[name]["token_ids"])], name


def test_n_gives_n_completions(plain, answers):
    completions = answers["by_case"]["n"]["completions"]
    assert [c["token_ids"] for c in completions] == [plain[:NEW_TOKENS]] * 2


def test_stop_strings_cut_the_text_as_vllm_documents(world, plain, cases, answers):
    tok = world["tok"]
    stop = cases["stop"].sampling["stop"][0]
    k = next(k for k in range(1, len(plain) + 1) if stop in tok.decode(plain[:k], skip_special_tokens=True))
    text = tok.decode(plain[:k], skip_special_tokens=True)
    for name, kept in (("stop", text[:text.index(stop)]), ("stop_included", text[:text.index(stop) + len(stop)])):
        got = answers["by_case"][name]
        assert got["token_ids"] == plain[:k] and got["finish_reason"] == "stop" and got["stop_reason"] == stop
        assert got["text"] == kept, name


def test_special_tokens_in_the_text(world, answers):
    special = world["tok"].convert_ids_to_tokens(world["bundle"].family.special_tokens().vision_start)
    skipped, kept = answers["by_case"]["special_skipped"], answers["by_case"]["special_kept"]
    assert skipped["token_ids"] == kept["token_ids"] == [world["bundle"].family.special_tokens().vision_start] * 3
    assert skipped["text"].strip() == "" and kept["text"].replace(" ", "") == special * 3


def test_structured_output_is_a_choice_picked_on_the_graph_logits(world, cases, answers):
    tok, case = world["tok"], cases["structured"]
    choices = case.sampling["structured_outputs"]["choice"]
    eos = list(world["bundle"].manifest.special_tokens.eos)
    pieces = {t: tok.decode([t]) for t in range(len(tok))}

    def rule(logits, generated):
        text = tok.decode(generated)
        if text in choices:
            return mask(logits, set(range(len(logits))) - set(eos))  # the grammar is complete: only a stop token
        allowed = [t for t, piece in pieces.items() if piece and any(c.startswith(text + piece) for c in choices)]
        return mask(logits, set(range(len(logits))) - set(allowed))

    expected = world["oracle"].greedy(world["pieces"](case.text), [], case.sampling["max_tokens"], rule, eos)
    got = answers["by_case"]["structured"]
    assert got["text"] in choices and got["token_ids"] == expected


def test_structured_output_follows_a_json_schema(world, answers):
    """A JSON schema through vLLM's grammar bitmask: the random model's answer is a document the schema accepts."""
    got = answers["by_case"]["json_schema"]
    assert got["finish_reason"] == "stop", got
    document = json.loads(got["text"])
    assert set(document) == {"answer"} and document["answer"] in ("yes", "no"), got["text"]


def test_seeded_sampling_is_vllms_stream_on_the_graph_logits(world, cases, answers):
    """A seeded request draws, at each step, the Gumbel-max of the graph's logits (temperature, top-k and top-p
    applied) and vLLM 0.34's noise for (seed, position, token), the reference written out in helpers.vllm_noise."""
    case = cases["seeded"]
    p = case.sampling
    prompt_len = len(world["vllm_ids"](case.text))

    def rule(logits, generated):
        scaled = logits.astype(np.float32) / np.float32(p["temperature"])
        kth = np.sort(scaled)[-p["top_k"]]
        scaled[scaled < kth] = -np.inf
        order = np.argsort(scaled, kind="stable")
        probs = np.exp(scaled[order] - scaled.max())
        drop = np.cumsum(probs / probs.sum()) <= 1 - p["top_p"]
        drop[-1] = False
        scaled[order[drop]] = -np.inf
        return scaled + reference_noise(p["seed"], prompt_len + len(generated) - 1, len(logits))

    eos = list(world["bundle"].manifest.special_tokens.eos)
    expected = world["oracle"].greedy(world["pieces"](case.text), [], p["max_tokens"], rule, eos)
    got = answers["by_case"]["seeded"]["token_ids"]
    assert got == expected
    assert got != world["oracle"].greedy(world["pieces"](case.text), [], p["max_tokens"], lambda x, _: x)


def test_custom_logits_processor_with_extra_args(answers):
    assert answers["by_case"]["custom_processor"]["token_ids"] == [40] * NEW_TOKENS


@pytest.mark.parametrize("name", ["logprobs_text", "logprobs_video", "logprob_token_ids"])
def test_logprobs_are_log_softmax_of_the_graph_logits(name, world, cases, answers):
    case = cases[name] if name in cases else Case(PROMPT, ALONE[name])
    got = answers["by_case"][name]
    video = case.video is not None
    rows = world["oracle"].logits(world["pieces"](case.text, video), world["media"](video), got["token_ids"])
    assert len(got["logprobs"]) == len(got["token_ids"])
    for step, (token, returned) in enumerate(zip(got["token_ids"], got["logprobs"])):
        reference = log_softmax(rows[step])
        assert token == int(np.argmax(rows[step]))
        wanted = set(case.sampling.get("logprob_token_ids") or []) | {token}
        if not case.sampling.get("logprob_token_ids"):
            wanted |= {int(t) for t in np.argsort(-reference)[:case.sampling["logprobs"]]}
        assert {int(t) for t in returned} == wanted
        for t, value in returned.items():
            assert abs(value - reference[int(t)]) < 1e-4, (step, t, value, reference[int(t)])


def test_thinking_budget_forces_the_end_of_thinking(world, cases, answers):
    """vLLM's thinking budget: after ``thinking_token_budget`` thinking tokens the end string's tokens are forced."""
    got = answers["by_case"]["budget"]
    end = world["tok"].encode(THINK[1], add_special_tokens=False)
    prompt = answers["jobs"]["budget"]["prompt_token_ids"]
    budget = cases["budget"].sampling["thinking_token_budget"]

    def next_token(rows, generated):
        if budget <= len(generated) < budget + len(end):
            return end[len(generated) - budget]
        return int(np.argmax(rows[-1]))

    tokens: list[int] = []

    def feed(rows):
        tokens.append(next_token(rows, tokens))
        return None if len(tokens) >= cases["budget"].sampling["max_tokens"] else tokens[-1]

    world["oracle"].run([type(world["pieces"](PROMPT)[0])(ids=tuple(prompt))], [], feed)
    assert got["token_ids"] == tokens[:len(got["token_ids"])] and got["token_ids"][budget:budget + len(end)] == end


def test_beam_search_keeps_the_best_cumulative_logprobs(world, answers):
    """vLLM's beam search (2 beams, 3 tokens, EOS ignored): at each step every beam offers its 2 x width most
    likely next tokens and the width best cumulative log-probabilities stay; the graph's logits decide."""
    prompt = answers["jobs"]["repetition"]["prompt_token_ids"]
    pieces = [type(world["pieces"](PROMPT)[0])(ids=tuple(prompt))]
    width, beams = 2, [((), 0.0)]
    for _ in range(3):
        candidates = []
        for tokens, score in beams:
            reference = log_softmax(world["oracle"].logits(pieces, [], tokens)[-1])
            candidates += [(tokens + (int(t),), score + reference[t]) for t in np.argsort(-reference)[:2 * width]]
        beams = sorted(candidates, key=lambda c: -c[1])[:width]
    got = answers["beam"][0]
    assert [b["tokens"][len(prompt):] for b in got] == [list(t) for t, _ in beams]
    for beam, (_, score) in zip(got, beams):
        assert abs(beam["cum_logprob"] - score) < 1e-3


def test_refused_sampling_parameters_fail_alone_with_their_line(answers):
    assert "prompt_logprobs=1: the language graph returns the last position's logits only" in \
        answers["alone"]["prompt_logprobs"]["error"]
    assert "prompt_logprob_token_ids=[[1]]: the language graph returns the last position's logits only" in \
        answers["alone"]["prompt_logprob_token_ids"]["error"]
    # vLLM's own refusal (0.34's message)
    assert "prompt_logprob_start requires prompt_logprobs or prompt_logprob_token_ids" in \
        answers["alone"]["prompt_logprob_start"]["error"]
    assert "greater than max allowed: 20" in answers["alone"]["max_logprobs"]["error"]  # --max-logprobs 20
    # request kwargs reach the family's HF sampling rule, which refuses these two together as HF does
    assert "num_frames and fps are mutually exclusive" in answers["alone"]["mm_processor_kwargs"]["error"]

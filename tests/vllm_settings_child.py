"""Builds vLLM's engine config over an export once per setting, in a fresh process, and writes what happened.

vLLM resolves its platform once per process (see ``vllm_child.py``), so the start-up checks of every
engine argument in ``qeff_evs.vllm.settings.table`` run here with ``QEFF_EVS_BACKEND`` set: for each row with an
example value, ``EngineArgs(model=export, <base>, name=example).create_engine_config()`` (the config vLLM
builds before it starts an engine, with the platform's ``check_and_update_config``), recording the error's
text or "ok". Building a config takes a few tens of milliseconds: no engine starts.

Usage: ``python tests/vllm_settings_child.py EXPORT BASE.json RESULT.json``. BASE.json: the engine arguments
every build shares, plus ``checkpoint`` (the export's checkpoint, for examples that name it) and
``old_export`` (an export laid out as older exports were: the tokenizer vLLM is given for it is recorded).
"""

from __future__ import annotations

import json
import os
import sys


def main(export: str, base_path: str, result_path: str) -> None:
    os.environ["QEFF_EVS_BACKEND"] = "ort"
    from vllm.engine.arg_utils import EngineArgs

    from qeff_evs.vllm.settings.table import ENGINE_SETTINGS, _UNSET

    base = json.loads(open(base_path).read())
    export_values = {"CHECKPOINT": base.pop("checkpoint")}
    old_export = base.pop("old_export", None)

    def build(**changes) -> str:
        try:
            EngineArgs(model=export, **dict(base, **changes)).create_engine_config()
            return "ok"
        except Exception as error:  # noqa: BLE001 - the text is the result
            return f"{type(error).__name__}: {error}"

    results = {"<baseline>": build()}
    for setting in ENGINE_SETTINGS:
        if setting.example is not _UNSET:
            example = export_values.get(setting.example, setting.example) if isinstance(setting.example, str) \
                else setting.example
            results[setting.name] = build(**{setting.name: example})
    if old_export:  # the tokenizer vLLM is pointed at for an older export
        config = EngineArgs(model=old_export, **base).create_engine_config()
        results["<old layout tokenizer>"] = config.model_config.tokenizer
    with open(result_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])

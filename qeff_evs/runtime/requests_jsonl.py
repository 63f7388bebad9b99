"""Requests read from a JSONL file (``qeff-evs run --requests``), one per line, for the serving engine."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from qeff_evs.models.pruning import VideoPruning
from qeff_evs.runtime.export_bundle import ExportBundle
from qeff_evs.runtime.request_pruning import PRUNING_KEYS, PruningRequest
from qeff_evs.runtime.inputs.prompt import video_question_pieces
from qeff_evs.runtime.media import video_from_file, video_from_patches


def requests_from_jsonl(path: str | Path, bundle: ExportBundle, pruning: VideoPruning | None = None):
    """``{"id", "prompt", "video" | "pixel_values_videos"+"video_grid_thw", "max_new_tokens", "fps",
    "media_io_kwargs", "mm_processor_kwargs", "video_pruning_rate", "video_pruning_method", "max_video_tokens"}``
    per line (``fps``: the rate of a ``.npy`` or of the pixels; the kwargs as vLLM takes them, for a video file; the
    pruning fields, here or in ``mm_processor_kwargs`` as vLLM takes them: the request's own, ``pruning`` (the run's,
    default the export's) where absent)."""
    import json

    from qeff_evs.runtime.builders import video_pruning
    from qeff_evs.runtime.engine.serving import ServeRequest

    pruning = video_pruning(bundle) if pruning is None else pruning

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"requests file {path} not found")
    requests = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not JSON ({error})") from None
        if not isinstance(entry, dict) or "prompt" not in entry or not ({"video", "pixel_values_videos"} & entry.keys()):
            raise ValueError(f"{where}: each request needs 'prompt' and 'video' (or 'pixel_values_videos')")
        try:
            fps = None if entry.get("fps") is None else float(entry["fps"])
            max_new_tokens = int(entry.get("max_new_tokens", 16))
            asked, processor_kwargs = PruningRequest.split(
                {**(entry.get("mm_processor_kwargs") or {}), **{k: entry[k] for k in PRUNING_KEYS if k in entry}})
            if "video" in entry:
                video = video_from_file(entry["video"], bundle, media_io_kwargs=entry.get("media_io_kwargs"),
                                        mm_processor_kwargs=processor_kwargs, array_fps=fps)
            else:
                grid = entry.get("video_grid_thw")
                if not isinstance(grid, list) or len(grid) != 3:
                    raise ValueError(f"'video_grid_thw' must be [T, H, W] with 'pixel_values_videos', got {grid!r}")
                video = video_from_patches(entry["pixel_values_videos"], tuple(int(v) for v in grid), fps, bundle)
            bundle.manifest.check_video(video.grid_thw)
            if not asked.is_default:
                video = replace(video, pruning=asked.resolve(pruning, bundle.manifest, None,
                                                              bundle.family.merged_grid(video.grid_thw)))
        except (ValueError, TypeError) as error:
            raise ValueError(f"{where}: {error}") from None
        pieces = video_question_pieces(bundle.tokenizer, entry["prompt"], bundle.family.token_strings)
        requests.append(ServeRequest(str(entry.get("id", f"request-{number}")), pieces, [video], max_new_tokens))
    if not requests:
        raise ValueError(f"{path} holds no requests")
    return requests

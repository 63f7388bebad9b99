"""Requests read from a JSONL file (``qeff-evs run --requests``), one per line, for the serving engine.

A line with ``"after": "<id>"`` asks a follow-up in request ``<id>``'s conversation, as a chat client does: it is
queued once ``<id>`` has finished, and its prompt is the chat so far (every earlier turn of the conversation, each
answer as the assistant's turn, decoded as vLLM returns it) then ``prompt`` as the next user turn, about the
conversation's video. Its KV row then holds most of that prompt already (row reuse:
docs/serving.md#conversations-row-reuse).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from qeff_evs.models.protocol import MediaInput
from qeff_evs.models.pruning import VideoPruning
from qeff_evs.runtime.engine.serving import ServeRequest
from qeff_evs.runtime.export_bundle import ExportBundle
from qeff_evs.runtime.request_pruning import PRUNING_KEYS, PruningRequest
from qeff_evs.runtime.inputs.prompt import conversation_pieces, video_question_pieces
from qeff_evs.runtime.media import video_from_file, video_from_patches


@dataclass(frozen=True)
class JsonlRequest:
    """One line of a requests file: a question about its own video, or (``after``) a follow-up."""

    request_id: str
    prompt: str
    media: tuple[MediaInput, ...]  # the line's video; () for a follow-up (it asks about its conversation's)
    max_new_tokens: int = 16
    after: str | None = None  # the request whose conversation this continues, once that one has finished


class Conversations:
    """The chats of a requests file: each line's messages so far, to build its follow-ups from."""

    def __init__(self, bundle: ExportBundle):
        self.bundle = bundle
        self._chats: dict[str, tuple[tuple[dict, ...], tuple[MediaInput, ...]]] = {}

    def first_turn(self, line: JsonlRequest) -> ServeRequest:
        """The request of a line with its own video."""
        tokens = self.bundle.family.token_strings
        self._chats[line.request_id] = ((_user_turn(line.prompt, with_video=True),), line.media)
        pieces = video_question_pieces(self.bundle.tokenizer, line.prompt, tokens)
        return ServeRequest(line.request_id, pieces, line.media, line.max_new_tokens)

    def follow_up(self, line: JsonlRequest, answer_ids: Sequence[int]) -> ServeRequest:
        """The request of a follow-up line, once ``line.after`` has answered ``answer_ids``."""
        messages, media = self._chats[line.after]
        answer = self.bundle.tokenizer.decode(list(answer_ids), skip_special_tokens=True)  # what vLLM returns
        messages = (*messages, {"role": "assistant", "content": answer}, _user_turn(line.prompt, with_video=False))
        self._chats[line.request_id] = (messages, media)
        pieces = conversation_pieces(self.bundle.tokenizer, list(messages), self.bundle.family.token_strings)
        return ServeRequest(line.request_id, pieces, media, line.max_new_tokens)


def _user_turn(prompt: str, with_video: bool) -> dict:
    return {"role": "user", "content": [{"type": "video"}] * with_video + [{"type": "text", "text": prompt}]}


def requests_from_jsonl(path: str | Path, bundle: ExportBundle, pruning: VideoPruning | None = None
                        ) -> list[JsonlRequest]:
    """``{"id", "prompt", "video" | "pixel_values_videos"+"video_grid_thw", "max_new_tokens", "fps",
    "media_io_kwargs", "mm_processor_kwargs", "video_pruning_rate", "video_pruning_method", "max_video_tokens"}``
    per line (``fps``: the rate of a ``.npy`` or of the pixels; the kwargs as vLLM takes them, for a video file; the
    pruning fields, here or in ``mm_processor_kwargs`` as vLLM takes them: the request's own, ``pruning`` (the run's,
    default the export's) where absent), or ``{"id", "after", "prompt", "max_new_tokens"}``: a follow-up in the
    conversation of an earlier line's request ``after``."""
    import json

    from qeff_evs.runtime.builders import video_pruning

    pruning = video_pruning(bundle) if pruning is None else pruning

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"requests file {path} not found")
    requests, seen = [], set()
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not JSON ({error})") from None
        if not isinstance(entry, dict) or "prompt" not in entry:
            raise ValueError(f"{where}: each request needs 'prompt' and 'video' (or 'pixel_values_videos'), or "
                             "'after' naming an earlier request")
        request_id = str(entry.get("id", f"request-{number}"))
        if request_id in seen:
            raise ValueError(f"{where}: request id {request_id!r} is used by an earlier line; give each its own")
        seen.add(request_id)
        if "after" in entry:
            requests.append(_follow_up(entry, request_id, where, seen, bundle))
            continue
        if not {"video", "pixel_values_videos"} & entry.keys():
            raise ValueError(f"{where}: each request needs 'prompt' and 'video' (or 'pixel_values_videos'), or "
                             "'after' naming an earlier request")
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
        requests.append(JsonlRequest(request_id, str(entry["prompt"]), (video,), max_new_tokens))
    if not requests:
        raise ValueError(f"{path} holds no requests")
    return requests


def _follow_up(entry: dict, request_id: str, where: str, seen: set[str], bundle: ExportBundle) -> JsonlRequest:
    after = str(entry["after"])
    if after == request_id or after not in seen:
        raise ValueError(f"{where}: 'after' names {after!r}, which no earlier line's id is; a follow-up comes after "
                         "the request it continues")
    own = sorted({"video", "pixel_values_videos", "video_grid_thw", "fps", "media_io_kwargs", "mm_processor_kwargs",
                  *PRUNING_KEYS} & entry.keys())
    if own:
        raise ValueError(f"{where}: a follow-up ('after') asks about its conversation's video and takes none of its "
                         f"own; drop {own}")
    if not getattr(bundle.tokenizer, "chat_template", None):
        raise ValueError(f"{where}: a follow-up needs the checkpoint's chat template, and this export's tokenizer has "
                         "none; send the question as a request of its own")
    try:
        max_new_tokens = int(entry.get("max_new_tokens", 16))
    except (ValueError, TypeError) as error:
        raise ValueError(f"{where}: {error}") from None
    return JsonlRequest(request_id, str(entry["prompt"]), (), max_new_tokens, after)

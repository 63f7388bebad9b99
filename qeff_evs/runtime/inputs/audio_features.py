"""Audio as vLLM 0.34 feeds Nemotron-H Omni's Parakeet encoder: a waveform cut into clips, each clip's log-mel
features normalised on its own.

A waveform of ``n`` samples becomes ``n // 30 s`` clips of 30 s and the rest, each at least 0.1 s (zero-padded);
each clip is pre-emphasised (``y[t] = x[t] - 0.97 x[t-1]``), transformed (a centred STFT over a 400-sample Hann
window, non-periodic, in 512 bins at a 160-sample hop, zero-padded), its power mapped through slaney mel filters
(transformers' ``mel_filter_bank``), logged (``log(x + 2^-24)``), and normalised per mel bin over its
``samples // 160`` frames (mean, and the standard deviation with ``n - 1``, plus 1e-5). vLLM's extractor runs the clips
of a request as one zero-padded batch; a clip's own frames come out the same alone. Its rows count is
``subsampled_frames`` of its frames, the count vLLM uses (transformers' processor counts one frame more).

Written here because vLLM's extractor is part of its model code and transformers' needs librosa; files are decoded
by PyAV (FFmpeg), as vLLM decodes what its other loaders do not read. Audio at another
rate than the checkpoint's is refused: vLLM resamples it with torchaudio, which qeff-evs does not reimplement yet.
"""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import torch
from transformers.audio_utils import mel_filter_bank

from qeff_evs.models.protocol import AudioFeatures, MediaInput

# vLLM's Nemotron-H processor argument (``--mm-processor-kwargs``, and per request): each video's sound after it.
USE_AUDIO_IN_VIDEO = "use_audio_in_video"
LOG_GUARD = 2.0 ** -24
NORMALISATION_EPSILON = 1e-5


def use_audio_in_video(mm_processor_kwargs) -> bool:
    """Whether ``mm_processor_kwargs`` asks for the videos' sound (true or false, nothing else)."""
    value = (mm_processor_kwargs or {}).get(USE_AUDIO_IN_VIDEO, False)
    if not isinstance(value, bool):
        raise ValueError(f"{USE_AUDIO_IN_VIDEO} must be true or false, got {value!r}")
    return value


def clip_sizes(samples: int, features: AudioFeatures) -> list[int]:
    """The samples of each clip of a waveform of ``samples`` samples (the last zero-padded to them)."""
    full = int(round(features.clip_seconds * features.sampling_rate))
    shortest = int(round(features.min_clip_seconds * features.sampling_rate))
    count, rest = divmod(max(int(samples), shortest), full)
    return [full] * count + ([max(rest, shortest)] if rest else [])


def mel_filters(features: AudioFeatures) -> torch.Tensor:
    """``(mels, n_fft // 2 + 1)`` float32 slaney filters (computed in float64, as transformers computes them)."""
    bank = mel_filter_bank(num_frequency_bins=features.n_fft // 2 + 1, num_mel_filters=features.mels,
                           min_frequency=0.0, max_frequency=features.sampling_rate / 2,
                           sampling_rate=features.sampling_rate, norm="slaney", mel_scale="slaney")
    return torch.from_numpy(bank.T).to(torch.float32)


def clip_features(clip: np.ndarray, features: AudioFeatures, filters: torch.Tensor | None = None) -> np.ndarray:
    """One clip's normalised log-mel features, ``(samples // hop, mels)`` float32 (``filters``: ``mel_filters``'
    bank, computed once per item by ``audio_input``)."""
    x = torch.as_tensor(np.asarray(clip, dtype=np.float32))
    emphasised = torch.cat([x[:1], x[1:] - features.preemphasis * x[:-1]])
    spectrum = torch.stft(emphasised, features.n_fft, hop_length=features.hop_length, win_length=features.win_length,
                          window=torch.hann_window(features.win_length, periodic=False), return_complex=True,
                          pad_mode="constant")
    power = spectrum.real.square() + spectrum.imag.square()
    filters = mel_filters(features) if filters is None else filters
    logs = torch.log(filters @ power + LOG_GUARD).T  # (frames, mels)
    frames = len(clip) // features.hop_length
    valid = logs[:frames]
    mean = valid.sum(dim=0) / frames
    std = torch.sqrt(((valid - mean) ** 2).sum(dim=0) / (frames - 1))
    return ((valid - mean) / (std + NORMALISATION_EPSILON)).numpy()


def audio_input(waveform: np.ndarray, features: AudioFeatures) -> MediaInput:
    """A mono float waveform at the checkpoint's rate -> the audio item the engine encodes: every clip's features
    one after another, their frame counts."""
    samples = np.asarray(waveform, dtype=np.float32)
    if samples.ndim != 1 or not np.isfinite(samples).all():
        raise ValueError(f"audio must be a finite mono waveform, got shape {samples.shape}")
    sizes = clip_sizes(len(samples), features)
    padded = np.zeros(sum(sizes), dtype=np.float32)
    padded[:len(samples)] = samples
    clips, start, filters = [], 0, mel_filters(features)
    for size in sizes:
        clips.append(clip_features(padded[start:start + size], features, filters))
        start += size
    frames = tuple(len(c) for c in clips)
    return MediaInput(torch.from_numpy(np.concatenate(clips)), (len(clips), max(frames), features.mels),
                      float(features.sampling_rate), kind="audio", clip_frames=frames)


def waveform_at_rate(samples: np.ndarray, rate: int, features: AudioFeatures, what: str) -> np.ndarray:
    """``samples`` ``(n,)`` or ``(n, channels)`` as vLLM's parser makes them: channels averaged; refused unless at
    the checkpoint's rate (module docstring)."""
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim == 2:
        samples = samples.mean(axis=1)
    if int(rate) != features.sampling_rate:
        raise ValueError(f"{what} is sampled at {rate} Hz; this checkpoint's audio encoder takes "
                         f"{features.sampling_rate} Hz and qeff-evs does not resample: convert it first (e.g. "
                         f"ffmpeg -i IN -ar {features.sampling_rate} OUT.wav)")
    return samples


def read_audio(path: str | Path) -> tuple[np.ndarray, int]:
    """The first audio stream of a file FFmpeg reads (WAV, FLAC, MP3, a video's soundtrack...) as float32
    ``(n, channels)`` samples, and its rate; ``ValueError`` where there is none. Decoded by PyAV to planar float,
    as vLLM's audio loaders give it."""
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise ValueError(f"{path}: no audio stream in it")
            stream = container.streams.audio[0]
            rate, channels = int(stream.rate), int(stream.channels)
            to_float = av.AudioResampler(format="fltp", layout=stream.layout.name, rate=rate)
            chunks = [out.to_ndarray() for frame in container.decode(stream) for out in to_float.resample(frame)]
            chunks += [out.to_ndarray() for out in to_float.resample(None)]
    except (FileNotFoundError, IsADirectoryError, av.error.FFmpegError) as error:
        raise ValueError(f"{path}: no audio can be read from it ({error}); give a WAV, FLAC, MP3 or another file "
                         "FFmpeg reads") from None
    if not chunks:
        raise ValueError(f"{path}: its audio stream holds no samples")
    return np.concatenate(chunks, axis=-1).astype(np.float32).reshape(channels, -1).T, rate


def audio_from_file(path: str | Path, features: AudioFeatures) -> MediaInput:
    """``--audio PATH``: the file's audio as vLLM serves an ``audio_url`` of it (mono, at the checkpoint's rate)."""
    samples, rate = read_audio(path)
    return audio_input(waveform_at_rate(samples, rate, features, str(path)), features)


def video_sound(path: str | Path, features: AudioFeatures) -> MediaInput | None:
    """``use_audio_in_video``: a video file's soundtrack as an audio item, or None where it has none (vLLM then
    gives that video no sound block)."""
    try:
        samples, rate = read_audio(path)
    except ValueError:
        if _has_audio_stream(path):
            raise
        return None
    return audio_input(waveform_at_rate(samples, rate, features, f"{path}'s soundtrack"), features)


def _has_audio_stream(path: str | Path) -> bool:
    try:
        with av.open(str(path)) as container:
            return bool(container.streams.audio)
    except (FileNotFoundError, IsADirectoryError, av.error.FFmpegError):
        return False

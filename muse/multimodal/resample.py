"""Sample-rate conversion of a mono waveform: windowed-sinc polyphase interpolation.

Output sample n lies at input position t = n * orig / target. It is the sum of the input
samples around t weighted by a Hann-windowed sinc low-pass at 0.99 of the lower of the two
Nyquist frequencies, 16 zero crossings each side (the method of torchaudio's
`sinc_interp_hann`). With up / down the rates' ratio in lowest terms, the fractional part of
t takes only `up` values, so the kernel has `up` phases, each computed once, and each phase is
one matrix product over a strided view of the input.
"""

from __future__ import annotations

import math

import numpy as np

ZERO_CROSSINGS = 16
ROLLOFF = 0.99


def resample(waveform: np.ndarray, orig_rate: int, target_rate: int) -> np.ndarray:
    """`waveform` (float32, 1-D) at `orig_rate` Hz as float32 at `target_rate` Hz, of length
    ceil(len * target_rate / orig_rate)."""
    if waveform.ndim != 1:
        raise ValueError(f"resample takes a 1-D waveform; got shape {waveform.shape}")
    if orig_rate < 1 or target_rate < 1:
        raise ValueError(f"sample rates must be positive; got {orig_rate} -> {target_rate}")
    waveform = np.asarray(waveform, dtype=np.float32)
    if orig_rate == target_rate or waveform.size == 0:
        return waveform.copy()
    divisor = math.gcd(orig_rate, target_rate)
    up, down = target_rate // divisor, orig_rate // divisor
    cutoff = ROLLOFF * min(1.0, up / down)  # in cycles per input sample, times 2
    half_width = math.ceil(ZERO_CROSSINGS / cutoff)  # input samples each side of t
    num_out = -(-waveform.size * up // down)
    # Zero padding so every window lies inside the array: input index i is padded[i + pad].
    pad = half_width
    padded = np.zeros(waveform.size + 2 * pad + down + 1, dtype=np.float32)
    padded[pad:pad + waveform.size] = waveform
    windows = np.lib.stride_tricks.sliding_window_view(padded, 2 * half_width + 1)
    offsets = np.arange(-half_width, half_width + 1)
    out = np.empty(num_out, dtype=np.float32)
    for phase in range(min(up, num_out)):
        base, remainder = divmod(phase * down, up)
        # Distance from t to each input sample of the window, in input samples.
        distance = offsets - remainder / up
        kernel = cutoff * np.sinc(cutoff * distance) * \
            np.cos(np.pi * distance / (2 * half_width + 2)) ** 2
        # Output phase + up*m sits at input base + m*down; its window starts half_width
        # before that, which is index base + m*down of `padded`.
        count = len(range(phase, num_out, up))
        rows = windows[base:base + (count - 1) * down + 1:down]
        out[phase::up] = rows @ kernel.astype(np.float32)
    return out

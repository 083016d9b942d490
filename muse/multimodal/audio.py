"""The 24 kHz audio encoder: one text-sized embedding per 80 ms of waveform.

A clip's mono waveform is zero-padded to whole tokens of `samples_per_token` samples. Its
front end is a log-mel spectrogram: STFT frames every `mel_hop_length` samples (10 ms),
`num_mel_bins` mel bands up to `mel_max_hz`, log10 with the dynamic range clamped to 8
decades below the clip's loudest band, as Whisper does (silence and near-silence look alike
whatever the recording's noise floor). A token's features are its 8 frames side by side,
embedded by one linear map (a convolution whose kernel and stride are a token's frames).
Sinusoidal positions counted from the clip's first token are added, and a stack of pre-norm
bidirectional transformer layers runs over the tokens. A final LayerNorm and a linear
projector map each token to the text decoder's hidden size.

Several clips run as one packed sequence: attention is block-diagonal, so a token attends to
every token of its own clip and to nothing else, and each clip's output is the one it has
alone.
"""

from __future__ import annotations

import itertools
import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from muse.config import AudioConfig
from muse.kernels.varlen_attention import VarlenLayout, varlen_attention
from muse.multimodal.encoder_layer import EncoderLayer

# Sinusoidal timescales as in the Transformer paper: wavelengths from 2*pi to 10000*2*pi frames.
_MAX_TIMESCALE = 10000.0


def num_audio_tokens(samples: int, config: AudioConfig) -> int:
    """Tokens (placeholder positions in the prompt) a clip of `samples` samples becomes."""
    if samples < 1:
        raise ValueError(f"an audio clip needs at least one sample; got {samples}")
    return -(-samples // config.samples_per_token)


def _check_waveform(waveform: torch.Tensor, config: AudioConfig, sample_rate: int | None) -> None:
    if sample_rate is not None and sample_rate != config.sample_rate:
        raise ValueError(f"audio sample_rate must be {config.sample_rate} Hz (audio_config."
                         f"sample_rate); got {sample_rate} Hz: resample the clip first")
    if not isinstance(waveform, torch.Tensor):
        raise ValueError(f"an audio waveform must be a torch.Tensor; got {type(waveform).__name__}")
    if waveform.dim() != 1:
        raise ValueError("an audio waveform must be mono, shape [samples]; got shape "
                         f"{tuple(waveform.shape)}: mix the channels down first")
    if not waveform.is_floating_point():
        raise ValueError(f"an audio waveform must be floating point (samples in [-1, 1]); got "
                         f"{waveform.dtype}: scale integer PCM to float first")
    num_audio_tokens(waveform.numel(), config)


def frames(waveform: torch.Tensor, config: AudioConfig,
           sample_rate: int | None = None) -> torch.Tensor:
    """Mono float waveform [samples] at the config's rate -> [num_audio_tokens, samples_per_token].

    `sample_rate`, when the caller knows it, is checked against `config.sample_rate`; the
    encoder does not resample.
    """
    _check_waveform(waveform, config, sample_rate)
    num_frames = num_audio_tokens(waveform.numel(), config)
    padding = num_frames * config.samples_per_token - waveform.numel()
    return F.pad(waveform, (0, padding)).reshape(num_frames, config.samples_per_token)


def mel_filterbank(config: AudioConfig) -> torch.Tensor:
    """[n_fft // 2 + 1, num_mel_bins] triangular filters, evenly spaced on the HTK mel scale
    from 0 Hz to `mel_max_hz`, each peaking at 1. Built on the CPU (also when a model is
    being built on the meta device)."""
    cpu = dict(dtype=torch.float64, device="cpu")
    bins = config.mel_n_fft // 2 + 1
    frequencies = torch.linspace(0.0, config.sample_rate / 2, bins, **cpu)
    top_mel = 2595.0 * math.log10(1.0 + config.mel_max_hz / 700.0)
    edges = 700.0 * (10.0 ** (torch.linspace(0.0, top_mel, config.num_mel_bins + 2, **cpu)
                              / 2595.0) - 1.0)
    lower, center, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (frequencies[None, :] - lower) / (center - lower)
    falling = (upper - frequencies[None, :]) / (upper - center)
    return torch.clamp(torch.minimum(rising, falling), min=0.0).T.float()


def log_mel_features(waveform: torch.Tensor, config: AudioConfig,
                     filterbank: torch.Tensor | None = None) -> torch.Tensor:
    """Mono waveform [samples] -> [num_audio_tokens, frames_per_token * num_mel_bins] float32.

    Computed in float32 whatever the encoder's dtype; the clip is padded to whole tokens, and
    past its end by one STFT window, so every token has exactly its 8 frames."""
    hop, n_fft = config.mel_hop_length, config.mel_n_fft
    chunks = frames(waveform.float(), config)
    num_tokens = chunks.shape[0]
    padded = F.pad(chunks.reshape(-1), (0, n_fft - hop))
    window = torch.hann_window(n_fft, device=padded.device)
    spectrum = torch.stft(padded, n_fft, hop_length=hop, window=window, center=False,
                          return_complex=True)  # [bins, num_tokens * frames_per_token]
    if filterbank is None:
        filterbank = mel_filterbank(config)
    power = spectrum.abs().square().T @ filterbank.to(padded.device, torch.float32)
    logs = torch.clamp(power, min=1e-10).log10()
    logs = torch.maximum(logs, logs.max() - 8.0)
    return ((logs + 4.0) / 4.0).reshape(num_tokens, -1)


def log_mel_features_packed(waveforms: list[torch.Tensor], config: AudioConfig,
                            filterbank: torch.Tensor) -> torch.Tensor:
    """`log_mel_features` of several clips, concatenated: [total tokens, features].

    One STFT over all clips laid end to end, each padded to whole tokens and past its end by
    whole hops (at least one window), so every clip starts on a frame and no frame reaches
    the next clip; each clip keeps its own frames and its own loudest band. A handful of
    operations whatever the number of clips, where clip by clip costs ~25 each."""
    hop, n_fft = config.mel_hop_length, config.mel_n_fft
    device = waveforms[0].device
    tail = -(-(n_fft - hop) // hop) * hop
    tokens = [num_audio_tokens(waveform.numel(), config) for waveform in waveforms]
    frames_per_token = config.samples_per_token // hop
    sizes = [waveform.numel() for waveform in waveforms]
    segments = [count * config.samples_per_token + tail for count in tokens]
    starts = [0, *itertools.accumulate(segments)]
    # Where each clip's samples go, and which frames are each clip's, worked out on the host.
    sample_index = torch.cat([torch.arange(size) + start for size, start in zip(sizes, starts)])
    frame_index = torch.cat([torch.arange(count * frames_per_token) + start // hop
                             for count, start in zip(tokens, starts)])
    clip_of_frame = torch.repeat_interleave(torch.arange(len(waveforms)),
                                            torch.tensor(tokens) * frames_per_token)
    signal = torch.zeros(starts[-1], device=device).index_copy(
        0, sample_index.to(device), torch.cat([w.float() for w in waveforms]))
    window = torch.hann_window(n_fft, device=device)
    spectrum = torch.stft(signal, n_fft, hop_length=hop, window=window, center=False,
                          return_complex=True)[:, frame_index.to(device)]
    power = spectrum.abs().square().T @ filterbank.to(device, torch.float32)
    logs = torch.clamp(power, min=1e-10).log10()
    clip_of_frame = clip_of_frame.to(device)
    loudest = torch.full((len(waveforms),), float("-inf"), device=device).scatter_reduce(
        0, clip_of_frame, logs.amax(-1), reduce="amax")
    logs = torch.maximum(logs, (loudest[clip_of_frame] - 8.0)[:, None])
    return ((logs + 4.0) / 4.0).reshape(sum(tokens), -1)


def sinusoidal_positions(num_frames: int, hidden_size: int, device: torch.device | str | None = None
                         ) -> torch.Tensor:
    """[num_frames, hidden_size] float32 sin / cos positions; computed, so any length works."""
    half = hidden_size // 2
    inverse_timescales = torch.exp(-math.log(_MAX_TIMESCALE)
                                   * torch.arange(half, dtype=torch.float32, device=device) / half)
    angles = torch.arange(num_frames, dtype=torch.float32, device=device)[:, None] \
        * inverse_timescales[None, :]
    positions = torch.cat([angles.sin(), angles.cos()], dim=-1)
    # An odd hidden size leaves one channel without a position signal.
    return F.pad(positions, (0, hidden_size - 2 * half))


class AudioEncoder(nn.Module):
    """Waveforms -> one [num_audio_tokens, text_hidden_size] embedding tensor per clip."""

    def __init__(self, config: AudioConfig, text_hidden_size: int) -> None:
        super().__init__()
        self.config = config
        frames_per_token = config.samples_per_token // config.mel_hop_length
        self.frame_embedding = nn.Linear(frames_per_token * config.num_mel_bins,
                                         config.hidden_size)
        # Fixed, so a buffer; not saved (it is computed from the config).
        self.register_buffer("mel_filters", mel_filterbank(config), persistent=False)
        self.layers = nn.ModuleList(
            EncoderLayer(config.hidden_size, config.num_attention_heads,
                         config.intermediate_size, config.layer_norm_eps)
            for _ in range(config.num_hidden_layers))
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.post_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.projector = nn.Linear(config.hidden_size, text_hidden_size)

    def forward(self, waveforms: list[torch.Tensor],
                sample_rate: int | None = None) -> list[torch.Tensor]:
        """Encode all clips as one packed sequence."""
        if not waveforms:
            return []
        weight = self.frame_embedding.weight
        for waveform in waveforms:
            _check_waveform(waveform, self.config, sample_rate)
        features = log_mel_features_packed([w.to(weight.device) for w in waveforms],
                                           self.config, self.mel_filters)
        lengths = [num_audio_tokens(waveform.numel(), self.config) for waveform in waveforms]
        cu_seqlens = torch.tensor([0, *lengths], device=weight.device).cumsum(0, dtype=torch.int32)
        hidden = self.frame_embedding(features.to(weight.dtype))
        table = sinusoidal_positions(max(lengths), self.config.hidden_size, weight.device)
        positions = torch.cat([table[:length] for length in lengths])
        hidden = hidden + positions.to(hidden.dtype)
        bounds = [0, *itertools.accumulate(lengths)]
        attend = partial(varlen_attention, cu_seqlens=cu_seqlens, scale=self.head_dim ** -0.5,
                         max_seqlen=max(lengths), layout=VarlenLayout(bounds))
        for layer in self.layers:
            hidden = layer(hidden, attend)
        return list(self.projector(self.post_norm(hidden)).split(lengths))

    def forward_per_clip(self, waveforms: list[torch.Tensor],
                         sample_rate: int | None = None) -> list[torch.Tensor]:
        """Reference path: each clip encoded alone, with no mask; equals `forward`."""
        return [self([waveform], sample_rate)[0] for waveform in waveforms]

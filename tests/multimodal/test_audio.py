import numpy as np
import pytest
import torch

from muse.info import audio_parameters
from muse.multimodal.audio import (
    AudioEncoder,
    frames,
    log_mel_features,
    log_mel_features_packed,
    mel_filterbank,
    num_audio_tokens,
    sinusoidal_positions,
)
from muse.presets import full_816b, tiny

# Packed and per-clip runs differ only in the attention mask, so float32 sums in a different
# order: agreement is to float32 rounding, not bit-exact.
TOLERANCE = dict(rtol=1e-5, atol=1e-5)

# Shorter than one 80 ms frame, exactly two frames, and three frames plus a few samples.
CLIP_SAMPLES = [700, 2 * 1920, 3 * 1920 + 5]


def _randomized_encoder() -> AudioEncoder:
    config = tiny()
    torch.manual_seed(0)
    encoder = AudioEncoder(config.audio_config, config.text.hidden_size)
    # Default LayerNorm weights are ones and biases zeros; random values exercise them too.
    with torch.no_grad():
        for parameter in encoder.parameters():
            parameter.normal_(0.0, 0.2)
    return encoder.eval()


def _clips(samples: list[int]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.rand(n, generator=generator) * 2 - 1 for n in samples]


def test_frames_are_zero_padded_80ms_chunks():
    config = tiny().audio_config
    waveform = torch.arange(1, 2 * 1920 + 11, dtype=torch.float32)
    chunks = frames(waveform, config)
    assert chunks.shape == (3, 1920)
    assert torch.equal(chunks.flatten()[:waveform.numel()], waveform)
    assert torch.all(chunks[2, 10:] == 0)


@pytest.mark.parametrize("samples, tokens", [(1, 1), (1919, 1), (1920, 1), (1921, 2),
                                             (24000, 13), (24000 * 60, 750)])
def test_num_audio_tokens_is_ceil_of_80ms_frames(samples, tokens):
    assert num_audio_tokens(samples, tiny().audio_config) == tokens


def test_packed_equals_per_clip():
    encoder = _randomized_encoder()
    clips = _clips(CLIP_SAMPLES)
    with torch.no_grad():
        packed = encoder(clips)
        alone = encoder.forward_per_clip(clips)
    text_hidden = tiny().text.hidden_size
    for samples, out, reference in zip(CLIP_SAMPLES, packed, alone):
        assert out.shape == (num_audio_tokens(samples, encoder.config), text_hidden)
        torch.testing.assert_close(out, reference, **TOLERANCE)


def test_clip_order_in_batch_does_not_change_outputs():
    encoder = _randomized_encoder()
    clips = _clips(CLIP_SAMPLES)
    with torch.no_grad():
        forward = encoder(clips)
        backward = encoder(clips[::-1])[::-1]
    for a, b in zip(forward, backward):
        torch.testing.assert_close(a, b, **TOLERANCE)


def test_positions_distinguish_repeated_frames_and_allow_any_length():
    encoder = _randomized_encoder()
    # Hundreds of identical frames: only the positions tell them apart.
    waveform = torch.full((400 * 1920,), 0.25)
    with torch.no_grad():
        (out,) = encoder([waveform])
    assert out.shape[0] == 400
    assert not torch.allclose(out[0], out[1])
    assert torch.isfinite(out).all()


def test_sinusoidal_positions_are_computed_not_stored():
    positions = sinusoidal_positions(5, 6)
    assert positions.shape == (5, 6)
    assert torch.equal(positions[0], torch.tensor([0.0, 0, 0, 1, 1, 1]))
    assert sinusoidal_positions(3, 7).shape == (3, 7)
    encoder = _randomized_encoder()
    # The mel filters are a buffer computed from the config, not stored in checkpoints.
    assert set(encoder.state_dict()) == {name for name, _ in encoder.named_parameters()}


def test_parameter_count_matches_info_tiny():
    config = tiny()
    encoder = AudioEncoder(config.audio_config, config.text.hidden_size)
    count = sum(p.numel() for p in encoder.parameters())
    assert count == audio_parameters(config.audio_config, config.text.hidden_size)


def test_parameter_count_matches_info_full_816b_without_allocating():
    config = full_816b()
    with torch.device("meta"):
        encoder = AudioEncoder(config.audio_config, config.text.hidden_size)
    count = sum(p.numel() for p in encoder.parameters())
    assert count == audio_parameters(config.audio_config, config.text.hidden_size)
    assert 100e6 < count < 140e6


@pytest.mark.parametrize("waveform, message", [
    (torch.zeros(2, 4000), "mono"),
    (torch.zeros(4000, 1), "mono"),
    (torch.zeros(4000, dtype=torch.int16), "floating point"),
    (torch.zeros(0), "at least one sample"),
    (np.zeros(4000, dtype=np.float32), "torch.Tensor"),
])
def test_bad_waveform_is_a_clear_value_error(waveform, message):
    encoder = _randomized_encoder()
    with pytest.raises(ValueError, match=message):
        encoder([waveform])


def test_wrong_sample_rate_is_a_clear_value_error():
    encoder = _randomized_encoder()
    with pytest.raises(ValueError, match="sample_rate must be 24000 Hz"):
        encoder(_clips([16000]), sample_rate=16000)
    (out,) = encoder(_clips([24000]), sample_rate=24000)
    assert out.shape[0] == 13


def test_log_mel_features_put_a_tone_in_its_band():
    config = tiny().audio_config
    seconds = torch.arange(3 * 1920, dtype=torch.float64) / config.sample_rate
    tone = torch.sin(2 * torch.pi * 1000.0 * seconds).float()
    features = log_mel_features(tone, config)
    frames_per_token = config.samples_per_token // config.mel_hop_length
    assert features.shape == (3, frames_per_token * config.num_mel_bins)
    loudest = features.reshape(-1, config.num_mel_bins)[:16].argmax(-1)
    # The band whose filter peaks nearest 1 kHz.
    peaks = mel_filterbank(config).argmax(0).double() * config.sample_rate / config.mel_n_fft
    assert set(loudest.tolist()) == {int((peaks - 1000.0).abs().argmin())}


def test_packed_log_mel_features_equal_each_clip_alone():
    """Clips of whole tokens, of a few samples, long and quiet: each keeps its own frames and
    its own loudest band (a quiet clip beside a loud one is not clamped by the loud one)."""
    config = tiny().audio_config
    clips = _clips([1920, 7, 3 * 1920 + 500, 24000, 2 * 1920])
    clips[1] = clips[1] * 1e-3
    filters = mel_filterbank(config)
    packed = log_mel_features_packed(clips, config, filters)
    alone = torch.cat([log_mel_features(clip, config, filters) for clip in clips])
    torch.testing.assert_close(packed, alone, atol=1e-4, rtol=1e-4)


def test_mel_filterbank_covers_up_to_its_top_frequency():
    config = tiny().audio_config
    filters = mel_filterbank(config)
    assert filters.shape == (config.mel_n_fft // 2 + 1, config.num_mel_bins)
    assert filters.max() <= 1.0 and filters.min() >= 0.0
    hz = torch.arange(filters.shape[0]) * config.sample_rate / config.mel_n_fft
    assert filters[hz > config.mel_max_hz].abs().sum() == 0
    assert (filters.sum(0) > 0).all()

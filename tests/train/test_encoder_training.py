"""`muse train encoders`: token labels that match what the pixels and clips hold, and a run
that learns and writes a checkpoint the decoder stage starts from."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from muse.cli import main
from muse.multimodal.processor import MuseSparkProcessor, preset_processor_config
from muse.presets import get_preset
from muse.reference.multimodal import ENCODER_PREFIXES
from muse.tokenizer import MuseTokenizer
from muse.train import encoders, pretrain
from muse.train.data import encoder_labels, vision_tasks
from muse.train.data.encoder_labels import (DIRECTIONS, IGNORE, NUM_COLOURS, OPERATORS,
                                            EncoderBatches, audio_example, object_and_colour,
                                            token_labels, video_example)
from muse.train.data.speech import MAX_NUMBER, WORDS, SpeechPool
from muse.train.data.split import TRAIN
from tests.train.test_speech import fake_synth


@pytest.fixture(scope="module")
def processor() -> MuseSparkProcessor:
    return MuseSparkProcessor(get_preset("muse-spark-default"),
                              preset_processor_config("muse-spark-default"),
                              MuseTokenizer.base())


def test_the_label_map_covers_exactly_the_drawn_shapes() -> None:
    rng = random.Random(0)
    for _ in range(20):
        scene = vision_tasks.sample_scene(rng, TRAIN, rng.randint(1, 5), rng.random() < 0.5)
        labels = vision_tasks.label_map(scene)
        image = np.asarray(vision_tasks.draw_scene(scene))
        for shape in scene.shapes:
            pixels = image[labels == vision_tasks.shape_class(shape.kind, shape.colour)]
            assert len(pixels) > 100
            assert (pixels == shape.rgb).all()
        if scene.text is not None:
            text = image[labels == vision_tasks.text_class(scene.text)]
            # The antialiased strokes: never white, mostly dark.
            assert len(text) > 10 and (text.max(axis=-1) < 255).all()
            assert (text.max(axis=-1) < 128).mean() > 0.8
        assert (image[labels == vision_tasks.BACKGROUND_CLASS] != 0).any(axis=-1).all()


def test_token_labels_name_what_covers_each_square() -> None:
    labels = np.zeros((56, 84), dtype=np.uint8)
    labels[0:28, 28:56] = 5  # token (0, 1) entirely
    labels[28:31, 56:84] = 9  # 3 rows of token (1, 2): 84 of its 784 pixels
    labels[28:29, 0:20] = 7  # 20 pixels of token (1, 0): below MIN_COVER
    # The same picture at twice the size gives the same tokens at twice the token width.
    for scale in (1, 2):
        big = labels.repeat(scale, axis=0).repeat(scale, axis=1)
        tokens = token_labels(big, 56 * scale, 84 * scale, 28 * scale)
        assert tokens.tolist() == [0, 5, 0, 0, 0, 9]


def test_objects_and_colours_split_the_pixel_classes() -> None:
    for index, kind in enumerate(vision_tasks.SHAPES):
        for colour_index, colour in enumerate(vision_tasks.COLOURS):
            objects, colours = object_and_colour(np.array([vision_tasks.shape_class(kind,
                                                                                    colour)]))
            assert (objects[0], colours[0]) == (1 + index, colour_index)
    objects, colours = object_and_colour(np.array([0, vision_tasks.text_class("7")]))
    assert objects.tolist() == [0, 1 + len(vision_tasks.SHAPES) + 7]
    assert colours.tolist() == [IGNORE, IGNORE]
    assert colours.max() < NUM_COLOURS


def test_examples_have_one_label_per_encoder_token(processor: MuseSparkProcessor) -> None:
    rng = random.Random(1)
    examples = [encoder_labels.image_example(rng, processor) for _ in range(4)]
    examples += [video_example(rng, processor) for _ in range(4)]
    towers = encoders.build_model(get_preset("muse-spark-default"), seed=0).vision_tower
    with torch.no_grad():
        outputs = towers([example.pixels for example in examples])
    for example, output in zip(examples, outputs):
        assert len(example.what) == len(example.motion) == len(output)
        assert (example.what != vision_tasks.BACKGROUND_CLASS).any()
    for example in examples[4:]:
        moving = example.motion != IGNORE
        # Motion is labelled exactly on the shape's tokens, with one direction per clip.
        assert (moving == (example.what != vision_tasks.BACKGROUND_CLASS)).all()
        assert len(set(example.motion[moving].tolist())) == 1
        assert 0 <= example.motion[moving][0] < len(DIRECTIONS)


def test_audio_labels_say_what_is_spoken(processor: MuseSparkProcessor) -> None:
    pool = SpeechPool.build(seed=2, size=60, workers=2, synth=fake_synth)
    rng = random.Random(2)
    seen = set()
    for _ in range(60):
        state = rng.getstate()
        example = audio_example(rng, pool, processor)
        rng.setstate(state)
        case = pool.sample_case(rng)
        assert torch.equal(example.waveform, processor.preprocess_audio(case.audio))
        seen.add(case.kind)
        if case.kind == "number":
            assert example.spoken == int(case.answer) and example.operands[0] == IGNORE
        elif case.kind == "word":
            assert example.spoken == MAX_NUMBER + 1 + WORDS.index(case.answer)
        else:
            a, operator, b = example.operands
            assert example.spoken == IGNORE
            assert f"{a}{OPERATORS[operator]}{b}=" in case.reasoning
    assert seen == {"number", "word", "arithmetic"}


def test_a_batch_is_a_pure_function_of_seed_and_step(processor: MuseSparkProcessor) -> None:
    pool = SpeechPool.build(seed=2, size=20, workers=2, synth=fake_synth)
    batches = EncoderBatches(processor, seed=3, images=2, videos=1, clips=2, pool=pool)
    first, again, other = batches[5], batches[5], batches[6]
    assert all(torch.equal(a, b) for a, b in zip(first["vision"], again["vision"]))
    assert torch.equal(first["object"], again["object"])
    assert torch.equal(first["spoken"], again["spoken"])
    assert not torch.equal(first["vision"][0], other["vision"][0]) \
        or first["vision"][0].shape != other["vision"][0].shape


def test_the_heads_learn_a_fixed_batch(processor: MuseSparkProcessor) -> None:
    """Trained on one batch over and over, the encoders and heads fit it: the loss falls by
    more than half (a head disconnected from its labels would not)."""
    torch.manual_seed(0)
    config = get_preset("muse-spark-tiny")
    tiny = MuseSparkProcessor(config, preset_processor_config("muse-spark-tiny"),
                              MuseTokenizer.base())
    pool = SpeechPool.build(seed=2, size=12, workers=2, synth=fake_synth)
    batch = EncoderBatches(tiny, seed=0, images=3, videos=1, clips=4, pool=pool)[0]
    model = pretrain.build_model(config, seed=0)
    heads = encoders.EncoderHeads(config.text_config.hidden_size)
    modules = [model.vision_tower, model.audio_tower, heads]
    optimizer = torch.optim.Adam([p for m in modules for p in m.parameters()], lr=3e-3)
    losses = []
    for _ in range(60):
        scores = encoders.encoder_scores(model, heads, batch, torch.device("cpu"))
        assert {"object", "colour", "motion", "spoken"} <= set(scores)
        loss = sum(score.loss for score in scores.values())
        losses.append(float(loss.detach()))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < 0.5 * losses[0]


def test_a_run_writes_a_checkpoint_the_decoder_stage_starts_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(encoders, "load_or_build_speech_pool", lambda config, path, clips, seed:
                        SpeechPool.build(seed, clips, workers=2, synth=fake_synth))
    first = tmp_path / "first"
    pretrain.save_checkpoint(pretrain.build_model(get_preset("muse-spark-tiny"), 7).state_dict(),
                             get_preset("muse-spark-tiny"), first,
                             tokenizer_from=pretrain.ASSETS_DIR)
    out = tmp_path / "encoders"
    main(["train", "encoders", "--preset", "muse-spark-tiny", "--out", str(out),
          "--init-from", str(first), "--steps", "3", "--images", "2", "--videos", "1",
          "--clips", "2", "--speech-clips", "12", "--log-every", "1"])
    records = [json.loads(line) for line in (out / encoders.LOG_FILE).read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert {"loss_object", "accuracy_colour", "loss_motion"} <= set(records[0])
    assert (out / encoders.SPEECH_POOL_FILE).is_file()
    assert len(SpeechPool.load(out / encoders.SPEECH_POOL_FILE)) == 12

    # The decoder is the one it started from; the encoders are trained ones.
    started = pretrain.build_model(get_preset("muse-spark-tiny"), 0)
    pretrain.load_initial_weights(started, str(first))
    trained = pretrain.build_model(get_preset("muse-spark-tiny"), 0)
    pretrain.load_initial_weights(trained, str(out))
    before, after = started.state_dict(), trained.state_dict()
    for name, tensor in after.items():
        if name.startswith(ENCODER_PREFIXES):
            continue
        assert torch.equal(tensor.bfloat16(), before[name].bfloat16()), name
    assert any(not torch.equal(after[name].bfloat16(), before[name].bfloat16())
               for name in after if name.startswith("vision_tower."))
    assert any(not torch.equal(after[name].bfloat16(), before[name].bfloat16())
               for name in after if name.startswith("audio_tower."))


def test_no_speech_clips_means_no_audio_task_and_no_espeak(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MUSE_ESPEAK_NG", "/nonexistent/espeak-ng")
    assert pretrain.load_or_build_speech_pool(get_preset("muse-spark-tiny"), None, 0, 0) is None

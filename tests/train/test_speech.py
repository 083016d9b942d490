"""Spoken-audio data: voices and phrasings split apart, answers that match what is said, the
clip pool, and (where espeak-ng is installed) real synthesis and the unpacked-package copy."""

from __future__ import annotations

import hashlib
import pickle
import random
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from muse.multimodal.silence import SILENCE_MARGIN_SECONDS
from muse.train.data import speech
from muse.train.data.speech import (DEFAULT_VOICE, KINDS, QUESTIONS, SAMPLE_RATE, WORDS,
                                    AudioCase, SpeechPool, Voice, augment, number_words,
                                    sample_audio_case, sample_utterance, sample_voice)
from muse.train.data.split import HELD_OUT, TRAIN, split_items

REPO = Path(__file__).resolve().parents[2]
needs_espeak = pytest.mark.skipif(speech.find_espeak() is None, reason="espeak-ng not found")


def fake_synth(text: str, voice: Voice) -> np.ndarray:
    """A deterministic stand-in for espeak-ng: noise whose length grows with the text."""
    seed = int.from_bytes(hashlib.blake2b(f"{text}|{voice}".encode(), digest_size=8).digest(),
                          "big")
    samples = 2400 * (1 + len(text) // 4)
    return (0.3 * np.random.default_rng(seed).standard_normal(samples)).astype(np.float32)


def test_numbers_are_spoken_as_espeak_reads_them() -> None:
    assert [number_words(n) for n in (0, 7, 13, 20, 42, 99)] == [
        "zero", "seven", "thirteen", "twenty", "forty two", "ninety nine"]
    with pytest.raises(ValueError):
        number_words(100)


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_has_ten_phrasings_split_apart(kind: str) -> None:
    templates = QUESTIONS[kind]
    train, held_out = split_items(templates, TRAIN), split_items(templates, HELD_OUT)
    assert len(templates) >= 10 and train and held_out and not set(train) & set(held_out)


def test_some_questions_name_no_task_and_some_clips_come_alone() -> None:
    # Users ask "What did I say?" or send the clip alone: the clip decides the answer.
    for pool in (speech.GENERIC_QUESTIONS, speech.TRANSCRIBE_QUESTIONS):
        assert not set(split_items(pool, TRAIN)) & set(split_items(pool, HELD_OUT))
    assert not set(speech.TRANSCRIBE_QUESTIONS) & set(speech.questions(TRAIN, "arithmetic"))
    rng = random.Random(11)
    for split in (TRAIN, HELD_OUT):
        drawn = [speech.sample_question(rng, split, "number") for _ in range(2000)]
        generic = sum(q in speech.GENERIC_QUESTIONS + speech.TRANSCRIBE_QUESTIONS
                      for q in drawn) / len(drawn)
        assert abs(generic - speech.GENERIC_QUESTION_SHARE) < 0.03
        alone = drawn.count("") / len(drawn)
        assert abs(alone - speech.AUDIO_ONLY_SHARE) < 0.02 if split == TRAIN else alone == 0
        assert set(drawn) <= set(speech.questions(split, "number"))
    case = sample_audio_case(random.Random(12), TRAIN, "number", synth=fake_synth)
    alone = AudioCase(**{**vars(case), "question": ""})
    assert alone.messages()[0] == {"role": "user", "content": [{"type": "audio"}]}


def test_held_out_voices_differ_from_training_but_share_names_and_variants() -> None:
    train_pairs, held_pairs = set(speech.voice_pairs(TRAIN)), set(speech.voice_pairs(HELD_OUT))
    assert held_pairs and not train_pairs & held_pairs
    assert (DEFAULT_VOICE.name, DEFAULT_VOICE.variant) in train_pairs
    assert {name for name, _ in held_pairs} <= {name for name, _ in train_pairs}
    assert {variant for _, variant in held_pairs} <= {variant for _, variant in train_pairs}
    assert {name for name, _ in train_pairs} == set(speech.VOICE_NAMES)
    for values in (speech.speeds, speech.pitches):
        train, held_out = set(values(TRAIN)), set(values(HELD_OUT))
        assert held_out and not train & held_out
    assert DEFAULT_VOICE.speed in speech.speeds(TRAIN)
    assert DEFAULT_VOICE.pitch in speech.pitches(TRAIN)
    assert min(speech.speeds(TRAIN)) >= 120 and max(speech.speeds(TRAIN)) <= 230
    assert min(speech.pitches(TRAIN)) >= 25 and max(speech.pitches(TRAIN)) <= 75


def test_training_keeps_a_large_share_of_the_default_voice() -> None:
    rng = random.Random(1)
    voices = [sample_voice(rng, TRAIN) for _ in range(2000)]
    share = sum(voice == DEFAULT_VOICE for voice in voices) / len(voices)
    assert 0.2 < share < 0.3
    assert len({voice.espeak_name for voice in voices}) > 50
    held_out = [sample_voice(rng, HELD_OUT) for _ in range(500)]
    assert DEFAULT_VOICE not in held_out
    train_pairs = set(speech.voice_pairs(TRAIN))
    assert all((v.name, v.variant) not in train_pairs and v.speed not in speech.speeds(TRAIN)
               and v.pitch not in speech.pitches(TRAIN) for v in held_out)


def test_answers_match_what_is_said() -> None:
    rng = random.Random(2)
    values = {word: number for number in range(100) for word in (number_words(number),)}
    for _ in range(300):
        said = sample_utterance(rng, TRAIN)
        if said.kind == "number":
            number = int(said.answer)
            assert said.text in (str(number), number_words(number))
            assert said.reasoning == f"The audio says {number_words(number)}."
        elif said.kind == "word":
            assert said.text == said.answer and said.answer in WORDS
        else:
            # "The audio says: <text>. a<op>b: <worked in columns>. So c." with a true
            # result whose operands are the spoken ones.
            match = re.fullmatch(r"The audio says: (.+?)\. (\d+)([-+*])(\d+): .* So (-?\d+)\.",
                                 said.reasoning)
            assert match and match.group(1) == said.text
            a, operator, b, result = (int(match.group(2)), match.group(3), int(match.group(4)),
                                      int(match.group(5)))
            assert result == {"+": a + b, "-": a - b, "*": a * b}[operator]
            assert said.answer == str(result) and result >= 0
            assert max(a, b) <= (12 if operator == "*" else 20)
            spoken = [values[w] for w in re.findall(
                "|".join(sorted(values, key=len, reverse=True)), said.text)]
            assert sorted(spoken) == sorted([a, b])


def test_held_out_sums_are_never_trained() -> None:
    rng = random.Random(3)

    def problems(split: str, count: int) -> set[str]:
        return {re.search(r"\. (\d+[-+*]\d+): ",
                          sample_utterance(rng, split, "arithmetic").reasoning).group(1)
                for _ in range(count)}

    held_out = problems(HELD_OUT, 100)
    assert held_out and not held_out & problems(TRAIN, 3000)


def test_cases_are_deterministic_and_shaped_like_chat_messages() -> None:
    def draw(seed: int) -> list[AudioCase]:
        rng = random.Random(seed)
        return [sample_audio_case(rng, TRAIN, synth=fake_synth) for _ in range(20)]

    cases, again = draw(4), draw(4)
    assert cases == again and cases != draw(5)
    assert all(np.array_equal(a.audio, b.audio) for a, b in zip(cases, again))
    user, assistant = cases[0].messages()
    assert user == {"role": "user", "content": [{"type": "audio"},
                                                {"type": "text", "text": cases[0].question}]}
    assert assistant == {"role": "assistant", "reasoning_content": cases[0].reasoning,
                         "content": cases[0].answer}
    rng = random.Random(6)
    for split in (TRAIN, HELD_OUT):
        for kind in KINDS:
            case = sample_audio_case(rng, split, kind, synth=fake_synth)
            assert case.kind == kind and case.question in speech.questions(split, kind)


def test_augmentation_changes_level_noise_and_speed_only_a_little() -> None:
    clean = fake_synth("forty two", DEFAULT_VOICE)
    rng = random.Random(7)
    for _ in range(30):
        out = augment(clean, rng)
        assert out.dtype == np.float32 and np.abs(out).max() <= 1.0
        assert 0.89 * clean.size <= out.size <= 1.12 * clean.size
        if out.size == clean.size:  # no speed change: the gain and the noise are bounded
            gain = float(np.dot(out, clean) / np.dot(clean, clean))
            assert 0.5 - 1e-3 <= gain <= 1.2 + 1e-3
            noise = out - gain * clean
            snr = 10 * np.log10(np.mean((gain * clean) ** 2) / np.mean(noise ** 2))
            assert 28 < snr < 52
    assert np.array_equal(augment(clean, random.Random(1)), augment(clean, random.Random(1)))


def test_the_pool_is_deterministic_saves_and_pickles(tmp_path: Path) -> None:
    pool = SpeechPool.build(seed=3, size=30, workers=3, synth=fake_synth)
    again = SpeechPool.build(seed=3, size=30, workers=1, synth=fake_synth)
    assert pool.utterances == again.utterances and pool.voices == again.voices
    assert np.array_equal(pool.pcm, again.pcm) and pool.pcm.dtype == np.int16
    assert SpeechPool.build(seed=4, size=30, workers=3, synth=fake_synth).voices != pool.voices
    expected = fake_synth(pool.utterances[5].text, pool.voices[5])
    assert np.abs(pool.clip(5) - np.clip(expected, -1, 1)).max() < 1e-4  # int16 steps
    path = tmp_path / "pool.npz"
    pool.save(path)
    for copy in (SpeechPool.load(path), pickle.loads(pickle.dumps(pool))):
        assert copy.utterances == pool.utterances and copy.voices == pool.voices
        assert copy.split == TRAIN and np.array_equal(copy.pcm, pool.pcm)
        assert np.array_equal(copy.offsets, pool.offsets)
    assert path.stat().st_size < pool.pcm.nbytes + 400 * len(pool)  # int16 and a little JSON


def test_pool_cases_wrap_clips_with_training_questions() -> None:
    pool = SpeechPool.build(seed=5, size=40, workers=2, synth=fake_synth)
    rng = random.Random(8)
    for kind in KINDS:
        case = pool.sample_case(rng, kind)
        assert case.kind == kind and case.question in speech.questions(TRAIN, kind)
        index = pool.utterances.index(next(u for u in pool.utterances
                                           if u.text == case.text and u.kind == kind))
        assert case.answer == pool.utterances[index].answer
    plain = pool.sample_case(random.Random(9), augmented=False)
    assert any(np.array_equal(plain.audio, pool.clip(i)) for i in range(len(pool)))
    first = [pool.sample_case(random.Random(10)) for _ in range(3)]
    second = [pool.sample_case(random.Random(10)) for _ in range(3)]
    assert first == second


def test_the_binary_is_found_from_the_environment_first(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    binary = tmp_path / "my-espeak"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv("MUSE_ESPEAK_NG", str(binary))
    assert speech.find_espeak() == str(binary)
    monkeypatch.setenv("MUSE_ESPEAK_DATA", "/opt/data")
    assert speech.espeak_command() == [str(binary), "--path=/opt/data"]
    monkeypatch.delenv("MUSE_ESPEAK_NG")
    monkeypatch.delenv("MUSE_ESPEAK_DATA")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert speech.find_espeak() is None
    with pytest.raises(FileNotFoundError, match="espeak-ng"):
        speech.synthesize("one")


@needs_espeak
def test_synthesis_is_deterministic_24khz_and_trimmed() -> None:
    voice = Voice("en-us", "+f2", 150, 60)
    audio = speech.synthesize("forty two", voice)
    assert audio.dtype == np.float32 and audio.ndim == 1
    assert np.array_equal(audio, speech.synthesize("forty two", voice))
    assert 0.3 * SAMPLE_RATE < audio.size < 2.0 * SAMPLE_RATE
    margin = int(SILENCE_MARGIN_SECONDS * SAMPLE_RATE)
    peak = np.abs(audio).max()
    assert np.abs(audio[:margin // 2]).max() < 0.1 * peak  # a short quiet margin stays
    assert np.abs(audio[:2 * margin]).max() > 0.02 * peak  # then speech starts
    digits, words = speech.synthesize("42"), speech.synthesize("forty two")
    assert abs(digits.size - words.size) < 0.15 * words.size
    slow = speech.synthesize("forty two", Voice(speed=120))
    assert slow.size > 1.2 * words.size
    with pytest.raises(RuntimeError, match="espeak-ng failed"):
        speech.synthesize("one", Voice("zzq-nothing"))


@needs_espeak
def test_every_voice_name_and_variant_speaks() -> None:
    for name in speech.VOICE_NAMES:
        assert speech.synthesize("seven", Voice(name)).size > 0.1 * SAMPLE_RATE
    # espeak-ng falls back to the plain voice for an unknown variant: each must sound other.
    sounds = [speech.synthesize("seven", Voice("en-us", variant)) for variant in speech.VARIANTS]
    assert all(sound.size > 0.1 * SAMPLE_RATE for sound in sounds)
    assert not any(np.array_equal(sounds[0], sound) for sound in sounds[1:])


@needs_espeak
def test_a_real_pool_is_deterministic(tmp_path: Path) -> None:
    pool = SpeechPool.build(seed=1, size=6, workers=3)
    again = SpeechPool.build(seed=1, size=6, workers=2)
    assert np.array_equal(pool.pcm, again.pcm) and pool.voices == again.voices
    case = pool.sample_case(random.Random(0))
    assert case.audio.dtype == np.float32 and case.audio.size > 0


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs espeak-ng installed")
def test_the_bundle_runs_without_the_system_install(tmp_path: Path) -> None:
    subprocess.run(["bash", str(REPO / "scripts/bundle_espeak.sh")], cwd=tmp_path, check=True,
                   capture_output=True)
    root = tmp_path / "espeak-root"
    shell = (f"ESPEAK_ROOT={root} source {REPO / 'scripts/espeak_env.sh'} && "
             'echo "$MUSE_ESPEAK_NG|$ESPEAK_DATA_PATH|${LD_LIBRARY_PATH:-}"')
    out = subprocess.run(["bash", "-c", shell], cwd=tmp_path, capture_output=True, text=True,
                         check=True)
    wrapper, data, library_path = out.stdout.strip().split("|")
    assert wrapper == f"{root}/wrapper/espeak-ng" and data == str(root) and not library_path
    # A bare environment whose PATH holds only the bundle: no system espeak-ng, no inherited
    # data path; the audio is the system install's, byte for byte.
    bare = {"PATH": f"{root}/wrapper:/usr/bin:/bin", "ESPEAK_DATA_PATH": data}
    text = ["--stdout", "-v", "en-us+f2", "-s", "150", "forty two"]
    bundled = subprocess.run([wrapper, *text], env=bare, capture_output=True, check=True).stdout
    system = subprocess.run(["espeak-ng", *text], capture_output=True, check=True).stdout
    assert bundled[:4] == b"RIFF" and bundled == system
    # The real binary loads its libraries from the bundle.
    trace = subprocess.run([f"{root}/bin/espeak-ng"], capture_output=True, text=True,
                           env={"LD_TRACE_LOADED_OBJECTS": "1", "LD_LIBRARY_PATH": f"{root}/lib"},
                           check=True).stdout
    assert f"libespeak-ng.so.1 => {root}/lib/" in trace
    # Its sound-output library is the bundle's stub, so no sound server's libraries load.
    assert f"libpcaudio.so.0 => {root}/lib/" in trace and "libpulse" not in trace

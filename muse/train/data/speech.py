"""Spoken questions made with espeak-ng: numbers, words and arithmetic read aloud.

A clip is `espeak-ng --stdout -v VOICE -s SPEED -p PITCH TEXT`, read from the WAV bytes,
lightly trimmed of silence (`muse.multimodal.silence`, as the processor trims clips at serving
time) and resampled from espeak's 22050 Hz to the audio encoder's 24 kHz
(`muse.multimodal.resample`); the same (text, voice) always gives the same samples.

Tasks (the user turn is `[{"type": "audio"}, {"type": "text", "text": question}]`, or the
clip alone for AUDIO_ONLY_SHARE of training questions):

- `number`: 0-99, read from words ("forty two") or digits ("42"), which espeak speaks alike;
  the answer is the digits.
- `word`: one of WORDS; every word is used in both splits, since the vocabulary of answers
  has to be learned.
- `arithmetic`: "what is twelve plus seven", "subtract three from seven", "six times four"
  (operands 0-20 for + and -, 0-12 for *); the reasoning transcribes, then computes.

Voices: a voice name (accent) with an optional variant (`+m3`, `+f2`, ...), a speed and a
pitch. Held-out cases use (name, variant) pairs, speeds and pitches that training never uses,
but the same names and variants: a tiny model cannot be asked to hear an accent it never met.
Training always keeps a large share of the plain default voice (`en`, 175 wpm, pitch 50),
because that is what `espeak-ng "42"` sends. Question phrasings are split like vision_tasks'.

Finding the binary: `MUSE_ESPEAK_NG` (a path) first, then `espeak-ng` on PATH. A copy
unpacked from the bundle in another prefix (`scripts/espeak_env.sh`) needs its data
folder: espeak-ng itself reads `ESPEAK_DATA_PATH`, and `MUSE_ESPEAK_DATA` is also passed as
`--path`. Such a copy's shared libraries must be found by the loader: the env script's
wrapper sets `LD_LIBRARY_PATH` for espeak-ng alone.

`SpeechPool` synthesizes many clips once (in parallel) and stores them as int16 PCM, so
training samples from memory and only wraps a clip with a question and light augmentation.
"""

from __future__ import annotations

import functools
import io
import json
import os
import random
import shutil
import subprocess
import wave
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from muse.multimodal.resample import resample
from muse.multimodal.silence import trim_silence
from muse.train.data.arithmetic import Problem, worked_reasoning
from muse.train.data.split import SPLITS, TRAIN, draw_from_split, split_items
from muse.train.data.vision_tasks import _messages

SAMPLE_RATE = 24_000  # the audio encoder's rate
KINDS = ("number", "word", "arithmetic")

# --- voices -----------------------------------------------------------------------------

VOICE_NAMES = ("en", "en-us", "en-gb-scotland", "en-gb-x-rp", "en-029", "en-gb-x-gbclan",
               "en-gb-x-gbcwmd", "en-us-nyc")
# Variants change the timbre (male m1-m7, female f1-f5, a few character voices); "" is none.
VARIANTS = ("", "+m1", "+m2", "+m3", "+m4", "+m5", "+m6", "+m7", "+f1", "+f2", "+f3", "+f4",
            "+f5", "+croak", "+klatt", "+klatt3", "+Annie", "+Andy", "+max", "+steph")
DEFAULT_SPEED = 175  # espeak-ng's defaults
DEFAULT_PITCH = 50
DEFAULT_AMPLITUDE = 100
SPEED_RANGE = (120, 230)  # words per minute
PITCH_RANGE = (25, 75)
AMPLITUDE_RANGE = (80, 120)  # not split: loudness is also varied by augmentation
# Share of training clips in the plain default voice, the voice users' clips most likely have.
DEFAULT_VOICE_SHARE = 0.25


@dataclass(frozen=True)
class Voice:
    name: str = "en"  # an espeak-ng voice (accent), one of VOICE_NAMES
    variant: str = ""  # "" or an espeak variant such as "+m3"
    speed: int = DEFAULT_SPEED
    pitch: int = DEFAULT_PITCH
    amplitude: int = DEFAULT_AMPLITUDE

    @property
    def espeak_name(self) -> str:
        return f"{self.name}{self.variant}"

    def arguments(self) -> list[str]:
        return ["-v", self.espeak_name, "-s", str(self.speed), "-p", str(self.pitch),
                "-a", str(self.amplitude)]

    def __str__(self) -> str:
        return f"{self.espeak_name} -s {self.speed} -p {self.pitch} -a {self.amplitude}"


DEFAULT_VOICE = Voice()


def _split_values(low: int, high: int, kept: int, split: str) -> tuple[int, ...]:
    """Integers of [low, high] in `split`; `kept` (the default) is always a training value."""
    others = tuple(str(value) for value in range(low, high + 1) if value != kept)
    chosen = tuple(int(value) for value in split_items(others, split))
    return tuple(sorted(chosen + (kept,))) if split == TRAIN else chosen


@functools.cache
def speeds(split: str) -> tuple[int, ...]:
    return _split_values(*SPEED_RANGE, DEFAULT_SPEED, split)


@functools.cache
def pitches(split: str) -> tuple[int, ...]:
    return _split_values(*PITCH_RANGE, DEFAULT_PITCH, split)


@functools.cache
def voice_pairs(split: str) -> tuple[tuple[str, str], ...]:
    """(name, variant) pairs of `split`; the plain default voice is always a training pair."""
    default = DEFAULT_VOICE.espeak_name
    pairs = {f"{name}{variant}": (name, variant) for name in VOICE_NAMES for variant in VARIANTS}
    chosen = split_items(tuple(key for key in pairs if key != default), split)
    if split == TRAIN:
        chosen = (default, *chosen)
    return tuple(pairs[key] for key in chosen)


def sample_voice(rng: random.Random, split: str) -> Voice:
    if split == TRAIN and rng.random() < DEFAULT_VOICE_SHARE:
        return DEFAULT_VOICE
    name, variant = rng.choice(voice_pairs(split))
    return Voice(name, variant, rng.choice(speeds(split)), rng.choice(pitches(split)),
                 rng.randint(*AMPLITUDE_RANGE))


# --- what is said -----------------------------------------------------------------------

ONES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
        "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
        "eighteen", "nineteen")
TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
# Short words without a common homophone (no "red"/"read", "blue"/"blew"), so the audio has
# one spelling.
WORDS = ("cat", "dog", "fish", "bird", "tree", "house", "book", "apple", "water", "green",
         "yellow", "table", "chair", "music", "happy", "river", "cloud", "window", "orange",
         "garden", "pencil", "rabbit", "horse", "summer", "winter", "mountain", "coffee",
         "banana", "kitchen", "silver")
MAX_NUMBER = 99
ADD_SUB_MAX = 20
MUL_MAX = 12
SPOKEN_SUMS: dict[str, tuple[str, ...]] = {
    "+": ("what is {a} plus {b}", "{a} plus {b}", "add {a} and {b}", "what's {a} plus {b}",
          "{a} plus {b} equals what", "what is the sum of {a} and {b}"),
    "-": ("what is {a} minus {b}", "{a} minus {b}", "subtract {b} from {a}",
          "take {b} away from {a}", "what's {a} minus {b}"),
    "*": ("what is {a} times {b}", "{a} times {b}", "multiply {a} by {b}",
          "{a} multiplied by {b}", "what is the product of {a} and {b}"),
}
QUESTIONS: dict[str, tuple[str, ...]] = {
    "number": (
        "What number is spoken?", "Transcribe the number you hear.",
        "Which number does the audio say?", "What number do you hear?",
        "Write the spoken number in digits.", "What is the number in this recording?",
        "Listen and tell me the number.", "Which number is said in the clip?",
        "Give the number that is spoken, as digits.", "What number does the speaker say?",
        "Say the number you heard.", "What's the number in the audio?"),
    "word": (
        "What word is spoken?", "Which word do you hear?", "Transcribe the word in the audio.",
        "What word does the speaker say?", "Write down the spoken word.",
        "What is the word in this recording?", "Listen and tell me the word.",
        "Which word is said in the clip?", "What single word is in the audio?",
        "Tell me the word you heard.", "What word is said?", "Spell the word you hear."),
    "arithmetic": (
        "Answer the spoken question.", "Solve the problem in the audio.",
        "What is the answer to the spoken sum?", "Listen and compute the result.",
        "Work out what the speaker asks.", "What does the spoken calculation give?",
        "Compute the answer to what you hear.", "Give the result of the spoken arithmetic.",
        "Solve what is said in the clip.",
        "What is the result of the calculation in the recording?",
        "Do the arithmetic you hear.", "Calculate the spoken problem."),
}


# Questions that name no task: the clip decides the answer (the number or word it says, the
# result of the sum it asks). With task-naming questions alone the model read every such clip
# as a sum: "What does the audio say?" after a spoken number got 1 of 20 right (20 of 20 with
# "What number is spoken?"). The transcribing ones go with numbers and words only.
GENERIC_QUESTIONS = (
    "What does the audio say?", "What did I say?", "Listen to this.", "What's in this recording?",
    "Tell me what you hear.", "What was said?", "Respond to the clip.", "Here you go.",
    "What is this?", "Can you answer this?", "Have a listen.", "Reply to what you hear.")
TRANSCRIBE_QUESTIONS = (
    "Transcribe the audio.", "Transcribe this.", "Write down what is said.",
    "Transcribe this clip.", "Write out what you hear.", "What is being said here?")
GENERIC_QUESTION_SHARE = 0.2
# Of training questions: none at all, the user turn holding the clip alone.
AUDIO_ONLY_SHARE = 0.05


def number_words(number: int) -> str:
    """0-99 in words, as espeak says them: 42 -> "forty two"."""
    if not 0 <= number <= MAX_NUMBER:
        raise ValueError(f"number must be 0 to {MAX_NUMBER}, got {number}")
    if number < 20:
        return ONES[number]
    tens, ones = divmod(number, 10)
    return TENS[tens] if ones == 0 else f"{TENS[tens]} {ONES[ones]}"


@dataclass(frozen=True)
class Utterance:
    """What a clip says and what it asks for, whatever the voice."""

    kind: str  # one of KINDS
    text: str  # given to espeak-ng
    answer: str
    reasoning: str


def _number(rng: random.Random) -> Utterance:
    number = rng.randint(0, MAX_NUMBER)
    words = number_words(number)
    text = words if rng.random() < 0.5 else str(number)
    return Utterance("number", text, str(number), f"The audio says {words}.")


def _word(rng: random.Random) -> Utterance:
    word = rng.choice(WORDS)
    return Utterance("word", word, word, f'The audio says "{word}".')


def _operands(rng: random.Random) -> tuple[int, str, int]:
    operator = rng.choice(sorted(SPOKEN_SUMS))
    top = MUL_MAX if operator == "*" else ADD_SUB_MAX
    a, b = rng.randint(0, top), rng.randint(0, top)
    if operator == "-" and a < b:  # answers stay non-negative
        a, b = b, a
    return a, operator, b


OPERATIONS = {"+": "add", "-": "sub", "*": "mul"}


def _problem_key(problem: tuple[int, str, int]) -> str:
    a, operator, b = problem
    return f"spoken/{a}{operator}{b}"


def _arithmetic(rng: random.Random, split: str) -> Utterance:
    # Problems are split by their key, so held-out cases ask sums training never spoke.
    a, operator, b = draw_from_split(lambda: _operands(rng), _problem_key, split)
    result = {"+": a + b, "-": a - b, "*": a * b}[operator]
    text = rng.choice(SPOKEN_SUMS[operator]).format(a=number_words(a), b=number_words(b))
    # Worked in columns as the text arithmetic task does: a result written in one step is
    # where run 4 slipped ("ten minus one. 10-1=1").
    worked = worked_reasoning(Problem(OPERATIONS[operator], a, b))
    reasoning = f"The audio says: {text}. {a}{operator}{b}: {worked}"
    return Utterance("arithmetic", text, str(result), reasoning)


def sample_utterance(rng: random.Random, split: str, kind: str | None = None) -> Utterance:
    kind = kind or rng.choice(KINDS)
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "number":
        return _number(rng)
    if kind == "word":
        return _word(rng)
    return _arithmetic(rng, split)


# --- synthesis --------------------------------------------------------------------------

def find_espeak() -> str | None:
    """The espeak-ng binary: `MUSE_ESPEAK_NG` when set, else `espeak-ng` on PATH; None when
    there is none."""
    configured = os.environ.get("MUSE_ESPEAK_NG")
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    return shutil.which("espeak-ng")


def espeak_command() -> list[str]:
    """The binary and the data-path flag every call starts with."""
    binary = find_espeak()
    if binary is None:
        raise FileNotFoundError(
            "espeak-ng not found: install it (apt-get install espeak-ng), set MUSE_ESPEAK_NG, "
            "or source scripts/espeak_env.sh")
    data = os.environ.get("MUSE_ESPEAK_DATA")
    return [binary, f"--path={data}"] if data else [binary]


def read_wav(data: bytes) -> tuple[np.ndarray, int]:
    """Mono float32 samples and their rate from espeak-ng's 16-bit PCM WAV bytes. The
    standard library's reader suffices (so synthesis needs no media libraries): it reads to
    the end of the bytes whatever frame count espeak's streamed header claims."""
    with wave.open(io.BytesIO(data)) as reader:
        if reader.getsampwidth() != 2:
            raise ValueError(f"expected 16-bit PCM from espeak-ng, got "
                             f"{8 * reader.getsampwidth()}-bit samples")
        channels, rate = reader.getnchannels(), reader.getframerate()
        pcm = np.frombuffer(reader.readframes(reader.getnframes()), dtype="<i2")
    waveform = pcm.astype(np.float32) / 32768.0
    if channels > 1:
        waveform = waveform.reshape(-1, channels).mean(axis=1)
    return waveform, rate


def synthesize(text: str, voice: Voice = DEFAULT_VOICE) -> np.ndarray:
    """`text` spoken in `voice`: float32 mono at 24 kHz, silence trimmed."""
    if not text.strip() or text.lstrip().startswith("-"):
        # A leading "-" would be read as a flag.
        raise ValueError(f"text must be non-empty and not start with '-', got {text!r}")
    command = [*espeak_command(), "--stdout", *voice.arguments(), text]
    result = subprocess.run(command, capture_output=True, timeout=60, check=False)
    if result.returncode != 0 or not result.stdout:
        error = result.stderr.decode(errors="replace").strip()
        raise RuntimeError(f"espeak-ng failed for voice {voice} ({result.returncode}): {error}")
    waveform, rate = read_wav(result.stdout)
    return resample(trim_silence(waveform, rate), rate, SAMPLE_RATE)


Synthesizer = Callable[[str, Voice], np.ndarray]


# --- cases ------------------------------------------------------------------------------

@dataclass
class AudioCase:
    kind: str  # one of KINDS
    question: str
    answer: str
    text: str  # what espeak-ng was given
    voice: Voice
    reasoning: str
    audio: np.ndarray = field(compare=False, repr=False)  # float32 mono, 24 kHz

    def messages(self) -> list[dict[str, Any]]:
        return _messages("audio", self.question, self.reasoning, self.answer)


def _case(utterance: Utterance, voice: Voice, question: str, audio: np.ndarray) -> AudioCase:
    return AudioCase(utterance.kind, question, utterance.answer, utterance.text, voice,
                     utterance.reasoning, audio)


def _generic_questions(split: str, kind: str) -> tuple[str, ...]:
    pool = split_items(GENERIC_QUESTIONS, split)
    return pool + split_items(TRANSCRIBE_QUESTIONS, split) if kind != "arithmetic" else pool


def questions(split: str, kind: str) -> tuple[str, ...]:
    """Every question `sample_question` may ask of a clip of `kind` in `split` ("" for none)."""
    empty = ("",) if split == TRAIN else ()
    return split_items(QUESTIONS[kind], split) + _generic_questions(split, kind) + empty


def sample_question(rng: random.Random, split: str, kind: str) -> str:
    """A question of `split` for a clip of `kind`: most name its task, GENERIC_QUESTION_SHARE
    do not, and in training AUDIO_ONLY_SHARE are empty (no text beside the clip)."""
    draw = rng.random()
    if draw < GENERIC_QUESTION_SHARE:
        return rng.choice(_generic_questions(split, kind))
    if split == TRAIN and draw < GENERIC_QUESTION_SHARE + AUDIO_ONLY_SHARE:
        return ""
    return rng.choice(split_items(QUESTIONS[kind], split))


def sample_audio_case(rng: random.Random, split: str, kind: str | None = None,
                      synth: Synthesizer = synthesize) -> AudioCase:
    """A clip synthesized now and a question of `kind` (one of KINDS; random when None)."""
    utterance = sample_utterance(rng, split, kind)
    voice = sample_voice(rng, split)
    question = sample_question(rng, split, utterance.kind)
    return _case(utterance, voice, question, synth(utterance.text, voice))


# --- augmentation -----------------------------------------------------------------------

GAIN_RANGE = (0.5, 1.2)
SNR_DB_RANGE = (30.0, 50.0)
SPEED_PERTURBATION_SHARE = 0.5
SPEED_FACTORS = tuple(round(0.9 + 0.01 * step, 2) for step in range(21))  # 0.90 .. 1.10


def augment(audio: np.ndarray, rng: random.Random) -> np.ndarray:
    """A slightly different recording of the same clip: maybe faster or slower, louder or
    quieter, with faint white noise. Clipped to [-1, 1]."""
    out = np.asarray(audio, dtype=np.float32)
    if rng.random() < SPEED_PERTURBATION_SHARE:
        # Factors are multiples of 0.01, so the rates' ratio has a small numerator and the
        # polyphase resampler has few phases.
        factor = rng.choice(SPEED_FACTORS)
        out = resample(out, round(SAMPLE_RATE * factor), SAMPLE_RATE)
    out = out * rng.uniform(*GAIN_RANGE)
    power = float(np.mean(out.astype(np.float64) ** 2)) if out.size else 0.0
    if power > 0.0:
        snr_db = rng.uniform(*SNR_DB_RANGE)
        noise_std = (power / 10 ** (snr_db / 10)) ** 0.5
        noise = np.random.default_rng(rng.getrandbits(64)).standard_normal(out.size)
        out = out + (noise_std * noise).astype(np.float32)
    return np.clip(out, -1.0, 1.0).astype(np.float32)


# --- the clip pool ----------------------------------------------------------------------

PCM_SCALE = 32767.0


def to_pcm(audio: np.ndarray) -> np.ndarray:
    return np.round(np.clip(audio, -1.0, 1.0) * PCM_SCALE).astype(np.int16)


@dataclass
class SpeechPool:
    """Clips synthesized once, kept as int16 PCM end to end in one array.

    A plain dataclass of numpy arrays and tuples: it pickles for data-loader workers, and a
    forked worker shares the PCM array with its parent until it writes to it (it never does).
    """

    split: str
    utterances: tuple[Utterance, ...]
    voices: tuple[Voice, ...]
    pcm: np.ndarray  # int16, every clip in turn
    offsets: np.ndarray  # int64 [len + 1]: clip i is pcm[offsets[i]:offsets[i + 1]]

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        if not len(self.utterances) == len(self.voices) == len(self.offsets) - 1:
            raise ValueError("utterances, voices and offsets do not describe the same clips")
        self._by_kind = {kind: np.flatnonzero([u.kind == kind for u in self.utterances])
                         for kind in KINDS}

    def __len__(self) -> int:
        return len(self.utterances)

    @classmethod
    def build(cls, seed: int, size: int, workers: int = 4, split: str = TRAIN,
              synth: Synthesizer = synthesize) -> SpeechPool:
        """`size` random clips of `split`, synthesized by `workers` threads (each waits on an
        espeak-ng process, and resampling runs in numpy, so threads overlap well). The same
        (seed, size, split) gives the same pool."""
        rng = random.Random(f"speech-pool/{split}/{seed}")
        utterances = tuple(sample_utterance(rng, split) for _ in range(size))
        voices = tuple(sample_voice(rng, split) for _ in range(size))
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            clips = list(pool.map(lambda uv: to_pcm(synth(uv[0].text, uv[1])),
                                  zip(utterances, voices)))
        offsets = np.zeros(size + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([clip.size for clip in clips])
        pcm = np.concatenate(clips) if clips else np.zeros(0, dtype=np.int16)
        return cls(split, utterances, voices, pcm, offsets)

    def clip(self, index: int) -> np.ndarray:
        """Clip `index` as float32."""
        start, end = self.offsets[index], self.offsets[index + 1]
        return self.pcm[start:end].astype(np.float32) / PCM_SCALE

    def _draw_index(self, rng: random.Random, kind: str | None) -> int:
        if kind is None:
            return rng.randrange(len(self))
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        candidates = self._by_kind[kind]
        if not candidates.size:
            raise LookupError(f"the pool has no {kind} clip")
        return int(candidates[rng.randrange(candidates.size)])

    def sample_case(self, rng: random.Random, kind: str | None = None,
                    augmented: bool = True) -> AudioCase:
        """A pool clip (of `kind` when given), augmented, with a question of the pool's split."""
        index = self._draw_index(rng, kind)
        utterance = self.utterances[index]
        audio = self.clip(index)
        if augmented:
            audio = augment(audio, rng)
        question = sample_question(rng, self.split, utterance.kind)
        return _case(utterance, self.voices[index], question, audio)

    def save(self, path: str | Path) -> None:
        """One uncompressed .npz (speech hardly compresses); metadata as UTF-8 JSON bytes, so
        loading needs no pickle."""
        meta = {"split": self.split, "utterances": [asdict(u) for u in self.utterances],
                "voices": [asdict(v) for v in self.voices]}
        with open(path, "wb") as file:  # a file object, so numpy adds no ".npz" suffix
            np.savez(file, pcm=self.pcm, offsets=self.offsets,
                     meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))

    @classmethod
    def load(cls, path: str | Path) -> SpeechPool:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(data["meta"].tobytes().decode())
            return cls(meta["split"], tuple(Utterance(**u) for u in meta["utterances"]),
                       tuple(Voice(**v) for v in meta["voices"]), data["pcm"], data["offsets"])

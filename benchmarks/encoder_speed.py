"""Encoder throughput and the time to first token of a request with images.

Sections (each writes its rows into the JSON):

  vision      images/s of the vision encoder on batches of --images-per-batch images packed
              into one pass, at 448 x 448 and 1036 x 1036 (1024 rounded to a multiple of
              patch x merge = 28), for the default model's encoder (4.8M parameters) and a
              300M-parameter configuration (width 1024, 24 layers);
  audio       seconds of audio encoded per second (--clips-per-batch clips of --clip-seconds,
              packed), for the default model's audio encoder and the 816B preset's;
  ttft        the wall time of a one-token generation for a request with 4 images, through
              `muse.LLM` on the default preset (random weights; its processor brings each image
              to 224 x 224, 64 tokens), with new images (encoder-cache miss) and with the same
              images behind other text (encoder-cache hit, no prefix-cache hit).

Every timing is the median of --repeats after a warm-up, on the device's default dtype
(bf16 on CUDA, float32 on CPU).

    python benchmarks/encoder_speed.py --out encoder_speed.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch
from PIL import Image

from benchmarks.engines import synchronize
from benchmarks.options import resolve_device
from benchmarks.report import environment, fmt, table, write_json
from muse.chat_format import IMAGE_END_ID, IMAGE_ID, IMAGE_START_ID
from muse.config import AudioConfig, VisionConfig
from muse.info import audio_parameters, vision_parameters
from muse.multimodal.audio import AudioEncoder
from muse.multimodal.vision import VisionEncoder
from muse.presets import full_816b, spark_default

TEXT_HIDDEN = 256  # the default model's decoder width (the projectors' output)
VISION_300M = VisionConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                           intermediate_size=4096)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--sections", default="vision,audio,ttft")
    parser.add_argument("--images-per-batch", type=int, default=16)
    parser.add_argument("--clips-per-batch", type=int, default=16)
    parser.add_argument("--clip-seconds", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None, help="JSON file for the results")
    return parser.parse_args(argv)


def _median_seconds(run: Any, device: torch.device, repeats: int) -> float:
    run()
    synchronize(device)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@torch.inference_mode()
def vision_rows(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    rows = []
    configs = {"default (4.8M)": spark_default().vision_config, "300M": VISION_300M}
    for name, config in configs.items():
        encoder = VisionEncoder(config, TEXT_HIDDEN).to(device, _dtype(device)).eval()
        for side in (448, 1036):
            images = [torch.rand(3, side, side, device=device)
                      for _ in range(args.images_per_batch)]
            seconds = _median_seconds(lambda: encoder(images), device, args.repeats)
            rows.append({"encoder": name, "parameters": vision_parameters(config, TEXT_HIDDEN),
                         "image_side": side, "images_per_batch": len(images),
                         "patches_per_image": (side // config.patch_size) ** 2,
                         "seconds_per_batch": seconds, "images_per_s": len(images) / seconds})
    return rows


@torch.inference_mode()
def audio_rows(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    rows = []
    configs: dict[str, AudioConfig] = {"default (3.4M)": spark_default().audio_config,
                                      "816B preset": full_816b().audio_config}
    for name, config in configs.items():
        encoder = AudioEncoder(config, TEXT_HIDDEN).to(device, _dtype(device)).eval()
        samples = int(args.clip_seconds * config.sample_rate)
        clips = [torch.rand(samples, device=device) * 2 - 1 for _ in range(args.clips_per_batch)]
        seconds = _median_seconds(lambda: encoder(clips), device, args.repeats)
        audio_seconds = args.clip_seconds * len(clips)
        rows.append({"encoder": name, "parameters": audio_parameters(config, TEXT_HIDDEN),
                     "clips_per_batch": len(clips), "clip_seconds": args.clip_seconds,
                     "seconds_per_batch": seconds, "audio_seconds_per_s": audio_seconds / seconds})
    return rows


def _images(rng: np.random.Generator, count: int) -> list[Image.Image]:
    return [Image.fromarray(rng.integers(0, 256, (448, 448, 3), dtype=np.uint8))
            for _ in range(count)]


def ttft_rows(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    from muse import LLM, SamplingParams

    llm = LLM(model="muse-spark-default", device=str(device))
    params = SamplingParams(temperature=0.0, max_tokens=1)
    rng = np.random.default_rng(0)
    image_part = [IMAGE_START_ID, IMAGE_ID, IMAGE_END_ID]

    def prompt(seed: int) -> list[int]:
        # Text before the images differs per request, so no prefix-cache block is shared.
        text = [int(t) for t in np.random.default_rng(seed).integers(100, 8000, 32)]
        return text + image_part * 4 + [100, 101, 102]

    def first_token(seed: int, images: list[Image.Image]) -> float:
        began = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt(seed),
                       "multi_modal_data": {"image": images}}], params, use_tqdm=False)
        return time.perf_counter() - began

    first_token(0, _images(rng, 4))  # warm-up: kernels, allocator
    miss, hit = [], []
    for repeat in range(args.repeats):
        images = _images(rng, 4)
        miss.append(first_token(1000 + repeat, images))
        hit.append(first_token(2000 + repeat, images))
    return [{"request": "4 images, 448x448 each (64 tokens after resizing)",
             "ttft_s_encoder_cache_miss": statistics.median(miss),
             "ttft_s_encoder_cache_hit": statistics.median(hit)}]


SECTIONS = {"vision": vision_rows, "audio": audio_rows, "ttft": ttft_rows}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = resolve_device(args.device)
    record: dict[str, Any] = {"benchmark": "encoder_speed", "environment": environment(device),
                              "args": vars(args)}
    for section in args.sections.split(","):
        record[section] = SECTIONS[section](args, device)
    if "vision" in record:
        print(table(["encoder", "side", "images/s"],
                    [[r["encoder"], str(r["image_side"]), fmt(r["images_per_s"], 1)]
                     for r in record["vision"]]))
    if "audio" in record:
        print(table(["encoder", "audio s/s"],
                    [[r["encoder"], fmt(r["audio_seconds_per_s"], 0)] for r in record["audio"]]))
    if "ttft" in record:
        for r in record["ttft"]:
            print(f"TTFT {r['request']}: miss {r['ttft_s_encoder_cache_miss'] * 1000:.1f} ms, "
                  f"hit {r['ttft_s_encoder_cache_hit'] * 1000:.1f} ms")
    write_json(args.out, record)


if __name__ == "__main__":
    main()

"""The `muse` command line: one subcommand per job, each a thin layer over the library."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from muse.config import ConfigError, MuseSparkConfig
from muse.presets import PRESETS, get_preset


def resolve_config(preset_or_path: str) -> MuseSparkConfig:
    """A preset name, or a checkpoint folder holding a config.json."""
    if preset_or_path in PRESETS:
        return get_preset(preset_or_path)
    from muse.checkpoint import load_config

    return load_config(preset_or_path)


def cmd_info(args: argparse.Namespace) -> None:
    from muse.info import format_info, model_info

    info = model_info(resolve_config(args.model), context=args.context, kv_dtype=args.kv_dtype)
    print(json.dumps(info.to_dict(), indent=2) if args.json else format_info(info))


def cmd_init(args: argparse.Namespace) -> None:
    from muse.init_checkpoint import init_random_checkpoint

    config = resolve_config(args.preset)
    init_random_checkpoint(config, args.out, seed=args.seed, dtype=args.dtype)
    print(f"wrote a random {config.name or args.preset} checkpoint (seed {args.seed}) to {args.out}")


def cmd_train_tokenizer(args: argparse.Namespace) -> None:
    from muse.tokenizer import train_tokenizer

    files = [Path(f) for f in args.files]
    tokenizer = train_tokenizer(files, vocab_size=args.vocab_size, out_dir=Path(args.out))
    print(f"trained a {tokenizer.vocab_size}-token tokenizer on {len(files)} files -> {args.out}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="muse", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="parameter counts and KV-cache sizes of a model")
    info.add_argument("model", help=f"a preset ({', '.join(PRESETS)}) or a checkpoint folder")
    info.add_argument("--context", type=int, default=None,
                      help="context length for the KV-cache figure (default: the model's maximum)")
    info.add_argument("--kv-dtype", default="bfloat16",
                      choices=["bfloat16", "float16", "float32", "fp8"])
    info.add_argument("--json", action="store_true", help="machine-readable output")
    info.set_defaults(func=cmd_info)

    init = sub.add_parser("init", help="write a seeded random checkpoint of a preset")
    init.add_argument("out", help="output folder")
    init.add_argument("--preset", required=True, help=f"one of {', '.join(PRESETS)}")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                      help="weight dtype (default: the config's)")
    init.set_defaults(func=cmd_init)

    tok = sub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer on text files")
    tok.add_argument("out", help="output folder")
    tok.add_argument("files", nargs="+", help="training text files")
    tok.add_argument("--vocab-size", type=int, default=8192)
    tok.set_defaults(func=cmd_train_tokenizer)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as error:
        print(f"muse {args.command}: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()

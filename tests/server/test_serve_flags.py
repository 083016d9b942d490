"""`muse serve` flags: each says its default, and each can come from `MUSE_<FLAG>`."""

from __future__ import annotations

import argparse

import pytest

from muse.server.launch import add_serve_arguments, apply_environment_defaults


def serve_parser(environ: dict[str, str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="muse serve")
    add_serve_arguments(parser, default_model="checkpoints/muse-spark-default")
    if environ is not None:
        apply_environment_defaults(parser, environ)
    return parser


def test_every_flag_has_a_help_that_states_its_default():
    missing = [action.dest for action in serve_parser()._actions
               if action.dest != "help" and "default" not in (action.help or "")]
    assert not missing


def test_every_flag_can_come_from_the_environment():
    parsed = serve_parser({
        "MUSE_MODEL": "muse-spark-tiny", "MUSE_API_KEY": "sk-env", "MUSE_PORT": "9001",
        "MUSE_ENABLE_PREFIX_CACHING": "false", "MUSE_ENFORCE_EAGER": "yes",
        "MUSE_SERVED_MODEL_NAME": "a b", "MUSE_ALLOWED_ORIGINS": '["https://x.example"]',
        "MUSE_REQUEST_BODY_TIMEOUT": "2.5", "MUSE_REASONING_PARSER": "muse",
    }).parse_args([])
    assert (parsed.model, parsed.api_key, parsed.port) == ("muse-spark-tiny", "sk-env", 9001)
    assert parsed.enable_prefix_caching is False and parsed.enforce_eager is True
    assert parsed.served_model_name == ["a", "b"]
    assert parsed.allowed_origins == ["https://x.example"]
    assert parsed.request_body_timeout == 2.5 and parsed.reasoning_parser == "muse"


def test_the_command_line_wins_over_the_environment():
    parsed = serve_parser({"MUSE_PORT": "9001"}).parse_args(["--port", "9002"])
    assert parsed.port == 9002


@pytest.mark.parametrize(("name", "value"), [("MUSE_PORT", "eighty"),
                                             ("MUSE_ENFORCE_EAGER", "maybe"),
                                             ("MUSE_REASONING_PARSER", "other")])
def test_a_bad_environment_value_is_a_clear_error(name, value):
    with pytest.raises(SystemExit, match=name):
        serve_parser({name: value})

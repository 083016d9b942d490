"""Seeded synthetic text in the styles a coding agent sees: prose, Python, shell output, diffs.

Every source is an endless generator driven by one `random.Random`, so the text for a larger
budget extends the text for a smaller one and a piece can be cut to any length (see
`muse.bench.tokens.Sizer`). The content only has to look like an agent's context to a
tokenizer and to a prefix cache; nobody reads it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator

TextSource = Callable[[random.Random], Iterator[str]]

NOUNS = ("request", "cache", "block", "token", "config", "session", "path", "buffer", "worker",
         "queue", "model", "layer", "batch", "result", "error", "handler", "client", "server",
         "stream", "record", "index", "table", "schema", "event", "parser", "reader", "writer",
         "limit", "offset", "window", "state", "node", "graph", "entry", "value", "metric")
VERBS = ("get", "set", "load", "save", "parse", "build", "update", "compute", "check", "run",
         "read", "write", "fetch", "apply", "reset", "merge", "split", "find", "create", "delete",
         "flush", "encode", "decode", "validate", "render", "schedule", "resolve", "collect")
ADJECTIVES = ("new", "old", "empty", "cached", "pending", "stale", "valid", "local", "remote",
              "default", "current", "next", "last", "partial", "shared", "raw", "sorted")
PROSE_WORDS = ("the", "a", "of", "to", "and", "in", "is", "that", "for", "it", "with", "as",
               "on", "be", "this", "when", "we", "should", "not", "but", "each", "must",
               "before", "after", "then", "only", "every", "which", "file", "function",
               "change", "test", "code", "issue", "repository", "command", "output", "step")
TYPES = ("int", "str", "float", "bool", "list[int]", "dict[str, int]", "bytes", "None")


def identifier(rng: random.Random) -> str:
    return f"{rng.choice(VERBS)}_{rng.choice(ADJECTIVES)}_{rng.choice(NOUNS)}"


def class_name(rng: random.Random) -> str:
    return rng.choice(ADJECTIVES).capitalize() + rng.choice(NOUNS).capitalize()


def file_path(rng: random.Random) -> str:
    parts = [rng.choice(NOUNS) for _ in range(rng.randint(1, 3))]
    return "/workspace/repo/src/" + "/".join(parts) + f"/{rng.choice(NOUNS)}.py"


def sentence(rng: random.Random) -> str:
    words = [rng.choice(PROSE_WORDS if rng.random() < 0.7 else NOUNS + VERBS)
             for _ in range(rng.randint(6, 18))]
    return " ".join(words).capitalize() + "."


def prose(rng: random.Random) -> Iterator[str]:
    while True:
        yield " ".join(sentence(rng) for _ in range(rng.randint(2, 6))) + "\n\n"


def python_source(rng: random.Random) -> Iterator[str]:
    """Module-level code: imports, then an endless run of classes and functions."""
    for _ in range(rng.randint(2, 5)):
        yield f"from {rng.choice(NOUNS)}.{rng.choice(NOUNS)} import {class_name(rng)}\n"
    yield "\n"
    while True:
        if rng.random() < 0.3:
            yield f"\nclass {class_name(rng)}:\n    \"\"\"{sentence(rng)}\"\"\"\n\n"
            indent = "    "
        else:
            indent = ""
        for _ in range(rng.randint(1, 4)):
            yield from _function(rng, indent)


def _function(rng: random.Random, indent: str) -> Iterator[str]:
    args = ", ".join(f"{rng.choice(NOUNS)}: {rng.choice(TYPES)}"
                     for _ in range(rng.randint(0, 3)))
    if indent:
        args = "self" + (", " + args if args else "")
    yield f"{indent}def {identifier(rng)}({args}) -> {rng.choice(TYPES)}:\n"
    body = indent + "    "
    for _ in range(rng.randint(2, 9)):
        roll = rng.random()
        name = rng.choice(NOUNS)
        if roll < 0.35:
            yield f"{body}{name} = {identifier(rng)}({rng.choice(NOUNS)}, {rng.randint(0, 64)})\n"
        elif roll < 0.55:
            message = f"{rng.choice(ADJECTIVES)} {name}: {{{name}}}"
            yield (f"{body}if {name} is None or len({name}) > {rng.randint(1, 512)}:\n"
                   f"{body}    raise ValueError(f\"{message}\")\n")
        elif roll < 0.75:
            yield (f"{body}for {name} in self.{rng.choice(NOUNS)}s:\n"
                   f"{body}    {rng.choice(NOUNS)}.{identifier(rng)}({name})\n")
        else:
            yield f"{body}# {sentence(rng)}\n"
    yield f"{body}return {rng.choice(NOUNS)}\n\n"


def numbered_file(rng: random.Random) -> Iterator[str]:
    """A file viewed with line numbers, as an editor tool shows it."""
    yield f"Here's the result of running `cat -n` on {file_path(rng)}:\n"
    number = 1
    for chunk in python_source(rng):
        for line in chunk.splitlines():
            yield f"{number:6}\t{line}\n"
            number += 1


def command_output(rng: random.Random) -> Iterator[str]:
    """Shell output: test runs, searches and listings, mixed."""
    while True:
        kind = rng.random()
        if kind < 0.4:
            yield f"$ python -m pytest {file_path(rng)} -q\n"
            for _ in range(rng.randint(3, 12)):
                status = "PASSED" if rng.random() < 0.8 else "FAILED"
                yield (f"tests/test_{rng.choice(NOUNS)}.py::test_{identifier(rng)} {status} "
                       f"[{rng.randint(1, 100):3}%]\n")
            yield (f"E   AssertionError: assert {rng.randint(0, 999)} == {rng.randint(0, 999)}\n"
                   f"{rng.randint(1, 40)} passed, {rng.randint(0, 5)} failed in "
                   f"{rng.uniform(0.1, 30.0):.2f}s\n")
        elif kind < 0.7:
            yield f"$ grep -rn \"{identifier(rng)}\" src/\n"
            for _ in range(rng.randint(2, 10)):
                yield (f"{file_path(rng)}:{rng.randint(1, 900)}:    "
                       f"{rng.choice(NOUNS)} = {identifier(rng)}()\n")
        else:
            yield f"$ ls -la {file_path(rng).rsplit('/', 1)[0]}\n"
            for _ in range(rng.randint(3, 10)):
                yield (f"-rw-r--r-- 1 root root {rng.randint(100, 90000):6} Mar "
                       f"{rng.randint(1, 28):2} {rng.randint(0, 23):02}:{rng.randint(0, 59):02} "
                       f"{rng.choice(NOUNS)}.py\n")


def unified_diff(rng: random.Random) -> Iterator[str]:
    """`git diff` output: hunks of context, removed and added lines."""
    while True:
        path = file_path(rng).removeprefix("/workspace/repo/")
        yield f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n"
        for _ in range(rng.randint(1, 3)):
            start = rng.randint(1, 800)
            yield f"@@ -{start},7 +{start},{rng.randint(5, 12)} @@ def {identifier(rng)}():\n"
            for _ in range(rng.randint(4, 12)):
                mark = rng.choice(" -+  ")
                yield f"{mark}    {rng.choice(NOUNS)} = {identifier(rng)}({rng.choice(NOUNS)})\n"


TOOL_RESULT_SOURCES: dict[str, TextSource] = {
    "file": numbered_file,
    "command": command_output,
    "diff": unified_diff,
}


def tool_schemas() -> list[dict]:
    """Function schemas in the shape coding agents declare them (OpenHands' tool set)."""
    string = {"type": "string"}
    return [
        {"name": "execute_bash",
         "description": "Execute a bash command in the terminal. Long-running commands should "
                        "be run in the background; output is truncated past 30000 characters.",
         "parameters": {"type": "object", "required": ["command"], "properties": {
             "command": {**string, "description": "The bash command to execute."},
             "is_input": {"type": "string", "enum": ["true", "false"]},
             "timeout": {"type": "number", "description": "Seconds before the command stops."}}}},
        {"name": "str_replace_editor",
         "description": "View, create and edit files. `view` shows a file with line numbers; "
                        "`str_replace` replaces exactly one occurrence of `old_str`.",
         "parameters": {"type": "object", "required": ["command", "path"], "properties": {
             "command": {"type": "string",
                         "enum": ["view", "create", "str_replace", "insert", "undo_edit"]},
             "path": {**string, "description": "Absolute path to a file or directory."},
             "file_text": string, "old_str": string, "new_str": string,
             "insert_line": {"type": "integer"},
             "view_range": {"type": "array", "items": {"type": "integer"}}}}},
        {"name": "execute_ipython_cell",
         "description": "Run Python code in an IPython cell and return its output.",
         "parameters": {"type": "object", "required": ["code"],
                        "properties": {"code": string}}},
        {"name": "think",
         "description": "Think about the problem without acting; the thought is logged.",
         "parameters": {"type": "object", "required": ["thought"],
                        "properties": {"thought": string}}},
        {"name": "finish",
         "description": "Signal that the task is complete and end the interaction.",
         "parameters": {"type": "object", "required": ["message"],
                        "properties": {"message": string}}},
    ]


def system_prompt(rng: random.Random) -> Iterator[str]:
    """An agent's instructions and tool schemas, then as many guidelines as the budget takes."""
    yield ("You are a coding agent working in a sandboxed repository at /workspace/repo. "
           "Solve the user's task by calling the tools below, one call per reply, in the form\n"
           "<function=NAME>\n<parameter=PARAM>VALUE</parameter>\n</function>\n\n"
           "# Tools\n\n")
    for schema in tool_schemas():
        yield json.dumps(schema, indent=2) + "\n\n"
    yield "# Guidelines\n\n"
    number = 1
    while True:
        yield f"{number}. {sentence(rng)} {sentence(rng)}\n"
        number += 1


def task_description(rng: random.Random) -> Iterator[str]:
    yield (f"<uploaded_files>\n/workspace/repo\n</uploaded_files>\n"
           f"I've uploaded a Python repository. Consider this issue: `{identifier(rng)}` fails "
           f"when the {rng.choice(NOUNS)} is {rng.choice(ADJECTIVES)}.\n\n")
    yield from prose(rng)


def tool_call(rng: random.Random, tool: str) -> str:
    """An assistant reply's call, in the text form the system prompt asks for."""
    if tool == "execute_bash":
        parameters = {"command": f"cd /workspace/repo && python -m pytest -q -k {identifier(rng)}"}
    elif tool == "str_replace_editor":
        parameters = {"command": rng.choice(["view", "str_replace"]), "path": file_path(rng)}
    elif tool == "execute_ipython_cell":
        parameters = {"code": f"print({identifier(rng)}({rng.randint(0, 99)}))"}
    elif tool == "think":
        parameters = {"thought": sentence(rng)}
    else:
        raise ValueError(f"no call template for tool {tool!r}")
    body = "".join(f"<parameter={k}>{v}</parameter>\n" for k, v in parameters.items())
    return f"<function={tool}>\n{body}</function>"

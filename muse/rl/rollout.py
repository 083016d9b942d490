"""Token-in / token-out multi-turn rollouts.

A trajectory's ids are `prompt_ids + response_ids`, grown one turn at a time: each turn
appends exactly the token ids the engine sampled (loss mask 1, with their log-probs), and,
when the reply calls tools, the tokens of the environment's newly appended text (mask 0).
The conversation is never re-rendered and the model's output is never re-tokenized:
decode -> encode is not a bijection and templates rewrite history, so a trainer fed
re-rendered ids would score tokens the policy never emitted.

The environment's text is what the chat template writes between the end of an assistant
turn and the start of the next assistant turn's content (for muse:
`\\n<|tool|>{content}<|end|>\\n<|assistant|>`). It is derived from `apply_chat_template` by
rendering a conversation with and without the tool messages, so any template works, and it
is tokenized alone: the template's own special-token strings become their ids, while those
inside a tool's content stay plain text, as `apply_chat_template(tokenize=True)` encodes them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from dataclasses import dataclass
from typing import Any

from muse.engine.sampling_params import SamplingParams
from muse.literal_specials import LiteralSpecials
from muse.lora.request import LoRARequest
from muse.outputs import CompletionOutput
from muse.rl.rewards import load_reward
from muse.rl.tool_env import ToolEnvironment
from muse.tokenizer import MuseTokenizer


@dataclass
class Trajectory:
    task: dict
    prompt_ids: list[int]  # the first prompt (chat template with add_generation_prompt)
    # Everything after it: the engine's sampled tokens and the environment's tokens.
    response_ids: list[int]
    loss_mask: list[int]  # per response token: 1 = sampled by the engine, 0 = environment
    # Per response token: the engine's log-prob of the sampled token under the model's raw
    # distribution (before temperature, top-k/p); 0.0 where the mask is 0.
    rollout_logprobs: list[float]
    replies: list[str]  # each assistant turn's ids, decoded with skip_special_tokens=False
    num_turns: int
    # Of the last turn ("stop", "length", ...); also "length" when the token budget left no
    # room for the turn its tool calls asked for.
    finish_reason: str | None
    # The adapter version the turns ran with (None: the base model); a list, one per turn,
    # when the adapter was updated between turns.
    lora_version: int | list[int | None] | None
    reward: float = 0.0


class ToolTurnText:
    """The tokens a chat template puts between an assistant's end of turn and the next
    assistant turn's content, for one task's conversation."""

    def __init__(self, tokenizer: MuseTokenizer, task: dict[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.tools = task.get("tools")
        # A stand-in for the reply: the template's text after it is the text after any reply.
        self.placeholder = f"muse-rollout-reply-{secrets.token_hex(8)}"
        self.messages = [*task["messages"], {"role": "assistant", "content": self.placeholder}]
        self.without_tools = self._render(self.messages, add_generation_prompt=False)
        if self.placeholder not in self.without_tools:
            raise ValueError("the chat template does not write an assistant message's content, "
                             "so the text between two assistant turns cannot be derived from it")
        reply_end = self.without_tools.rindex(self.placeholder) + len(self.placeholder)
        # How the template closes an assistant turn, e.g. "<|end|>\n".
        self.turn_close = self.without_tools[reply_end:]

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=add_generation_prompt,
            tokenize=False)

    def ids(self, stop_token_id: int, tool_messages: list[dict[str, Any]]) -> list[int] | None:
        """Ids of the text after a reply that ended with `stop_token_id` up to the next
        assistant turn's content; None when that token does not close an assistant turn
        in this template (the conversation cannot continue from it)."""
        stop_text = self.tokenizer.decode([stop_token_id], skip_special_tokens=False)
        at = self.turn_close.find(stop_text) if stop_text else -1
        if at < 0:
            return None
        # Special-token strings in a tool's output are marked so they stay text.
        literals = LiteralSpecials()
        with_tools = self._render([*self.messages, *literals.wrap(tool_messages)],
                                  add_generation_prompt=True)
        if not with_tools.startswith(self.without_tools):
            raise ValueError("the chat template renders a conversation differently once tool "
                             "messages follow its last assistant turn, so the tool text "
                             "between two assistant turns cannot be derived from it")
        text = self.turn_close[at + len(stop_text):] + with_tools[len(self.without_tools):]
        tokenizer = self.tokenizer
        ids: list[int] = []
        for piece, literal in literals.split(text):
            ids += tokenizer.encode_as_text(piece) if literal else tokenizer.encode(piece)
        return ids


@dataclass
class _Running:
    """One trajectory while it is rolled out."""

    trajectory: Trajectory
    task_index: int
    sample_index: int
    environment: ToolEnvironment | None
    lora_versions: list[int | None] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.trajectory.prompt_ids) + len(self.trajectory.response_ids)


def _turn_seed(seed: int | None, task_index: int, sample_index: int, turn: int) -> int | None:
    """A seed of its own for each task's first turn and each later turn of each trajectory:
    reproducible, and not the same stream for every request of the turn."""
    if seed is None:
        return None
    digest = hashlib.sha256(f"{seed}/{task_index}/{sample_index}/{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**63


def _turn_params(params: SamplingParams, n: int, seed: int | None, num_tokens: int,
                 limit: int) -> SamplingParams:
    room = limit - num_tokens
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    return dataclasses.replace(params, n=n, seed=seed, max_tokens=max_tokens,
                               logprobs=params.logprobs if params.logprobs is not None else 0)


def _ends_turn(completion: CompletionOutput) -> bool:
    """Whether the reply ended with a stop token (not a length cut or a stop string)."""
    return (completion.finish_reason == "stop" and isinstance(completion.stop_reason, int)
            and bool(completion.token_ids) and completion.token_ids[-1] == completion.stop_reason)


def rollout(llm: Any, tasks: list[dict], sampling_params: SamplingParams, *,
            group_size: int = 1, lora_request: LoRARequest | None = None, max_turns: int = 4,
            max_total_tokens: int | None = None) -> list[list[Trajectory]]:
    """`group_size` trajectories per task, in task order, each of at most `max_turns`
    assistant turns (or the task's own "max_turns", when lower: the unseen-tool tasks score
    their first reply alone).

    The first turn runs with n=group_size, so the samples share the prompt's KV; each later
    turn sends one request per live trajectory, all in one `llm.generate` call. A turn whose
    reply calls tools (tasks with "tools") gets the environment's tool messages appended and
    continues; a reply without calls, or one that does not end with an end-of-turn token
    (cut by max_tokens), ends its trajectory. `prompt_ids + response_ids` never exceed
    `max_total_tokens` nor the model's maximum length: a trajectory ends when the next
    prompt would leave no room. With a seed in `sampling_params`, a rerun reproduces every
    trajectory token for token. `sampling_params.n` is ignored (`group_size` sets it), and
    its `logprobs` becomes 0 when None. Each trajectory's reward is task["reward"] (a
    `load_reward` spec) of its replies joined in order; 0.0 for a task without one.
    """
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
    if not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"max_turns must be an integer >= 1, got {max_turns!r}")
    tokenizer: MuseTokenizer = llm.tokenizer
    limit = llm.engine.max_model_len
    if max_total_tokens is not None:
        limit = min(limit, max_total_tokens)
    prompts = [tokenizer.apply_chat_template(task["messages"], tools=task.get("tools"),
                                             add_generation_prompt=True, tokenize=True)
               for task in tasks]
    for index, prompt in enumerate(prompts):
        if len(prompt) >= limit:
            raise ValueError(f"tasks[{index}]'s prompt has {len(prompt)} tokens, leaving no "
                             f"room to generate within {limit} tokens (max_total_tokens or "
                             f"the model's maximum length)")
    tool_text = [ToolTurnText(tokenizer, task) if task.get("tools") else None for task in tasks]
    groups = [[_Running(Trajectory(task, list(prompt), [], [], [], [], 0, None, None),
                        task_index, sample_index,
                        ToolEnvironment(task.get("facts")) if task.get("tools") else None)
               for sample_index in range(group_size)]
              for task_index, (task, prompt) in enumerate(zip(tasks, prompts))]

    live = [running for group in groups for running in group]
    for turn in range(max_turns):
        if not live:
            break
        if turn == 0:
            requests = [{"prompt_token_ids": prompt} for prompt in prompts]
            # Each task's group draws its own stream (the samples of one group share it, as
            # n > 1 requests do, each sample its own part).
            params = [_turn_params(sampling_params, group_size,
                                   _turn_seed(sampling_params.seed, index, 0, 0), len(prompt),
                                   limit) for index, prompt in enumerate(prompts)]
        else:
            requests = [{"prompt_token_ids": r.trajectory.prompt_ids + r.trajectory.response_ids}
                        for r in live]
            params = [_turn_params(sampling_params, 1, _turn_seed(
                sampling_params.seed, r.task_index, r.sample_index, turn), r.num_tokens, limit)
                      for r in live]
        outputs = llm.generate(requests, params, use_tqdm=False, lora_request=lora_request)
        replies = [(completion, output.lora_version)
                   for output in outputs for completion in output.outputs]
        still_live = []
        for running, (completion, lora_version) in zip(live, replies, strict=True):
            turns = min(max_turns, running.trajectory.task.get("max_turns", max_turns))
            if _append_turn(running, completion, lora_version, tokenizer,
                         tool_text[running.task_index], last_turn=turn + 1 >= turns,
                         limit=limit):
                still_live.append(running)
        live = still_live

    rewards: dict[str, Any] = {}
    for group in groups:
        for running in group:
            trajectory = running.trajectory
            versions = running.lora_versions
            trajectory.lora_version = versions[0] if len(set(versions)) == 1 else versions
            spec = trajectory.task.get("reward")
            if spec is not None:
                if spec not in rewards:
                    rewards[spec] = load_reward(spec)
                trajectory.reward = float(rewards[spec]("".join(trajectory.replies),
                                                        trajectory.task))
    return [[running.trajectory for running in group] for group in groups]


def _append_turn(running: _Running, completion: CompletionOutput, lora_version: int | None,
              tokenizer: MuseTokenizer, tool_text: ToolTurnText | None, *, last_turn: bool,
              limit: int) -> bool:
    """Append one turn's reply (and, if it calls tools, the environment's answer) to the
    trajectory; whether another turn follows."""
    trajectory = running.trajectory
    if completion.logprobs is None or len(completion.logprobs) != len(completion.token_ids):
        raise RuntimeError("the engine returned no log-prob for some sampled token")
    trajectory.response_ids += completion.token_ids
    trajectory.loss_mask += [1] * len(completion.token_ids)
    trajectory.rollout_logprobs += [entry.logprob for entry in completion.logprobs]
    reply = tokenizer.decode(completion.token_ids, skip_special_tokens=False)
    trajectory.replies.append(reply)
    trajectory.num_turns += 1
    trajectory.finish_reason = completion.finish_reason
    running.lora_versions.append(lora_version)
    if tool_text is None or last_turn or not _ends_turn(completion):
        return False
    tool_messages = running.environment.respond(reply, trajectory.task["tools"])
    if not tool_messages:
        return False
    environment_ids = tool_text.ids(completion.token_ids[-1], tool_messages)
    if environment_ids is None:
        return False
    if running.num_tokens + len(environment_ids) >= limit:
        trajectory.finish_reason = "length"
        return False
    trajectory.response_ids += environment_ids
    trajectory.loss_mask += [0] * len(environment_ids)
    trajectory.rollout_logprobs += [0.0] * len(environment_ids)
    return True

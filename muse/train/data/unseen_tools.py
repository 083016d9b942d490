"""Tool use with tools made up on the spot, so the model learns to read the schema it is given
instead of recalling the few tools it trained on.

A tool is a snake_case name built from word lists (`archive_invoice`, `scan_shared_locker`),
a description and one to three arguments with random names and types (string, integer,
number, boolean, enum). The user asks for the tool's action and states every argument's value
as written in the call, so the call is copied, never guessed. Three kinds of case:

- `call`: the one offered tool fits; the assistant calls it and answers from its result.
- `choose`: two to four tools are offered and one fits (the others may share its verb or its
  noun); the assistant calls that one and answers from its result.
- `no_tool`: the user asks for an action no offered tool does; the assistant says so
  without calling anything.

Vocabularies and phrasings are split by `split.split_items`: held-out cases use verbs,
nouns, qualifiers, argument words and phrasings that training never shows. A dozen training
phrasings would teach where the action starts in each of them, and a held-out phrasing then
gets its own words copied as the action ("The user asks to ahead and ..."): so training builds
half its requests from parts (`composed_request`: an optional opener, one of many lead-ins or
none, the action, an argument introducer, the argument phrases, an ending and an optional
closer), hundreds of shapes, none holding a held-out phrasing's text around the action; some
lead-ins are unknown words (`unknown_lead_in`), so the action is found by its own shape.
Users also start a request with its verb ("Book a table for four") and say "a" or "my" where
the generated actions said "the": training words half its actions with other determiners
and starts some requests with the capitalized action (held-out cases are as they were).

A vocabulary of a few dozen words would be learnt by heart, and a model that knows the names
never needs to read them from the schema: so training also draws most words from elsewhere, a
share (MADE_UP_SHARE) made-up words of one to three syllables that may start with any letter,
from a space of millions, a share (COMMON_WORD_SHARE) everyday words of the Python standard
library (`muse/assets/tool_words.txt`, without the held-out words), and a share
(PIECE_WORD_SHARE) words strung together from the tokenizer's own letter pieces
(`piece_word`). A model copies a name token by token, and a token it never wrote in a name it
does not write when copying one ("trailer" is "tr" + "ailer": a model that never wrote "ailer"
copies "trggle"); syllables and everyday words reach only part of the vocabulary, the pieces
reach all of it. Held-out words stay unseen as words (no training word equals one), while
their pieces are written like every other piece. It also gives the first version's tool names
(`get_weather`, ...) made-up argument names, so that what a name is called is always read
from the offered schema and the request.

The assistant's reasoning repeats the action (a lookup, what it asks for: "The user asks for
the order status."), lists the offered tools' names in order and then names the one it calls,
or says that none of them can do the action: the decision compares names written right before
it instead of recalling a name that fits the request. Messages have
the shape of `tools.exchange`, so the chat template renders them and the tool list goes to
`tools=` as `offered_schemas(case)`.
"""

from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from muse.tokenizer import MuseTokenizer
from muse.train.data.split import HELD_OUT, TRAIN, split_items
from muse.train.data.tools import (asks, asks_for, function_schema, none_can, offered_names,
                                   quoted, will_call)

KINDS = ("call", "choose", "no_tool")
# Training words drawn as made-up, pieced or common words rather than from the word lists.
MADE_UP_SHARE = 0.15
PIECE_WORD_SHARE = 0.3
COMMON_WORD_SHARE = 0.2
COMMON_WORDS_FILE = Path(__file__).resolve().parents[2] / "assets" / "tool_words.txt"
# Training tools that take a name of the first version's tools, with made-up arguments.
FAMILIAR_NAME_SHARE = 0.1
FAMILIAR_NAMES = (("get", "weather"), ("add", "numbers"), ("search", "files"),
                  ("convert", "currency"), ("get", "time"), ("get", "stock_price"),
                  ("send", "email"))
# Every letter starts some syllable; "" lets a word (or a syllable) start with its vowel.
ONSETS = ("", "", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "qu", "r", "s",
          "t", "v", "w", "x", "y", "z", "br", "tr", "st", "pl", "gr", "sh", "ch", "kr", "th",
          "ph", "wh", "cl", "fl", "sp", "sk", "sn", "dr")
VOWELS = ("a", "e", "i", "o", "u", "y", "ai", "ea", "oo", "ou", "ie")
CODAS = ("", "", "", "n", "r", "s", "l", "x", "m", "t", "ck", "ng", "d", "p", "g")
# More declines (0.2, 0.45, 0.35) moved replies from calling to declining without more of
# them right (a probe from run 10, docs/training.md "Run 10").
KIND_WEIGHTS = (0.3, 0.5, 0.2)
# The most tools a case offers: a choice offers the fitting one and one to three others.
MOST_OFFERED = 4
# Of training distractors for a target with a qualifier: its verb and noun, another qualifier.
QUALIFIER_MISS_SHARE = 0.2
# Of training distractors, beyond the quarter every split draws: one with the target's verb
# and another object. Run 30's wrong calls were mostly of a tool with the request's verb (18
# of 23): the verdict read the verb alone, which training must make wrong more often.
VERB_MISS_SHARE = 0.2
# Of training distractors: one that also takes some of the target's argument names. Without
# them a distractor's arguments never matched the request's, and the model learnt to call
# whichever tool takes the arguments the user names: read teacher-forced, held-out declines
# were right 0.97 of the time where no offered tool shares an argument word with the request
# and 0.37 where one does (63% of them: the held-out names have eight argument words). So
# far they move decisions from choosing to declining rather than adding right ones: the names
# alone must then decide, and held-out names are not read well enough (docs/training.md,
# run 21).
ARGUMENT_MISS_SHARE = 0.5
# Of the names such a distractor takes: a relative of the target's name (the same word with
# another prefix or none, `max_budget` for `budget`) rather than the name itself. Held-out
# declines miss as often where an offered argument shares only the word (0.36 of 64 cases)
# as where it shares the whole name (0.33 of 46).
RELATIVE_NAME_SHARE = 0.5
# Of training tools: an action worded with another determiner than "the" ("book a table",
# "reset my router", "scan shared locker"), as users word theirs (held-out cases keep "the").
OTHER_DETERMINER_SHARE = 0.5
ACTION_DETERMINERS = ("a", "a", "my", "our", "this", "that", "your", "some", "")
ARGUMENT_TYPES = ("string", "integer", "number", "boolean", "enum")
# Of training string values: ids that look like numbers ("5521", "06:30"), which a model that
# never saw one writes unquoted, as a number, whatever the schema says.
IDENTIFIER_SHARE = 0.15

VERBS = ("archive", "book", "cancel", "check", "clean", "close", "compress", "copy", "count",
         "create", "delete", "describe", "disable", "enable", "export", "fetch", "find", "flag",
         "format", "import", "index", "inspect", "label", "list", "load", "lock", "measure",
         "merge", "move", "open", "order", "pause", "publish", "rank", "rename", "renew",
         "reset", "resize", "restore", "rotate", "save", "scan", "schedule", "score", "sort",
         "split", "start", "stop", "submit", "summarize", "sync", "tag", "track", "translate",
         "unlock", "update", "upload", "validate", "verify", "weigh")
NOUNS = ("invoice", "ticket", "parcel", "playlist", "garden", "ledger", "recipe", "sensor",
         "drone", "vault", "badge", "shipment", "greenhouse", "telescope", "locker",
         "reservation", "voucher", "forecast", "backup", "roster", "inventory", "thermostat",
         "printer", "kiosk", "satellite", "bicycle", "album", "contract", "pipeline", "volume",
         "warehouse", "calendar", "aquarium", "podcast", "journal", "container", "firmware",
         "license", "mailbox", "orchard", "pallet", "receipt", "router", "spreadsheet",
         "subscription", "terminal", "trailer", "turbine", "webhook", "workshop")
QUALIFIERS = ("daily", "remote", "shared", "local", "pending", "archived", "public", "private",
              "weekly", "active", "draft", "primary", "secondary", "nightly", "guest", "team")
ARGUMENT_WORDS = ("label", "depth", "priority", "color", "region", "count", "limit", "owner",
                  "code", "zone", "level", "size", "weight", "speed", "format", "mode", "note",
                  "channel", "quota", "budget", "rating", "duration", "volume", "angle", "tag",
                  "language", "threshold", "margin", "batch", "stage", "version", "slot",
                  "seat", "floor", "shelf", "lane", "route", "gate", "port", "title")
ARGUMENT_PREFIXES = ("max", "min", "target", "source", "new", "default", "start", "end")
RESULT_FIELDS = ("status", "reference", "total", "confirmation", "message", "count", "id",
                 "receipt", "score", "state")
ENUM_SETS = (("low", "medium", "high"), ("red", "green", "blue"), ("daily", "weekly", "monthly"),
             ("asc", "desc"), ("small", "medium", "large", "huge"), ("north", "south", "east",
             "west"), ("draft", "review", "final"), ("json", "csv", "xml"),
             ("morning", "afternoon", "evening"), ("bronze", "silver", "gold", "platinum"))
STRING_WORDS = ("amber", "maple", "harbor", "quartz", "willow", "cobalt", "falcon", "lotus",
                "ember", "orbit", "pepper", "saffron", "tundra", "velvet", "zephyr", "meadow")
PEOPLE = ("Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jun")

# `{action}` is "verb the [qualifier] noun", `{arguments}` the argument phrases joined.
REQUEST_TEMPLATES = (
    "Please {action} with {arguments}.",
    "Can you {action}? Use {arguments}.",
    "I need you to {action}: {arguments}.",
    "Could you {action} using {arguments}?",
    "Go ahead and {action} ({arguments}).",
    "Time to {action}; {arguments}.",
    "My request: {action}, with {arguments}.",
    "Help me {action}. Here is what to use: {arguments}.",
    "Quick one: {action} with {arguments}.",
    "I'd like to {action}, {arguments}.",
    "Let's {action}. Set {arguments}.",
    "Would you {action} for me? Use {arguments}.",
    "Try to {action} given {arguments}.",
    "Please {action} now, {arguments}.",
    "Can we {action} with {arguments}, please?",
)
# Training requests built from parts rather than from REQUEST_TEMPLATES (see `composed_request`).
COMPOSED_REQUEST_SHARE = 0.5
OPENER_SHARE = 0.5
CLOSER_SHARE = 0.3
# Of composed requests: a bare imperative ("Okay, scan the locker ..."), or a question.
IMPERATIVE_SHARE = 0.35
QUESTION_SHARE = 0.3
# Of bare imperatives whose verb is a real word: the action starts the request, capitalized
# ("Book a table for ...", as users write), and the reasoning writes it in lower case.
LEADING_ACTION_SHARE = 0.7
# Of composed requests' lead-ins: one of unknown words ("Vostra plenk and ..."), so that the
# action is found by its own shape, a verb before its determiner, and not by the lead-ins
# training knows (runs 27 and 30 restated held-out "Let's pause the badge" as "let's pause
# the badge" and "Go ahead and check ..." as "the gohead").
UNKNOWN_LEAD_IN_SHARE = 0.25
UNKNOWN_LEAD_IN_SHAPES = ("{0} and", "{0} {1} and", "{0} {1},", "{0}, {1},", "{0} to",
                          "{0} {1} to", "{0} {1} {2} and", "{0} {1} {2},")
# No part holds a held-out template's text around `{action}` ("Go ahead and ", "I need you
# to ", "Let's ", or ": ", " (", ". Set " right after it), so held-out phrasings stay unseen.
# An opener that ends a sentence makes the next word a capital; the others run into it.
OPENERS = ("Hi.", "Hello!", "Hey there.", "Good morning.", "Hi {person}.", "Hello {person}!",
           "One more thing.", "New task.", "Next task.", "Sorry to bother you.",
           "I have a task for you.", "Here is another one.", "Quick favor.", "Morning!",
           "Thanks for earlier.")
RUN_ON_OPENERS = ("Okay,", "Ok so", "Right,", "Alright,", "So,", "Hey,", "Hey {person},",
                  "{person},", "Quick question:", "Next up:", "One more:", "Also,", "Now,",
                  "Oh, and", "By the way,", "Hmm,", "Well,", "Actually,", "Task:", "Request:",
                  "To do:", "Heads up:", "Listen,", "Real quick,")
LEAD_INS = ("please", "now please", "just", "please just", "kindly", "I want you to",
            "I'd like you to", "I would like you to", "I want to", "I'd love for you to",
            "I'm asking you to", "I am hoping you will", "we should", "we have to", "we must",
            "you should", "you can now", "your job is to", "your task is to",
            "the task is to", "the plan is to", "the next step is to", "it is time to",
            "it would help to", "remember to", "make sure to", "be sure to",
            "don't forget to", "try and", "please try to", "do me a favor and",
            "be a dear and", "take a moment and", "just go and", "please go and",
            "kindly go and", "hurry and", "first, please", "right now, please",
            "when you get a chance, please", "if you can, please", "for me, please",
            "as a favor, please", "I'd appreciate it if you would", "it'd be great if you would",
            "I was hoping you'd", "help me", "the goal is to", "when you can,", "if possible,",
            "first,", "next,", "this time,", "I want to ask you to", "the user wants to",
            "my plan is to", "we want to", "you need to")
QUESTION_LEAD_INS = ("can you", "could you", "would you", "will you", "can you please",
                     "could you please", "would you please", "would you be able to",
                     "are you able to", "is it possible to", "would it be possible to",
                     "any chance you could", "could I ask you to", "can I get you to",
                     "could you kindly", "can you quickly", "could you go and",
                     "can you try to", "would you kindly", "do you think you could",
                     "is there a way to", "could we", "can we", "please, could you",
                     "mind helping me")
# `{end}` closes the sentence of the action: after the arguments, or before a second sentence
# that gives them.
ARGUMENT_INTRODUCERS = (
    " with {arguments}{end}", ", with {arguments}{end}", " using {arguments}{end}",
    ", using {arguments}{end}", " given {arguments}{end}", " based on {arguments}{end}",
    " - {arguments}{end}", ", {arguments}{end}", "; {arguments}{end}", "; use {arguments}{end}",
    "; set {arguments}{end}", "; the values are {arguments}{end}", ", where {arguments}{end}",
    " [{arguments}]{end}", " by setting {arguments}{end}", " and set {arguments}{end}",
    " and use {arguments}{end}", ", passing {arguments}{end}",
    " with these values: {arguments}{end}", " where the values are {arguments}{end}",
    ", setting {arguments}{end}", "{end} Use {arguments}.", "{end} The values are {arguments}.",
    "{end} Please set {arguments}.", "{end} Arguments: {arguments}.",
    "{end} Values: {arguments}.", "{end} Details: {arguments}.",
    "{end} Settings are {arguments}.", "{end} Go with {arguments}.",
    "{end} Take {arguments}.", "{end} I want {arguments}.")
ENDINGS = (".", ".", ".", "!", ", please.", " please.", ", thanks.")
QUESTION_ENDINGS = ("?", "?", ", please?", " for me?")
CLOSERS = (" Thanks.", " Thank you!", " Cheers.", " Much appreciated.", " Thanks in advance.",
           " Appreciate it.", " Many thanks.", " That's all.", " Thanks, {person}.")

# `{name}` is the argument's name as written or with spaces for underscores.
ARGUMENT_TEMPLATES = (
    "{name} {value}",
    "{name} = {value}",
    "{name}: {value}",
    "{name} set to {value}",
    "the {name} {value}",
    "{value} as the {name}",
    "{value} for the {name}",
    "a {name} of {value}",
    "{name} equal to {value}",
    "the {name} being {value}",
    "{name} -> {value}",
    "the {name} as {value}",
)
# Training argument phrases built from parts (`composed_argument`). No part holds a held-out
# template's text ("{name} = {value}", "a {name} of {value}"): no "a ", no " = ", no " of ".
# Many links (48; 22 gave more misread arguments in a probe, docs/training.md "A probe of
# more argument links") teach that whatever joins a name to its value belongs to neither.
COMPOSED_ARGUMENT_SHARE = 0.5
REVERSED_ARGUMENT_SHARE = 0.3
ARGUMENT_DETERMINERS = ("", "", "", "the ", "its ", "my ", "our ", "this ", "your ", "that ",
                        "their ", "the new ")
ARGUMENT_LINKS = (" ", ": ", " is ", " at ", " to ", " should be ", " becomes ", " will be ",
                  " must be ", " set to ", " equal to ", " being ", " as ", " -> ", " - ",
                  " with value ", " valued ", " changed to ", " now ", " fixed at ", " ~ ",
                  " reading ", " in ", " for ", " with ", " via ", " per ", " around ",
                  " near ", " about ", " like ", " from ", " worth ", " under ", " over ",
                  " by ", " matching ", " showing ", " holding ", " carrying ", " using ",
                  " named ", " called ", " marked ", " labelled ", " given as ", " stated as ")
ARGUMENT_PREPOSITIONS = ("as", "for", "in", "into", "on", "under", "to use for", "to put in",
                         "going to")
ANSWER_TEMPLATES = (
    "Done: the {field} is {value}.",
    "{tool} finished; {field}: {value}.",
    "The tool reports {field} {value}.",
    "All set. The {field} is {value}.",
    "{tool} returned {field} {value}.",
    "It worked, with {field} {value}.",
    "Here is the result: {field} {value}.",
    "Finished. {tool} gave the {field} as {value}.",
    "The {field} came back as {value}.",
    "Success: {field} = {value}.",
    "I ran {tool}; the {field} is {value}.",
    "Completed, and the {field} is {value}.",
)
DECLINE_TEMPLATES = (
    "None of the available tools can {action}, so I can't do that here.",
    "I don't have a tool to {action}.",
    "Sorry, I can't {action}: no offered tool does that.",
    "The tools I have can't {action}.",
    "I'm unable to {action} with the tools available.",
    "No tool here lets me {action}, so I can't help with that.",
    "I can't {action}; none of my tools does it.",
    "That needs a tool to {action}, and I don't have one.",
    "There is no tool available to {action}.",
    "I would need a tool to {action}, which I don't have here.",
    "Unfortunately none of the tools can {action}.",
)
# Training requests that ask for a value about a thing instead of naming an action ("What is
# the status of order A-7731?"): the tool is named for what it returns (`get_order_status`),
# the argument's name is only in the schema (`order_id`) and its value is copied from the
# question. Users' own tools are mostly like this, and a model that only saw imperatives
# naming the tool's action reads such a question as one for the tools it knows.
LOOKUP_SHARE = 0.3
LOOKUP_VERBS = ("get", "lookup", "fetch", "check", "find", "read", "query", "show")
PROPERTIES = ("status", "price", "owner", "location", "balance", "rating", "size", "weight",
              "temperature", "schedule", "address", "score", "state", "colour", "capacity",
              "version", "weather", "forecast", "history", "details", "cost", "duration")
KEY_NAMES = ("id", "{noun}_id", "{noun}", "code", "number", "{noun}_number", "name", "key",
             "reference", "{noun}_code", "{noun}_name", "identifier")
LOOKUP_QUESTIONS = (
    "What is the {property} of {noun} {value}?", "What's the {property} of {noun} {value}?",
    "What is the {property} for {noun} {value}?", "Tell me the {property} of {noun} {value}.",
    "Can you check the {property} of {noun} {value}?", "I need the {property} of {noun} {value}.",
    "{Noun} {value}: what is its {property}?", "How about the {property} of {noun} {value}?",
    "Look up the {property} of {noun} {value} for me.",
    "Do you know the {property} of {noun} {value}?",
    "Find out the {property} of {noun} {value}, please.",
    "What {property} does {noun} {value} have?", "{Noun} {value} - what's the {property}?",
    "Give me the {property} of the {noun} {value}.")
DESCRIPTION_TEMPLATES = ("{Verb} the {noun}.", "{Verb} a {noun} by the given settings.",
                         "{Verb} one {noun}.", "Use this to {verb} the {noun}.",
                         "{Verb} the {noun} and report the {field}.")


@dataclass(frozen=True)
class Argument:
    name: str
    type: str  # one of ARGUMENT_TYPES
    description: str
    required: bool
    options: tuple[str, ...] = ()  # the allowed values of an enum

    def schema(self) -> dict[str, Any]:
        if self.type == "enum":
            return {"type": "string", "enum": list(self.options), "description": self.description}
        return {"type": self.type, "description": self.description}


@dataclass(frozen=True)
class Tool:
    name: str
    verb: str
    qualifier: str | None
    noun: str
    description: str
    arguments: tuple[Argument, ...]
    result_field: str
    determiner: str = "the"  # "" for none

    @property
    def action(self) -> str:
        """What a user asks for: "scan the shared locker", "book a table"."""
        words = (self.verb, self.determiner, self.qualifier, self.noun)
        return " ".join(word for word in words if word)

    def schema(self) -> dict[str, Any]:
        properties = {argument.name: argument.schema() for argument in self.arguments}
        required = [argument.name for argument in self.arguments if argument.required]
        return function_schema(self.name, self.description, properties, required)


@dataclass(frozen=True)
class UnseenToolCase:
    """One request, the tools offered with it, and the right response.

    `tool` is the offered tool that fits (None for `no_tool`, where `requested` is the tool
    the user would need); `arguments` are the call's, `result` what the tool returns.
    """

    kind: str
    request: str
    offered: tuple[Tool, ...]
    requested: Tool
    arguments: dict[str, Any]
    result: dict[str, Any] | None
    answer: str
    lookup: bool = False  # a question for a property (`lookup_tool`), not an action
    # Set for cases written as users write (`natural_tools`): the reasoning's first sentence
    # and the action a decline names, where they are not the tool's own words.
    restated: str | None = None
    declined: str | None = None

    @property
    def tool(self) -> Tool | None:
        return None if self.kind == "no_tool" else self.requested

    @property
    def answer_value(self) -> str | None:
        """The part of the result a correct final answer must repeat (None without a call)."""
        return None if self.result is None else spoken(self.result[self.requested.result_field])


def spoken(value: Any) -> str:
    """A value as the user writes it and as it appears in the call's JSON."""
    return json.dumps(value) if isinstance(value, bool) else str(value)


def capitalized(text: str) -> str:
    return text[:1].upper() + text[1:]


def made_up_word(rng: random.Random) -> str:
    """A pronounceable word that is (almost surely) in no vocabulary: "trealon", "ouckbis"."""
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
                   for _ in range(rng.randint(1, 3)))


@functools.cache
def word_pieces() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The pieces of two or more lowercase letters of the tokenizer every training run uses
    (`MuseTokenizer.base()`): those that start a word (a leading space, "Ġ" in byte-level
    BPE, removed) and those inside one. Pieces that repeat a letter three times ("zzzzzzzz",
    padding in source files) are left out."""
    vocabulary = MuseTokenizer.base().tokenizer.get_vocab(with_added_tokens=False)
    starts, insides = [], []
    for piece in sorted(vocabulary):
        letters = piece.removeprefix("\u0120")
        if re.fullmatch(r"[a-z]{2,}", letters) and not re.search(r"(.)\1\1", letters):
            (starts if letters != piece else insides).append(letters)
    return tuple(starts), tuple(insides)


def piece_word(rng: random.Random) -> str:
    """One or two of the tokenizer's letter pieces run together ("tr" + "ailer"),
    the first a word-starting piece or an inner one alike, so that training names write
    every piece, whichever way a name's letters are cut."""
    starts, insides = word_pieces()
    first = rng.choice(starts if rng.random() < 0.5 else insides)
    return first + "".join(rng.choice(insides) for _ in range(rng.randint(0, 1)))


@functools.cache
def _common_word_list() -> tuple[str, ...]:
    return tuple(COMMON_WORDS_FILE.read_text().split())


@functools.cache
def common_words() -> frozenset[str]:
    """The everyday words of `COMMON_WORDS_FILE` (none of them a held-out name word)."""
    return frozenset(_common_word_list())


@functools.cache
def _held_out_words() -> frozenset[str]:
    return frozenset(word for words in (VERBS, NOUNS, QUALIFIERS, ARGUMENT_WORDS)
                     for word in split_items(words, HELD_OUT))


def _word(rng: random.Random, words: tuple[str, ...], split: str) -> str:
    """A word of `split`'s list, or in training often a made-up, a pieced or a common one
    (never a word the held-out cases use)."""
    if split == TRAIN:
        draw = rng.random()
        while draw < MADE_UP_SHARE + PIECE_WORD_SHARE + COMMON_WORD_SHARE:
            if draw < MADE_UP_SHARE:
                word = made_up_word(rng)
            elif draw < MADE_UP_SHARE + PIECE_WORD_SHARE:
                word = piece_word(rng)
            else:
                word = rng.choice(_common_word_list())
            if word not in _held_out_words():
                return word
            draw = rng.random()
    return rng.choice(split_items(words, split))


def _argument(rng: random.Random, split: str, taken: set[str], noun: str,
              required: bool) -> Argument:
    while True:
        word = _word(rng, ARGUMENT_WORDS, split)
        name = f"{rng.choice(ARGUMENT_PREFIXES)}_{word}" if rng.random() < 0.4 else word
        if name not in taken:
            break
    taken.add(name)
    kind = rng.choice(ARGUMENT_TYPES)
    spaced = name.replace("_", " ")
    description = rng.choice([f"The {spaced} of the {noun}.", f"Which {spaced} to use.",
                              f"{capitalized(spaced)} for this {noun}."])
    options = rng.choice(ENUM_SETS) if kind == "enum" else ()
    return Argument(name, kind, description, required, options)


def random_tool(rng: random.Random, split: str, verb: str | None = None,
                noun: str | None = None, qualifier: str | None = None) -> Tool:
    """A tool whose name and argument names come from `split`'s vocabularies (`verb`, `noun`
    and `qualifier` fix those words of the name)."""
    if verb is None and noun is None and split == TRAIN and rng.random() < FAMILIAR_NAME_SHARE:
        verb, noun = rng.choice(FAMILIAR_NAMES)
    verb = verb or _word(rng, VERBS, split)
    noun = noun or _word(rng, NOUNS, split)
    if qualifier is None:
        qualifier = _word(rng, QUALIFIERS, split) if rng.random() < 0.4 else None
    name = "_".join(word for word in (verb, qualifier, noun) if word).replace(" ", "_")
    field = rng.choice(RESULT_FIELDS)
    # The first argument is always required so that every call has one.
    taken: set[str] = set()
    arguments = tuple(_argument(rng, split, taken, noun, index == 0 or rng.random() < 0.6)
                      for index in range(rng.randint(1, 3)))
    description = rng.choice(DESCRIPTION_TEMPLATES).format(
        Verb=capitalized(verb), verb=verb, noun=noun, field=field)
    determiner = "the"
    if split == TRAIN and rng.random() < OTHER_DETERMINER_SHARE:  # held-out draws unchanged
        determiner = rng.choice(ACTION_DETERMINERS)
        if determiner == "a" and (qualifier or noun)[:1] in "aeiou":
            determiner = "an"
    return Tool(name, verb, qualifier, noun, description, arguments, field, determiner)


def identifier_string(rng: random.Random) -> str:
    """A string value that looks like a number or a code, as users' ids, phone numbers and
    times do ("5521", "555-0100", "06:30", "jdoe42", "1Z999AA1"): written bare in the request
    and quoted in the call, because the schema says string."""
    style = rng.randrange(5)
    if style == 0:
        return str(rng.randint(10, 99999)).zfill(rng.choice((2, 4, 5)))
    if style == 1:
        return f"{rng.randint(100, 999)}-{rng.randint(1000, 9999)}"
    if style == 2:
        return f"{rng.randint(0, 23):02d}:{rng.choice((0, 15, 30, 45)):02d}"
    if style == 3:
        return f"{made_up_word(rng)}{rng.randint(1, 999)}"
    letters = "ABCDEFGHJKLMNPQRSTUVWXYZ0123456789"
    return "".join(rng.choice(letters) for _ in range(rng.randint(5, 9)))


def _value(rng: random.Random, argument: Argument, split: str) -> Any:
    """A value of the argument's type. Training strings are sometimes ids that look like
    numbers (`IDENTIFIER_SHARE`); held-out draws are as they always were."""
    if argument.type == "string" and split == TRAIN and rng.random() < IDENTIFIER_SHARE:
        return identifier_string(rng)
    if argument.type == "integer":
        return rng.choice([rng.randint(0, 20), rng.randint(21, 9999)])
    if argument.type == "number":
        return round(rng.randint(0, 999) + rng.randint(1, 99) / 100, 2)
    if argument.type == "boolean":
        return rng.random() < 0.5
    if argument.type == "enum":
        return rng.choice(argument.options)
    style = rng.randrange(4)
    if style == 0:
        letters = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(rng.randint(2, 3)))
        return f"{letters}-{rng.randint(10, 9999)}"
    if style == 1:
        return rng.choice(STRING_WORDS)
    if style == 2:
        return f"{rng.choice(STRING_WORDS)}-{rng.choice(STRING_WORDS)}"
    return rng.choice(PEOPLE)


def lookup_tool(rng: random.Random) -> tuple[Tool, dict[str, Any], str]:
    """A training tool named for the property it returns, its call and the question asking
    for that property (`LOOKUP_SHARE`): ("get_order_status", {"order_id": "A-7731"}, "What is
    the status of order A-7731?")."""
    while True:  # no word a held-out case uses, in the name or the argument's name
        noun, prop = _word(rng, NOUNS, TRAIN), _word(rng, PROPERTIES, TRAIN)
        name = f"{rng.choice(LOOKUP_VERBS)}_{noun}_{prop}"
        key_name = rng.choice(KEY_NAMES).format(noun=noun)
        if not set(f"{name}_{key_name}".split("_")) & _held_out_words():
            break
    key = Argument(key_name, "string", rng.choice([f"The {noun} to look up.", f"Which {noun}.",
                                                   f"Identifies the {noun}."]), True)
    tool = Tool(name, "get", None, f"{noun} {prop}",
                rng.choice([f"The {prop} of a {noun}.", f"Look up a {noun}'s {prop}.",
                            f"Returns the {prop} of the given {noun}."]), (key,), prop)
    value = _value(rng, key, TRAIN)
    question = rng.choice(LOOKUP_QUESTIONS).format(property=prop, noun=noun,
                                                   Noun=capitalized(noun), value=value)
    return tool, {key.name: value}, question


def _call_arguments(rng: random.Random, tool: Tool, split: str) -> dict[str, Any]:
    """Every required argument and about half of the optional ones."""
    return {argument.name: _value(rng, argument, split) for argument in tool.arguments
            if argument.required or rng.random() < 0.5}


def _request(rng: random.Random, split: str, tool: Tool, arguments: dict[str, Any]) -> str:
    # Only training draws the extra numbers (composed arguments and requests), so held-out
    # cases stay as they always were.
    phrases = []
    for name, value in arguments.items():
        written = name if rng.random() < 0.5 else name.replace("_", " ")
        if split == TRAIN and rng.random() < COMPOSED_ARGUMENT_SHARE:
            phrases.append(composed_argument(rng, written, spoken(value)))
        else:
            phrases.append(rng.choice(split_items(ARGUMENT_TEMPLATES, split)).format(
                name=written, value=spoken(value)))
    joined = phrases[0] if len(phrases) == 1 else ", ".join(phrases[:-1]) + " and " + phrases[-1]
    if split == TRAIN and rng.random() < COMPOSED_REQUEST_SHARE:
        real_verb = tool.verb in VERBS or tool.verb in common_words()
        return composed_request(rng, tool.action, joined, may_lead=real_verb)
    template = rng.choice(split_items(REQUEST_TEMPLATES, split))
    return template.format(action=tool.action, arguments=joined)


def composed_argument(rng: random.Random, name: str, value: str) -> str:
    """A training argument phrase built from parts: "its max level should be 7", "7 for our
    max_level". A model that saw only ten argument templates read the held-out "a {name} of
    {value}" as the argument `a` or the value "a level" (run 10's held-out misses); parts
    teach that any word before a name and any link after it belong to neither."""
    determiner = rng.choice(ARGUMENT_DETERMINERS)
    if rng.random() < REVERSED_ARGUMENT_SHARE:
        return f"{value} {rng.choice(ARGUMENT_PREPOSITIONS)} {determiner}{name}"
    return f"{determiner}{name}{rng.choice(ARGUMENT_LINKS)}{value}"


def composed_request(rng: random.Random, action: str, arguments: str,
                     may_lead: bool = False) -> str:
    """A training request built from parts: "Okay, could you please {action} for me? Use
    {arguments}." The action is kept verbatim so it can be copied, except that with
    `may_lead` a bare imperative may start the request with it, capitalized ("Book a table
    ..."): a capital makes another token of a word's start, and only real words (those a
    user writes) are worth learning both tokens of."""
    person = rng.choice(PEOPLE)
    draw = rng.random()
    question = IMPERATIVE_SHARE <= draw < IMPERATIVE_SHARE + QUESTION_SHARE
    if draw < IMPERATIVE_SHARE and may_lead and rng.random() < LEADING_ACTION_SHARE:
        opener, lead_in = "", ""
    elif draw < IMPERATIVE_SHARE:
        # Otherwise a bare imperative takes an opener that runs into it.
        opener, lead_in = rng.choice(RUN_ON_OPENERS), ""
    else:
        lead_in = (unknown_lead_in(rng) if not question and rng.random() < UNKNOWN_LEAD_IN_SHARE
                   else rng.choice(QUESTION_LEAD_INS if question else LEAD_INS))
        opener = rng.choice(OPENERS + RUN_ON_OPENERS) if rng.random() < OPENER_SHARE else ""
    sentence = f"{lead_in} {action}" if lead_in else action
    if not opener or opener[-1] in ".!?":
        sentence = capitalized(sentence)
    start = f"{opener.format(person=person)} {sentence}" if opener else sentence
    end = rng.choice(QUESTION_ENDINGS if question else ENDINGS)
    tail = rng.choice(ARGUMENT_INTRODUCERS).format(arguments=arguments, end=end)
    closer = rng.choice(CLOSERS).format(person=person) if rng.random() < CLOSER_SHARE else ""
    return f"{start}{tail}{closer}"


def unknown_lead_in(rng: random.Random) -> str:
    """A lead-in of words no request template or lead-in holds, made up, pieced or everyday
    ("trealon stick and", "ouck, paper to"), never one holding a held-out template's text
    before its action."""
    while True:
        words = [rng.choice((made_up_word, piece_word))(rng) if rng.random() < 0.7
                 else rng.choice(_common_word_list()) for _ in range(3)]
        lead_in = rng.choice(UNKNOWN_LEAD_IN_SHAPES).format(*words)
        if not any(before in f" {lead_in.lower()} " for before in _held_out_lead_ins()):
            return lead_in


@functools.cache
def _held_out_lead_ins() -> tuple[str, ...]:
    """The held-out request templates' words before the action, each between spaces."""
    return tuple(f" {template.split('{action}')[0].strip().lower()} "
                 for template in split_items(REQUEST_TEMPLATES, HELD_OUT))


def result_value(rng: random.Random) -> Any:
    return rng.choice([f"R-{rng.randint(1000, 99999)}", rng.randint(1, 5000),
                       rng.choice(("ok", "done", "queued", "accepted"))])


def _distinct(tool: Tool, others: list[Tool], split: str, lookup: bool) -> bool:
    """No two offered tools do the same action or share a name. For a lookup, the verbs of
    LOOKUP_VERBS all do the same action ("check_order_status" is "get_order_status"); in
    training, two tools of one verb and noun do different actions when both have a qualifier
    and they differ ("scan_shared_locker", "scan_local_locker")."""
    def verb_and_noun(some: Tool) -> tuple[str, str]:
        return ("get" if lookup and some.verb in LOOKUP_VERBS else some.verb, some.noun)

    def same_action(one: Tool, other: Tool) -> bool:
        if one.name == other.name:
            return True
        if verb_and_noun(one) != verb_and_noun(other):
            return False
        return not (split == TRAIN and one.qualifier and other.qualifier
                    and one.qualifier != other.qualifier)
    return not any(same_action(tool, other) for other in others)


def _distractor(rng: random.Random, split: str, target: Tool) -> Tool:
    """A random tool, half the time sharing the target's verb or noun (a near miss; in
    training more often its verb, VERB_MISS_SHARE); in training, for a target with a
    qualifier, sometimes one that differs from it only there (QUALIFIER_MISS_SHARE), so
    that the choice reads every word of a name, and often one that takes some of the
    target's argument names (ARGUMENT_MISS_SHARE), so that it is the action, not the
    arguments the user names, that picks the tool."""
    if split == TRAIN and target.qualifier and rng.random() < QUALIFIER_MISS_SHARE:
        tool = random_tool(rng, split, verb=target.verb, noun=target.noun,
                           qualifier=_word(rng, QUALIFIERS, split))
    elif split == TRAIN and rng.random() < VERB_MISS_SHARE:
        tool = random_tool(rng, split, verb=target.verb)
    elif rng.random() < 0.5:
        tool = random_tool(rng, split)
    elif rng.random() < 0.5:
        tool = random_tool(rng, split, verb=target.verb)
    else:
        tool = random_tool(rng, split, noun=target.noun)
    if split == TRAIN and rng.random() < ARGUMENT_MISS_SHARE:
        return with_arguments_of(rng, tool, target)
    return tool


def with_arguments_of(rng: random.Random, tool: Tool, target: Tool) -> Tool:
    """`tool` with one or more of its arguments renamed to names of `target`'s arguments or
    their relatives (`relative_name`), each keeping its own type, description and whether it
    is required."""
    names = [argument.name for argument in target.arguments]
    shared = [relative_name(rng, name, set(names)) if rng.random() < RELATIVE_NAME_SHARE
              else name for name in rng.sample(names, rng.randint(1, len(names)))]
    taken = {argument.name for argument in tool.arguments}
    missing = list(dict.fromkeys(name for name in shared if name not in taken))
    arguments = []
    for argument in tool.arguments:
        if missing and argument.name not in shared:
            argument = replace(argument, name=missing.pop(0))
        arguments.append(argument)
    return replace(tool, arguments=tuple(arguments))


def _prefix_and_word(name: str) -> tuple[str, str]:
    """An argument name's prefix of ARGUMENT_PREFIXES ("" when none) and its word."""
    prefix, _, word = name.partition("_")
    return (prefix, word) if word and prefix in ARGUMENT_PREFIXES else ("", name)


def argument_word(name: str) -> str:
    """An argument name without its prefix of ARGUMENT_PREFIXES (`budget` for `max_budget`)."""
    return _prefix_and_word(name)[1]


def relative_name(rng: random.Random, name: str, avoid: set[str]) -> str:
    """`name`'s word with another of ARGUMENT_PREFIXES or none (`max_budget` for `budget` or
    `min_budget`, `budget` for `max_budget`), never one of `avoid`."""
    prefix, word = _prefix_and_word(name)
    candidates = [f"{other}_{word}" for other in ARGUMENT_PREFIXES if other != prefix]
    if prefix:
        candidates.append(word)
    return rng.choice([candidate for candidate in candidates if candidate not in avoid])


def distractor_count(rng: random.Random, split: str, kind: str) -> int:
    """How many tools that do not fit a case of `kind` offers. In training a decline offers
    as many tools as a choice may (up to four), so that the number of offered tools tells
    nothing of whether one fits (held-out declines keep one to three). Both counts are drawn
    whatever the kind, so that the draws after them, and so the held-out cases, stay as they
    were."""
    most_declined = MOST_OFFERED if split == TRAIN else MOST_OFFERED - 1
    counts = {"choose": rng.randint(1, MOST_OFFERED - 1), "no_tool": rng.randint(1, most_declined)}
    return counts.get(kind, 0)


def sample_case(rng: random.Random, split: str, kind: str | None = None) -> UnseenToolCase:
    """A case of `kind` (one of KINDS; random by KIND_WEIGHTS when None) from `split`."""
    if kind is None:
        kind = rng.choices(KINDS, weights=KIND_WEIGHTS)[0]
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    lookup = split == TRAIN and rng.random() < LOOKUP_SHARE
    if lookup:
        requested, arguments, request = lookup_tool(rng)
    else:
        requested = random_tool(rng, split)
        arguments = _call_arguments(rng, requested, split)
        request = _request(rng, split, requested, arguments)
    others: list[Tool] = []
    count = distractor_count(rng, split, kind)
    while len(others) < count:
        other = _distractor(rng, split, requested)
        if _distinct(other, [requested, *others], split, lookup):
            others.append(other)
    return completed_case(rng, split, kind, request, requested, others, arguments,
                          lookup=lookup)


def completed_case(rng: random.Random, split: str, kind: str, request: str, requested: Tool,
                   others: list[Tool], arguments: dict[str, Any], lookup: bool = False,
                   restated: str | None = None, declined: str | None = None
                   ) -> UnseenToolCase:
    """The case once its request and tools are drawn: for `no_tool` the decline (of
    `declined`, else the requested tool's action) with `others` offered; otherwise the
    requested tool among `others` in a random order, its result and the answer using it."""
    if kind == "no_tool":
        answer = rng.choice(split_items(DECLINE_TEMPLATES, split)).format(
            action=declined or requested.action)
        return UnseenToolCase(kind, request, tuple(others), requested, arguments, None, answer,
                              lookup, restated, declined)
    offered = [requested, *others]
    rng.shuffle(offered)
    value = result_value(rng)
    answer = rng.choice(split_items(ANSWER_TEMPLATES, split)).format(
        tool=requested.name, field=requested.result_field, value=spoken(value))
    return UnseenToolCase(kind, request, tuple(offered), requested, arguments,
                          {requested.result_field: value}, answer, lookup, restated, declined)


def offered_schemas(case: UnseenToolCase) -> list[dict[str, Any]]:
    """The tool list to pass as `tools=` when rendering the case."""
    return [tool.schema() for tool in case.offered]


def reasoning(case: UnseenToolCase) -> str:
    """The assistant's reasoning before it calls a tool or declines.

    It first repeats what is asked, words copied from the request, then lists the offered
    tools' names: the decision that follows compares names written right there, instead of
    recalling a tool that fits the request but is not offered.
    """
    names = offered_names([tool.name for tool in case.offered])
    # Lookups are 30% of the cases: restated "to get the order status", they taught the
    # model to restate any request with "get" ("Start a timer" -> "get the timer", run 11).
    asked = case.restated or (asks_for(f"the {case.requested.noun}") if case.lookup
                              else asks(case.declined or case.requested.action))
    return f"{asked} {names} {verdict(case)}"


def verdict(case: UnseenToolCase) -> str:
    """The reasoning's last sentence: the tool it calls, or that none of the offered can."""
    if case.tool is not None:
        return will_call(case.tool.name)
    return none_can(len(case.offered), case.declined or case.requested.action)


def exchange(case: UnseenToolCase) -> list[dict[str, Any]]:
    """The user's request and the assistant's reply: a call, its result and the answer that
    uses it, or (for `no_tool`) a direct answer."""
    user = {"role": "user", "content": case.request}
    if case.tool is None:
        return [user, {"role": "assistant", "reasoning_content": reasoning(case),
                       "content": case.answer}]
    name = case.tool.name
    return [
        user,
        {"role": "assistant", "reasoning_content": reasoning(case),
         "content": "",
         "tool_calls": [{"type": "function", "function": {
             "name": name, "arguments": case.arguments}}]},
        {"role": "tool", "content": json.dumps(case.result)},
        {"role": "assistant", "reasoning_content": f"The {quoted(name)} tool answered.",
         "content": case.answer},
    ]

"""Tool-use conversations: a request, the assistant's tool call, the tool's JSON result, and an
answer that uses it.

Each tool is an OpenAI function schema plus a maker that turns a random generator into one
`ToolCase`: what the user asks, the exact call that answers it, what the tool returns and the
final reply. The arguments always come straight from the request (names, numbers, codes
copied as written), so a call is either right or wrong, which is what evaluation checks.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from muse.train.data.split import draw_from_split

CITIES = ["Paris", "Tokyo", "London", "New York", "Berlin", "Madrid", "Sydney", "Toronto",
          "Cairo", "Mumbai", "Rome", "Oslo", "Lima", "Seoul", "Dublin", "Vienna", "Lisbon",
          "Nairobi", "Chicago", "Bangkok", "Warsaw", "Prague", "Athens", "Denver", "Boston",
          "Helsinki", "Santiago", "Istanbul", "Zurich", "Manila"]
TIMEZONES = {"Paris": "Europe/Paris", "Tokyo": "Asia/Tokyo", "London": "Europe/London",
             "New York": "America/New_York", "Berlin": "Europe/Berlin",
             "Sydney": "Australia/Sydney", "Toronto": "America/Toronto", "Cairo": "Africa/Cairo",
             "Mumbai": "Asia/Kolkata", "Seoul": "Asia/Seoul", "Chicago": "America/Chicago",
             "Lima": "America/Lima", "Bangkok": "Asia/Bangkok", "Denver": "America/Denver",
             "Istanbul": "Europe/Istanbul"}
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear"]
CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "CNY", "INR"]
SYMBOLS = ["AAPL", "MSFT", "GOOG", "NVDA", "AMZN", "TSLA", "META", "IBM", "ORCL", "INTC"]
# One star each, so a matching file name is the pattern with a stem in place of the star.
PATTERNS = ["*.py", "*.md", "*.txt", "*.json", "*.csv", "test_*.py", "*.log", "report_*.pdf",
            "*.yaml", "config_*", "*.rs", "*.ts", "data_*.csv", "notes_*", "*.png"]
DIRECTORIES = ["src", "docs", "tests", "data", "scripts", "notes", "/home/ana/projects",
               "/var/log", "assets", "build"]
FILE_STEMS = ["main", "utils", "notes", "summary", "draft", "v2", "final", "old", "model", "app"]
NAMES = ["ana", "ben", "chloe", "dev", "emma", "farid", "grace", "hugo", "ines", "jun", "kofi",
         "lena", "mateo", "nora", "omar", "priya", "quinn", "rosa", "sam", "tara"]
DOMAINS = ["example.com", "mail.org", "work.net", "lab.io", "school.edu"]
SUBJECTS = ["Meeting moved", "Lunch on Friday", "Project update", "Invoice 42", "Welcome aboard",
            "Weekly report", "Quick question", "Travel plans", "Happy birthday", "Draft ready"]


def function_schema(name: str, description: str, properties: dict[str, Any],
                    required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required}}}


TOOL_SCHEMAS: dict[str, dict[str, Any]] = {
    "get_weather": function_schema(
        "get_weather", "Get the current weather in a city.",
        {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        ["city"]),
    "add_numbers": function_schema(
        "add_numbers", "Add two numbers.",
        {"a": {"type": "number"}, "b": {"type": "number"}}, ["a", "b"]),
    "search_files": function_schema(
        "search_files", "Find files whose names match a glob pattern.",
        {"pattern": {"type": "string"}, "directory": {"type": "string"}}, ["pattern"]),
    "convert_currency": function_schema(
        "convert_currency", "Convert an amount of money between currencies.",
        {"amount": {"type": "number"}, "from_currency": {"type": "string", "enum": CURRENCIES},
         "to_currency": {"type": "string", "enum": CURRENCIES}},
        ["amount", "from_currency", "to_currency"]),
    "get_time": function_schema(
        "get_time", "Get the current local time in an IANA timezone.",
        {"timezone": {"type": "string"}}, ["timezone"]),
    "get_stock_price": function_schema(
        "get_stock_price", "Get the latest price of a stock by its ticker symbol.",
        {"symbol": {"type": "string"}}, ["symbol"]),
    "send_email": function_schema(
        "send_email", "Send an email.",
        {"to": {"type": "string"}, "subject": {"type": "string"}}, ["to", "subject"]),
}


@dataclass(frozen=True)
class ToolCase:
    """One request and its one right call; `result` is what the tool returns."""

    name: str
    request: str
    arguments: dict[str, Any]
    result: dict[str, Any]
    answer: str

    @property
    def key(self) -> str:
        """The request as asked: the same request is never both trained on and evaluated."""
        return f"{self.name}:{self.request}"

    @property
    def answer_value(self) -> str:
        """The part of the result a correct final answer must repeat."""
        return ANSWER_VALUES[self.name](self.result)


def _money(rng: random.Random, low: int, high: int) -> int | float:
    """An amount, whole two times in three, else with cents (never trailing zeros in JSON)."""
    whole = rng.randint(low, high)
    if rng.random() < 2 / 3:
        return whole
    return round(whole + rng.randint(1, 99) / 100, 2)


def _weather(rng: random.Random) -> ToolCase:
    city = rng.choice(CITIES)
    unit = rng.choice([None, "celsius", "fahrenheit"])
    if unit is None:
        request = rng.choice(["What's the weather in {city}?", "How is the weather in {city}?",
                              "Tell me the weather in {city}.", "Is it raining in {city}?"])
    else:
        request = rng.choice(["What's the weather in {city} in {unit}?",
                              "Give me the temperature in {city} in {unit}.",
                              "How warm is it in {city}? Use {unit}.",
                              "Weather for {city}, in {unit} please."])
    arguments: dict[str, Any] = {"city": city} if unit is None else {"city": city, "unit": unit}
    shown = unit or "celsius"
    degrees = rng.randint(-10, 35) if shown == "celsius" else rng.randint(14, 95)
    condition = rng.choice(CONDITIONS)
    result = {"city": city, "temperature": degrees, "unit": shown, "condition": condition}
    answer = f"It is {degrees} degrees {shown} and {condition} in {city}."
    return ToolCase("get_weather", request.format(city=city, unit=unit), arguments, result,
                    answer)


def _add(rng: random.Random) -> ToolCase:
    a, b = _money(rng, 0, 99999), _money(rng, 0, 99999)
    request = rng.choice(["Use the calculator to add {a} and {b}.", "What is {a} plus {b}?",
                          "Add {a} and {b}.", "Please sum {a} and {b}.", "{a} + {b} = ?"])
    total = round(a + b, 2)
    total = int(total) if float(total).is_integer() else total
    return ToolCase("add_numbers", request.format(a=a, b=b), {"a": a, "b": b},
                    {"result": total}, f"{a} + {b} = {total}.")


def _search(rng: random.Random) -> ToolCase:
    pattern = rng.choice(PATTERNS)
    directory = rng.choice([None, *DIRECTORIES])
    if directory is None:
        request = rng.choice(["Find files matching {pattern}.", "Search for {pattern} files.",
                              "Which files match {pattern}?", "List the files named {pattern}."])
        arguments: dict[str, Any] = {"pattern": pattern}
    else:
        request = rng.choice(["Find files matching {pattern} in {directory}.",
                              "Search {directory} for {pattern}.",
                              "Which files in {directory} match {pattern}?"])
        arguments = {"pattern": pattern, "directory": directory}
    names = sorted({pattern.replace("*", rng.choice(FILE_STEMS)) for _ in range(rng.randint(0, 3))})
    result = {"files": names}
    if names:
        answer = f"I found {len(names)} file{'s' if len(names) > 1 else ''}: {', '.join(names)}."
    else:
        answer = f"No files match {pattern}."
    return ToolCase("search_files", request.format(pattern=pattern, directory=directory),
                    arguments, result, answer)


def _convert(rng: random.Random) -> ToolCase:
    source, target = rng.sample(CURRENCIES, 2)
    amount = _money(rng, 1, 5000)
    request = rng.choice(["Convert {amount} {source} to {target}.",
                          "How much is {amount} {source} in {target}?",
                          "What is {amount} {source} in {target}?",
                          "Change {amount} {source} into {target}."])
    rate = round(rng.uniform(0.01, 150.0), 4)
    converted = round(amount * rate, 2)
    result = {"amount": amount, "from": source, "to": target, "rate": rate,
              "converted": converted}
    return ToolCase("convert_currency", request.format(amount=amount, source=source,
                                                       target=target),
                    {"amount": amount, "from_currency": source, "to_currency": target},
                    result, f"{amount} {source} is {converted} {target}.")


def _time(rng: random.Random) -> ToolCase:
    city = rng.choice(sorted(TIMEZONES))
    timezone = TIMEZONES[city]
    if rng.random() < 0.5:
        request = rng.choice(["What time is it in {city}?", "What's the local time in {city}?",
                              "Tell me the current time in {city}."]).format(city=city)
    else:
        request = rng.choice(["What time is it in the {timezone} timezone?",
                              "Current time in {timezone}?"]).format(timezone=timezone)
    time = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
    return ToolCase("get_time", request, {"timezone": timezone},
                    {"timezone": timezone, "time": time}, f"It is {time} in {timezone}.")


def _stock(rng: random.Random) -> ToolCase:
    symbol = rng.choice(SYMBOLS)
    request = rng.choice(["What is the stock price of {symbol}?",
                          "How much is {symbol} trading at?",
                          "Get me the latest {symbol} price.", "Price of {symbol} stock?"])
    price = round(rng.uniform(5, 900), 2)
    return ToolCase("get_stock_price", request.format(symbol=symbol), {"symbol": symbol},
                    {"symbol": symbol, "price": price, "currency": "USD"},
                    f"{symbol} is trading at {price} USD.")


def _email(rng: random.Random) -> ToolCase:
    address = f"{rng.choice(NAMES)}@{rng.choice(DOMAINS)}"
    subject = rng.choice(SUBJECTS)
    request = rng.choice(['Send an email to {to} with the subject "{subject}".',
                          'Email {to}, subject "{subject}".',
                          'Please write to {to} with subject "{subject}".'])
    message_id = f"msg_{rng.randint(1000, 9999)}"
    return ToolCase("send_email", request.format(to=address, subject=subject),
                    {"to": address, "subject": subject}, {"status": "sent", "id": message_id},
                    f"Done: the email to {address} has been sent ({message_id}).")


MAKERS: dict[str, Callable[[random.Random], ToolCase]] = {
    "get_weather": _weather, "add_numbers": _add, "search_files": _search,
    "convert_currency": _convert, "get_time": _time, "get_stock_price": _stock,
    "send_email": _email,
}
ANSWER_VALUES: dict[str, Callable[[dict[str, Any]], str]] = {
    "get_weather": lambda result: str(result["temperature"]),
    "add_numbers": lambda result: str(result["result"]),
    "search_files": lambda result: ", ".join(result["files"]) or "No files",
    "convert_currency": lambda result: str(result["converted"]),
    "get_time": lambda result: result["time"],
    "get_stock_price": lambda result: str(result["price"]),
    "send_email": lambda result: result["id"],
}


def sample_case(rng: random.Random, split: str, name: str | None = None) -> ToolCase:
    """A request of `split` for tool `name` (a random tool when None)."""
    maker = MAKERS[name or rng.choice(sorted(MAKERS))]
    return draw_from_split(lambda: maker(rng), lambda case: case.key, split)


def offered_tools(rng: random.Random, needed: str | None, missing: str | None = None
                  ) -> list[dict[str, Any]]:
    """One to four tool schemas in random order, `needed` among them when given, never
    `missing` (a tool the request needs that is not offered)."""
    others = [name for name in sorted(TOOL_SCHEMAS) if name not in (needed, missing)]
    chosen = rng.sample(others, rng.randint(0 if needed else 1, 3))
    if needed:
        chosen.append(needed)
    rng.shuffle(chosen)
    return [TOOL_SCHEMAS[name] for name in chosen]


# What each tool does, as a reply that declines names it. In training (`MISSING_SHARE` of
# tool conversations) a request needs a tool that is not offered: the reasoning lists the
# offered tools as before a call and finds none that does it, so whether to call is decided
# by reading the list, not by recognising a familiar request. (Not the calculator: without
# it the model adds by itself, as the arithmetic conversations teach.)
ACTIONS: dict[str, str] = {
    "get_weather": "get the weather", "search_files": "search for files",
    "convert_currency": "convert currencies", "get_time": "tell the time",
    "get_stock_price": "look up a stock price", "send_email": "send an email",
}
MISSING_SHARE = 0.1
# What each tool's request asks for, as the reasoning restates it before listing the offered
# tools (the unseen tools' procedure): the choice then compares the request's action with the
# names written right before it. A probe of run 9's data without it (the list alone) chose
# first-version tools worse than version 1 did (docs/training.md).
REQUESTED_ACTIONS: dict[str, str] = {**ACTIONS, "add_numbers": "add numbers"}


def asks(action: str) -> str:
    """The reasoning's first sentence, the request restated (as for the unseen tools)."""
    return f"The user asks to {action}."


def asks_for(thing: str) -> str:
    """The reasoning's first sentence for a question about a thing ("the order status"):
    restated as what it asks for, not as an action, so "get" is not taught as every
    request's verb."""
    return f"The user asks for {thing}."


def declining_message(case: ToolCase, offered: Sequence[dict[str, Any]], answer: str
                      ) -> dict[str, Any]:
    """The assistant turn for a request whose tool (`case.name`) is not among `offered`."""
    names = [schema["function"]["name"] for schema in offered]
    action = ACTIONS[case.name]
    reasoning = f"{asks(action)} {offered_names(names)} {none_can(len(names), action)}"
    return {"role": "assistant", "reasoning_content": reasoning, "content": answer}


def will_call(name: str) -> str:
    """The reasoning's verdict when it calls the tool `name`."""
    return f"I should call {quoted(name)}."


def none_can(offered: int, action: str) -> str:
    """The reasoning's verdict when none of the `offered` tools does `action` (the same words
    for first-version and made-up tools)."""
    return f"It cannot {action}." if offered == 1 else f"None of them can {action}."


# Other names users give the arguments of the first version's tools. In training
# (`RENAMED_SHARE` of tool conversations) the needed tool's arguments take one of them in its
# schema and in the call, so the model copies argument names from the schema it is given
# rather than recalling `city` for every weather tool. (`location` and `ticker`, the names of
# `muse eval`'s users' tools, are left out: that section must stay unseen.)
ARGUMENT_SYNONYMS: dict[str, tuple[str, ...]] = {
    "city": ("place", "town", "city_name", "locality"),
    "unit": ("units", "scale", "temperature_unit"),
    "a": ("x", "first", "left"), "b": ("y", "second", "right"),
    "pattern": ("glob", "query", "name_pattern"), "directory": ("folder", "path", "dir"),
    "amount": ("value", "quantity", "sum"),
    "from_currency": ("source_currency", "base", "currency_from"),
    "to_currency": ("target_currency", "quote", "currency_to"),
    "timezone": ("tz", "zone", "time_zone"), "symbol": ("stock", "code", "stock_symbol"),
    "to": ("recipient", "address", "email"), "subject": ("title", "topic", "subject_line"),
}
RENAMED_SHARE = 0.3


def renamed_arguments(rng: random.Random, case: ToolCase, offered: list[dict[str, Any]]
                      ) -> tuple[ToolCase, list[dict[str, Any]]]:
    """`case` and `offered` with every argument of the needed tool renamed to a synonym, in its
    schema and in the call."""
    names = {name: rng.choice(ARGUMENT_SYNONYMS[name])
             for name in TOOL_SCHEMAS[case.name]["function"]["parameters"]["properties"]}
    schemas = []
    for schema in offered:
        if schema["function"]["name"] == case.name:
            parameters = schema["function"]["parameters"]
            schema = function_schema(
                case.name, schema["function"]["description"],
                {names[key]: value for key, value in parameters["properties"].items()},
                [names[key] for key in parameters["required"]])
        schemas.append(schema)
    arguments = {names[key]: value for key, value in case.arguments.items()}
    return replace(case, arguments=arguments), schemas


def quoted(name: str) -> str:
    """A tool name in the reasoning as the schema and the call write it, in double quotes: the
    tokenizer then splits it into the same tokens in all three places (after a space its
    first piece would be another token, ' re' for 're'), so the reasoning copies the schema
    token for token and the call copies the reasoning."""
    return f'"{name}"'


def offered_names(names: Sequence[str]) -> str:
    """The offered tools' names in order: 'The tools are "a", "b" and "c".' or 'The tool is
    "a".'."""
    written = [quoted(name) for name in names]
    if len(written) == 1:
        return f"The tool is {written[0]}."
    return f"The tools are {', '.join(written[:-1])} and {written[-1]}."


def call_message(case: ToolCase, offered: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The assistant turn that makes the call: its reasoning restates the request, lists the
    `offered` schemas' names, then names the one it calls (the procedure of the unseen tools,
    so that any tool list is read the same way)."""
    names = [schema["function"]["name"] for schema in offered]
    reasoning = (f"{asks(REQUESTED_ACTIONS[case.name])} {offered_names(names)} "
                 f"{will_call(case.name)}")
    return {"role": "assistant", "reasoning_content": reasoning,
            "content": "", "tool_calls": [{"type": "function", "function": {
                "name": case.name, "arguments": case.arguments}}]}


def exchange(case: ToolCase, offered: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Request, call, tool result and the answer that uses it."""
    return [
        {"role": "user", "content": case.request},
        call_message(case, offered),
        {"role": "tool", "content": json.dumps(case.result)},
        {"role": "assistant", "reasoning_content": f"The {quoted(case.name)} tool answered.",
         "content": case.answer},
    ]

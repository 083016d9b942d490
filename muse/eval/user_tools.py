"""Tools as users write them: a fixed, hand-written set of requests with tools of their own
(`get_order_status(order_id)`, `book_table(restaurant, party_size)`, the weather tool with
`location` where the first version trained `city`), asked as people ask ("What is the status
of order A-7731?"). No generator makes these, so they measure what the generated unseen-tool
cases cannot: whether the model reads a schema it has never seen when the request is not
phrased the way training phrased its own.

Scored as the `unseen_tools` section scores its cases (`valid`, `right_tool`,
`right_arguments`, `right`; per kind: `call`, `choose`, `no_tool`). The set is fixed: `--num`
does not change it.
"""

from __future__ import annotations

from typing import Any

from muse.eval.generation import SectionResult
from muse.eval.unseen_tools import evaluate_tool_cases
from muse.llm import LLM
from muse.train.data.unseen_tools import Argument, Tool, UnseenToolCase


def _tool(name: str, description: str, /, **arguments: str) -> Tool:
    """A tool whose every argument (name=type) is required; the name's first word is its
    verb, the rest what it acts on."""
    verb, _, rest = name.partition("_")
    return Tool(name, verb, None, rest.replace("_", " "), description,
                tuple(Argument(key, kind, f"The {key.replace('_', ' ')}.", True)
                      for key, kind in arguments.items()), "result")


TOOLS = {tool.name: tool for tool in (
    _tool("get_weather", "Current weather at a location.", location="string"),
    _tool("get_order_status", "Status of an order.", order_id="string"),
    _tool("cancel_order", "Cancel an order.", order_id="string"),
    _tool("lookup_flight", "Details of a flight.", flight_number="string"),
    _tool("book_table", "Book a restaurant table.", restaurant="string", party_size="integer"),
    _tool("get_stock_price", "Latest price of a stock.", ticker="string"),
    _tool("translate_text", "Translate text.", text="string", target_language="string"),
    _tool("send_sms", "Send a text message.", phone="string", message="string"),
    _tool("set_alarm", "Set an alarm.", time="string"),
    _tool("get_user_profile", "A user's profile.", username="string"),
    _tool("convert_units", "Convert a quantity between units.", value="number",
          from_unit="string", to_unit="string"),
    _tool("create_playlist", "Create a playlist.", name="string"),
    _tool("delete_playlist", "Delete a playlist.", name="string"),
    _tool("get_exchange_rate", "Exchange rate between two currencies.", base="string",
          quote="string"),
    _tool("start_timer", "Start a countdown timer.", minutes="integer"),
    _tool("search_products", "Search the shop's catalogue.", query="string"),
    _tool("get_product", "One product by its id.", product_id="string"),
    _tool("turn_on_light", "Turn the light on in a room.", room="string"),
    _tool("turn_off_light", "Turn the light off in a room.", room="string"),
    _tool("get_package_location", "Where a parcel is.", tracking_id="string"),
)}

# (request, offered tool names, the tool to call or None, its arguments)
CASES: tuple[tuple[str, tuple[str, ...], str | None, dict[str, Any]], ...] = (
    ("What's the weather in Lisbon?", ("get_weather",), "get_weather", {"location": "Lisbon"}),
    ("What is the status of order A-7731?", ("get_order_status",), "get_order_status",
     {"order_id": "A-7731"}),
    ("Look up flight BA117 for me.", ("lookup_flight",), "lookup_flight",
     {"flight_number": "BA117"}),
    ("Book a table at Nandos for 4 people.", ("book_table",), "book_table",
     {"restaurant": "Nandos", "party_size": 4}),
    ("What's the price of NVDA?", ("get_stock_price",), "get_stock_price", {"ticker": "NVDA"}),
    ("Translate hello into French.", ("translate_text",), "translate_text",
     {"text": "hello", "target_language": "French"}),
    ("Text 555-0100 saying running late.", ("send_sms",), "send_sms",
     {"phone": "555-0100", "message": "running late"}),
    ("Set an alarm for 06:30.", ("set_alarm",), "set_alarm", {"time": "06:30"}),
    ("Show me the profile of user jdoe42.", ("get_user_profile",), "get_user_profile",
     {"username": "jdoe42"}),
    ("Convert 12.5 miles to kilometers.", ("convert_units",), "convert_units",
     {"value": 12.5, "from_unit": "miles", "to_unit": "kilometers"}),
    ("Please cancel order 5521.", ("get_order_status", "cancel_order"), "cancel_order",
     {"order_id": "5521"}),
    ("Delete the playlist Road Trip.", ("create_playlist", "delete_playlist"),
     "delete_playlist", {"name": "Road Trip"}),
    ("What's the exchange rate from EUR to JPY?", ("get_weather", "get_exchange_rate"),
     "get_exchange_rate", {"base": "EUR", "quote": "JPY"}),
    ("Start a timer for 15 minutes.", ("set_alarm", "start_timer"), "start_timer",
     {"minutes": 15}),
    ("Search the shop for wireless earbuds.", ("get_product", "search_products"),
     "search_products", {"query": "wireless earbuds"}),
    ("Turn off the light in the kitchen.", ("turn_on_light", "turn_off_light"),
     "turn_off_light", {"room": "kitchen"}),
    ("Where is package 1Z999AA1?", ("get_order_status", "get_package_location"),
     "get_package_location", {"tracking_id": "1Z999AA1"}),
    ("Send an email to Bob about the meeting.", ("get_weather",), None, {}),
    ("Book a flight to Rome.", ("get_stock_price",), None, {}),
    ("Play some jazz music.", ("set_alarm", "start_timer"), None, {}),
    ("Reset my password, please.", ("get_order_status", "cancel_order"), None, {}),
    ("Order a pizza with mushrooms.", ("search_products", "translate_text"), None, {}),
)


# What a `no_tool` case asks for, as the unseen-tool cases name it (never offered; the
# reply's length budget is measured against declining it).
UNAVAILABLE = Tool("unavailable", "do", None, "task", "", (), "result")
DECLINE = "I can't do that with the tools I have."


def user_tool_cases() -> list[UnseenToolCase]:
    """`CASES` as the unseen-tool section's cases (kinds `call`, `choose`, `no_tool`)."""
    cases = []
    for request, offered, name, arguments in CASES:
        kind = "no_tool" if name is None else "call" if len(offered) == 1 else "choose"
        requested, result = (UNAVAILABLE, None) if name is None else (TOOLS[name],
                                                                        {"result": "ok"})
        cases.append(UnseenToolCase(kind, request, tuple(TOOLS[n] for n in offered), requested,
                                    arguments, result, DECLINE if name is None else ""))
    return cases


def evaluate_user_tools(llm: LLM, seed: int, max_tokens: int,
                        progress: bool | None = None, strict_tools: bool = False
                        ) -> SectionResult:
    return evaluate_tool_cases(llm, user_tool_cases(), f"eval-user-tools/{seed}", "users' tools",
                               max_tokens, progress, strict_tools)

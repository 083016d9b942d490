"""Tools as users write them, asked as people ask: `book_hotel(city, nights)` for "Book a
hotel in Oslo for 3 nights.", `get_account_balance(account)` for "What's the balance of my
savings account?".

The generated unseen tools (`unseen_tools`) name every tool for its words and give every
value behind its argument's name ("... with nights 3"). Users' tools are not like that: the
value sits where the sentence puts it ("for 3 nights"), the argument's name is in the schema
alone, and a question asks for a thing rather than naming an action. A model trained on the
generated cases alone restated users' requests in their frame ("Start a timer for 15
minutes" -> "get the timer", docs/training.md). These scenarios are hand-written: a tool
with a few names, arguments with a few names each (or, sometimes, a made-up one that only
its description explains), value pools, and requests in the sentence shapes users write.

Kinds and reasoning are those of the unseen tools (`call`, `choose`, `no_tool`; the request
restated, the offered names listed, then the call or the decline), so `unseen_tools.exchange`
renders the cases. Scenarios are split by `split.split_items`: held-out scenarios (their
tools, their sentences) are for evaluation only. None of them is a tool of `muse eval`'s
users' tools section (weather, orders, flights, tables, stocks, translation, texts, alarms,
profiles, units, playlists, exchange rates, timers, products, lights, parcels): that section
stays unseen.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from muse.train.data.split import TRAIN, split_items
from muse.train.data.tools import asks, asks_for
from muse.train.data.unseen_tools import (CLOSERS, KIND_WEIGHTS, KINDS, OPENERS,
                                          QUESTION_LEAD_INS, Argument, Tool, UnseenToolCase,
                                          capitalized, completed_case, distractor_count,
                                          made_up_word, spoken)

# Of a scenario's argument names: a made-up word the request never says, so the argument is
# known by its description and type alone (users' schemas name things their own way).
MADE_UP_ARGUMENT_SHARE = 0.15
# Of requests: a lead-in or a question lead-in before an imperative, an opener, a closer.
LEAD_IN_SHARE = 0.35
OPENER_SHARE = 0.25
CLOSER_SHARE = 0.2
NATURAL_LEAD_INS = ("Please", "Can you", "Could you", "I need you to", "I want you to",
                    "Would you", "Go ahead and", "Help me")

CITIES = ("Oslo", "Denver", "Kyoto", "Nairobi", "Porto", "Austin", "Hanoi", "Quebec", "Seville",
          "Perth", "Tallinn", "Cusco", "Bergen", "Osaka", "Accra", "Lyon", "Boston", "Cairo")
NAMES = ("Maria", "Tom", "Priya", "Omar", "Lena", "Kofi", "Sara", "Diego", "Yuki", "Noah",
         "Aisha", "Pavel", "Rosa", "Ken", "Zoe", "Ali")
TIMES = ("07:15", "9am", "3:30 pm", "noon", "18:45", "8 pm", "10:00", "6:45am", "14:20")
DATES = ("May 3", "next Friday", "2027-01-14", "tomorrow", "June 21", "Monday", "March 9",
         "2026-12-24", "the 15th")
TOPICS = ("electric cars", "city elections", "climate change", "space travel", "football",
          "interest rates", "solar power", "local schools", "jazz festivals")
TEAMS = ("Lakers", "Arsenal", "Yankees", "Celtics", "Real Madrid", "Packers", "Dodgers")
DISHES = ("lasagna", "pad thai", "banana bread", "tomato soup", "fish tacos", "ramen",
          "apple pie", "chili")
CUISINES = ("Thai", "Italian", "Mexican", "Ethiopian", "Korean", "Greek", "Indian")
ACCOUNTS = ("savings", "checking", "business", "travel", "joint")
FILES = ("report.pdf", "notes.txt", "budget.xlsx", "photo_01.jpg", "draft_v2.docx",
         "data.csv", "slides.pptx")
MOVIES = ("Dune", "Inception", "Up", "Alien", "Heat", "Arrival", "Coco", "Jaws")
EVENTS = ("Hamlet", "Swan Lake", "The Lion King", "Les Miserables", "Cats", "Tosca")
COUNTRIES = ("Peru", "Norway", "Kenya", "Vietnam", "Chile", "Poland", "Ghana", "Nepal")
WORDS = ("serendipity", "ephemeral", "laconic", "ubiquitous", "quixotic", "sonder")
ROADS = ("I-95", "Highway 1", "Route 66", "A4", "Main Street", "M25", "Ocean Drive")
PLACES = ("JFK Airport", "Penn Station", "Central Park", "Pier 39", "Union Square",
          "Hotel Astoria", "12 Baker Street")
DOORS = ("front", "back", "garage", "side", "patio")
ROOMS = ("Everest", "Blue", "board", "Orion", "training")
CHANNELS = ("general", "random", "design", "support", "releases", "ops")
EMAILS = ("ana@example.com", "j.smith@mail.net", "team@corp.io", "liu.wei@school.edu",
          "k.osei@web.org")
DOCUMENTS = ("Q3 Plan", "Budget 2027", "Design Brief", "Roadmap", "Team Handbook")
DRINKS = ("latte", "cappuccino", "flat white", "mocha", "green tea")
SIZES = ("small", "medium", "large")
SIGNS = ("Leo", "Aries", "Virgo", "Pisces", "Taurus", "Scorpio")
ACTIVITIES = ("run", "swim", "bike ride", "yoga session", "walk", "row")
NOTES = ("buy milk", "call the bank", "renew the lease", "water the plants", "book a dentist")
SHOWS = ("The Daily", "Radiolab", "Serial", "Planet Money", "Hardcore History")
SONG_TITLES = ("Yellow", "Hey Jude", "Bohemian Rhapsody", "Clocks", "Dancing Queen")


def _integer(low: int, high: int) -> Callable[[random.Random], int]:
    return lambda rng: rng.randint(low, high)


def _amount(rng: random.Random) -> float:
    return round(rng.randint(5, 900) + rng.choice((0, 0.5, 0.25, 0.99)), 2)


@dataclass(frozen=True)
class Slot:
    """An argument of a scenario: the names a schema may give it, its type, what it is (for
    the description) and how its values are drawn."""

    names: tuple[str, ...]
    type: str  # "string", "integer", "number" or "enum"
    about: str
    values: Any  # a tuple to choose from, or a function of the rng
    options: tuple[str, ...] = ()  # an enum's allowed values

    def draw(self, rng: random.Random) -> Any:
        return rng.choice(self.values) if isinstance(self.values, tuple) else self.values(rng)


@dataclass(frozen=True)
class Scenario:
    """A tool users have, with its requests. `actions` are imperatives ("Book a hotel in {0}
    for {1} nights."), restated as they are written; `questions` pair a request with what it
    asks for ("What's the balance of my {0} account?", "the balance of the {0} account").
    `{0}`, `{1}`, ... are the slots' values in order. Two scenarios of one `overlap` group
    (adding an event, scheduling a meeting) are never offered together: either could do
    the other's request."""

    names: tuple[str, ...]
    description: str
    slots: tuple[Slot, ...]
    actions: tuple[str, ...] = ()
    questions: tuple[tuple[str, str], ...] = ()
    overlap: str = ""  # scenarios of one overlap group can do each other's requests

    @property
    def group(self) -> str:
        return self.overlap or self.names[0]


def _slot(names: str, kind: str, about: str, values: Any, options: tuple[str, ...] = ()
          ) -> Slot:
    return Slot(tuple(names.split()), kind, about, values, options)


CITY = _slot("city destination city_name location_name place", "string", "the city", CITIES)
EVENT_TITLE = _slot("title name event_title summary", "string", "the event's title",
                    ("Dentist", "Team lunch", "Yoga", "Budget review", "Mom's birthday"))
SCENARIOS: tuple[Scenario, ...] = (
    Scenario(("book_hotel", "reserve_hotel", "hotel_booking"), "Book a hotel room.",
             (CITY, _slot("nights num_nights stay_nights length", "integer",
                          "how many nights", _integer(1, 14))),
             ("Book a hotel in {0} for {1} nights.", "Reserve a hotel room in {0} for {1} nights.",
              "Find me a hotel in {0} for {1} nights.")),
    Scenario(("create_event", "add_calendar_event", "schedule_event"), "Add a calendar event.",
             (EVENT_TITLE,
              _slot("date day event_date when", "string", "the date", DATES)),
             ("Add {0} to my calendar on {1}.", "Put {0} on my calendar for {1}.",
              "Create an event called {0} on {1}.", "Schedule {0} for {1}."), overlap="add-event"),
    Scenario(("delete_event", "remove_calendar_event", "cancel_event"),
             "Remove a calendar event.",
             (EVENT_TITLE,),
             ("Remove {0} from my calendar.", "Delete the event {0}.",
              "Cancel {0} on my calendar.")),
    Scenario(("set_reminder", "create_reminder", "remind_me"), "Set a reminder.",
             (_slot("text task message note", "string", "what to be reminded of", NOTES),
              _slot("time at remind_at when", "string", "when to remind", TIMES)),
             ("Remind me to {0} at {1}.", "Set a reminder to {0} at {1}.",
              "Create a reminder at {1} to {0}."), overlap="note"),
    Scenario(("call_contact", "make_call", "phone_contact", "dial"), "Call someone.",
             (_slot("name contact person callee", "string", "who to call", NAMES),),
             ("Call {0}.", "Phone {0} now.", "Ring {0} for me.", "Give {0} a call.")),
    Scenario(("play_podcast", "start_podcast", "podcast_play"), "Play a podcast.",
             (_slot("show podcast title podcast_name", "string", "the podcast", SHOWS),),
             ("Play the podcast {0}.", "Put on {0}.", "Start the latest episode of {0}."),
             overlap="play"),
    Scenario(("get_news", "fetch_headlines", "news_search", "latest_news"),
             "The latest news on a topic.",
             (_slot("topic query subject keywords", "string", "the topic", TOPICS),),
             ("Show me the latest news about {0}.", "Find news on {0}."),
             (("What's new with {0}?", "the news about {0}"),
              ("Any headlines about {0} today?", "the headlines about {0}")), overlap="news"),
    Scenario(("get_game_score", "sports_score", "latest_score"), "The score of a team's game.",
             (_slot("team team_name club side", "string", "the team", TEAMS),),
             (),
             (("What was the score of the {0} game?", "the score of the {0} game"),
              ("How did the {0} do last night?", "the score of the {0} game"),
              ("Did the {0} win?", "the result of the {0} game")), overlap="news"),
    Scenario(("find_recipe", "search_recipes", "get_recipe", "recipe_lookup"),
             "Find a recipe.",
             (_slot("dish query meal recipe_name", "string", "the dish", DISHES),),
             ("Find a recipe for {0}.", "Show me how to make {0}.", "Get me a {0} recipe."),
             (("How do I make {0}?", "a recipe for {0}"),)),
    Scenario(("transfer_money", "send_payment", "pay_contact", "send_money"),
             "Send money to someone.",
             (_slot("amount sum value total", "number", "how much to send", _amount),
              _slot("recipient to payee name", "string", "who receives it", NAMES)),
             ("Send {0} dollars to {1}.", "Transfer {0} to {1}.", "Pay {1} {0} dollars.")),
    Scenario(("get_account_balance", "check_balance", "account_balance"),
             "The balance of a bank account.",
             (_slot("account account_type account_name which", "string", "the account",
                    ACCOUNTS),),
             (),
             (("What's the balance of my {0} account?", "the balance of the {0} account"),
              ("How much money is in my {0} account?", "the balance of the {0} account"),
              ("Check my {0} balance.", "the balance of the {0} account"))),
    Scenario(("order_ride", "request_taxi", "book_ride", "call_cab"), "Order a ride.",
             (_slot("destination to dropoff address", "string", "where to go", PLACES),),
             ("Get me a ride to {0}.", "Order a taxi to {0}.", "Book a cab to {0}.")),
    Scenario(("set_thermostat", "set_temperature", "thermostat_set"),
             "Set the thermostat's target temperature.",
             (_slot("temperature degrees target value", "integer", "the temperature",
                    _integer(15, 28)),),
             ("Set the thermostat to {0} degrees.", "Make it {0} degrees in here.",
              "Change the temperature to {0}.")),
    Scenario(("lock_door", "door_lock", "secure_door"), "Lock a door.",
             (_slot("door door_name which location", "string", "the door", DOORS),),
             ("Lock the {0} door.", "Make sure the {0} door is locked.")),
    Scenario(("unlock_door", "door_unlock", "open_lock"), "Unlock a door.",
             (_slot("door door_name which location", "string", "the door", DOORS),),
             ("Unlock the {0} door.", "Let me in through the {0} door.")),
    Scenario(("find_restaurant", "search_restaurants", "restaurant_search"),
             "Find restaurants.",
             (_slot("cuisine food kind style", "string", "the cuisine", CUISINES), CITY),
             ("Find a {0} restaurant in {1}.", "Look for {0} food in {1}.",
              "Recommend a {0} place in {1}."),
             (("Where can I eat {0} food in {1}?", "a {0} restaurant in {1}"),)),
    Scenario(("get_showtimes", "movie_times", "find_showtimes"), "When a film is showing.",
             (_slot("movie title film movie_title", "string", "the film", MOVIES),),
             (),
             (("When is {0} playing?", "the showtimes of {0}"),
              ("What time is {0} on tonight?", "the showtimes of {0}"))),
    Scenario(("buy_tickets", "purchase_tickets", "book_tickets"), "Buy tickets for an event.",
             (_slot("quantity count tickets number", "integer", "how many tickets",
                    _integer(1, 8)),
              _slot("event show event_name performance", "string", "the event", EVENTS)),
             ("Buy {0} tickets for {1}.", "Get {0} tickets to {1}.",
              "Book {0} seats for {1}.")),
    Scenario(("create_note", "save_note", "add_note", "write_note"), "Save a note.",
             (_slot("content text body note", "string", "the note's text", NOTES),),
             ("Make a note to {0}.", "Write down: {0}.", "Save a note saying {0}."),
             overlap="note"),
    Scenario(("define_word", "get_definition", "dictionary_lookup"), "A word's definition.",
             (_slot("word term entry headword", "string", "the word", WORDS),),
             ("Define {0}.",),
             (("What does {0} mean?", "the meaning of {0}"),
              ("What's the definition of {0}?", "the definition of {0}"))),
    Scenario(("calculate_tip", "tip_calculator", "compute_tip"), "The tip on a bill.",
             (_slot("percent tip_percent rate percentage", "integer", "the tip percentage",
                    _integer(10, 25)),
              _slot("bill amount total bill_amount", "number", "the bill", _amount)),
             ("Work out a {0}% tip on {1} dollars.", "Calculate a {0} percent tip on {1}."),
             (("What's a {0}% tip on {1}?", "a {0}% tip on {1}"),)),
    Scenario(("rename_file", "move_file", "file_rename"), "Rename a file.",
             (_slot("old_name source path from_name", "string", "the file's name", FILES),
              _slot("new_name target destination to_name", "string", "its new name",
                    ("final.pdf", "old_notes.txt", "backup.csv", "cover.jpg", "v3.docx"))),
             ("Rename {0} to {1}.", "Change the name of {0} to {1}.")),
    Scenario(("delete_file", "remove_file", "trash_file"), "Delete a file.",
             (_slot("path filename file name", "string", "the file", FILES),),
             ("Delete the file {0}.", "Remove {0}.", "Throw {0} in the trash.")),
    Scenario(("schedule_meeting", "book_meeting", "set_up_meeting"), "Book a meeting.",
             (_slot("attendee person with participant", "string", "who to meet", NAMES),
              _slot("time start when start_time", "string", "when", TIMES)),
             ("Set up a meeting with {0} at {1}.", "Book a meeting with {0} for {1}.",
              "Schedule a call with {0} at {1}."), overlap="add-event"),
    Scenario(("get_traffic", "traffic_report", "check_traffic"), "Traffic on a road.",
             (_slot("road route highway street", "string", "the road", ROADS),),
             (),
             (("How is traffic on {0}?", "the traffic on {0}"),
              ("Is {0} busy right now?", "the traffic on {0}"))),
    Scenario(("check_room", "room_availability", "is_room_free"),
             "Whether a meeting room is free.",
             (_slot("room room_name space location", "string", "the room", ROOMS),
              _slot("date day when on_date", "string", "the date", DATES)),
             (),
             (("Is the {0} room free on {1}?", "whether the {0} room is free on {1}"),
              ("Can I use the {0} room {1}?", "whether the {0} room is free on {1}"))),
    Scenario(("get_population", "population_of", "country_population"),
             "A country's population.",
             (_slot("country nation country_name place", "string", "the country", COUNTRIES),),
             (),
             (("What is the population of {0}?", "the population of {0}"),
              ("How many people live in {0}?", "the population of {0}"))),
    Scenario(("post_message", "send_to_channel", "chat_post"), "Post in a chat channel.",
             (_slot("channel room channel_name destination", "string", "the channel",
                    CHANNELS),
              _slot("text message body content", "string", "what to post",
                    ("deploy done", "lunch is here", "standup moved", "build is green"))),
             ("Post {1} in #{0}.", "Tell #{0} that {1}.", "Write {1} in the {0} channel.")),
    Scenario(("create_task", "add_todo", "new_task"), "Add a to-do item.",
             (_slot("title task item description", "string", "the task", NOTES),
              _slot("due due_date deadline by", "string", "when it is due", DATES)),
             ("Add a task to {0} by {1}.", "Put {0} on my to-do list for {1}."),
             overlap="note"),
    Scenario(("get_train_times", "next_train", "train_schedule"), "The next train.",
             (_slot("origin from_station departure start", "string", "where from", CITIES),
              _slot("destination to_station arrival end", "string", "where to", CITIES)),
             (),
             (("When is the next train from {0} to {1}?", "the next train from {0} to {1}"),
              ("Trains from {0} to {1}?", "the trains from {0} to {1}"))),
    Scenario(("rate_movie", "review_film", "give_rating"), "Rate a film.",
             (_slot("movie film title movie_title", "string", "the film", MOVIES),
              _slot("stars rating score value", "integer", "the rating", _integer(1, 5))),
             ("Give {0} {1} stars.", "Rate {0} {1} out of 5.")),
    Scenario(("subscribe_newsletter", "newsletter_signup", "add_subscriber"),
             "Sign an address up for the newsletter.",
             (_slot("email address email_address contact", "string", "the address", EMAILS),),
             ("Subscribe {0} to the newsletter.", "Sign {0} up for the newsletter.")),
    Scenario(("log_workout", "track_exercise", "record_activity"), "Log a workout.",
             (_slot("minutes duration length time", "integer", "how long",
                    _integer(10, 90)),
              _slot("activity sport kind exercise", "string", "the activity", ACTIVITIES)),
             ("Log a {0} minute {1}.", "Record {0} minutes of {1}.")),
    Scenario(("get_horoscope", "daily_horoscope", "horoscope"), "Today's horoscope.",
             (_slot("sign zodiac star_sign zodiac_sign", "string", "the sign", SIGNS),),
             ("Read me the horoscope for {0}.",),
             (("What's the horoscope for {0} today?", "the horoscope for {0}"),)),
    Scenario(("share_document", "share_file", "grant_access"), "Share a document.",
             (_slot("document doc file item", "string", "the document", DOCUMENTS),
              _slot("email with recipient user", "string", "who to share it with", EMAILS)),
             ("Share the document {0} with {1}.", "Give {1} access to {0}.",
              "Share {0} with {1}.")),
    Scenario(("order_coffee", "buy_coffee", "coffee_order"), "Order a coffee.",
             (_slot("size cup_size cup volume", "enum", "the size", SIZES, SIZES),
              _slot("drink beverage item order", "string", "the drink", DRINKS)),
             ("Order a {0} {1}.", "Get me a {0} {1}.", "Buy me a {0} {1}.")),
    Scenario(("play_song", "play_track", "music_play"), "Play a song.",
             (_slot("song title track song_name", "string", "the song", SONG_TITLES),),
             ("Play {0}.", "Put on the song {0}."), overlap="play"),
    Scenario(("check_visa", "visa_requirements", "needs_visa"),
             "Whether a visa is needed for a country.",
             (_slot("country destination nation country_code", "string", "the country",
                    COUNTRIES),),
             ("Check if I need a visa for {0}.",),
             (("Do I need a visa for {0}?", "whether a visa is needed for {0}"),
              ("Is a visa required to visit {0}?", "whether a visa is needed for {0}"))),
    Scenario(("get_air_quality", "air_quality", "check_air"), "The air quality in a city.",
             (CITY,),
             (),
             (("How is the air in {0} today?", "the air quality in {0}"),
              ("What's the air quality like in {0}?", "the air quality in {0}"),
              ("Is the air in {0} safe right now?", "the air quality in {0}"))),
    Scenario(("get_sunrise", "sunrise_time", "sun_times"), "Sunrise and sunset in a city.",
             (CITY,),
             (),
             (("When is sunrise in {0}?", "the sunrise time in {0}"),
              ("What time does the sun rise in {0}?", "the sunrise time in {0}"))),
    Scenario(("find_parking", "parking_search", "search_parking"), "Parking near a place.",
             (_slot("near place location address", "string", "where to park", PLACES),),
             ("Find parking near {0}.", "Look for a parking spot near {0}."),
             (("Where can I park near {0}?", "parking near {0}"),)),
    Scenario(("book_appointment", "see_doctor", "schedule_visit"), "Book a doctor's visit.",
             (_slot("doctor provider physician with", "string", "the doctor",
                    ("Dr. Patel", "Dr. Okafor", "Dr. Lind", "Dr. Costa", "Dr. Baker")),
              _slot("date day when visit_date", "string", "the date", DATES)),
             ("Book an appointment with {0} on {1}.", "See if {0} can see me {1}.",
              "Make me an appointment with {0} for {1}.")),
    Scenario(("check_book", "library_search", "find_book"),
             "Whether the library has a book.",
             (_slot("title book book_title query", "string", "the book",
                    ("Dune", "Beloved", "Emma", "Ulysses", "Matilda", "Walden")),),
             ("Check whether the library has {0}.",),
             (("Is {0} available at the library?", "whether {0} is available"),
              ("Can I borrow {0} from the library?", "whether {0} is available"))),
    Scenario(("next_bus", "bus_arrivals", "get_bus_times"), "When buses reach a stop.",
             (_slot("stop stop_id stop_number station", "string", "the stop",
                    ("42", "118", "7B", "305", "22A")),),
             (),
             (("When does the next bus come to stop {0}?", "the next bus at stop {0}"),
              ("How long until a bus reaches stop {0}?", "the next bus at stop {0}"))),
    Scenario(("send_invoice", "bill_client", "create_invoice"), "Send a client an invoice.",
             (_slot("client customer company recipient", "string", "the client",
                    ("Acme", "Globex", "Initech", "Umbrella", "Hooli")),
              _slot("amount total sum price", "number", "the amount", _amount)),
             ("Send {0} an invoice for {1}.", "Bill {0} {1} dollars.",
              "Invoice {0} for {1}.")),
    Scenario(("get_coin_price", "crypto_price", "coin_quote"), "The price of a cryptocurrency.",
             (_slot("coin symbol asset currency", "string", "the coin",
                    ("BTC", "ETH", "SOL", "DOGE", "ADA")),),
             (),
             (("How much is {0} worth right now?", "the price of {0}"),
              ("What's {0} trading at?", "the price of {0}"),
              ("Give me the current {0} price.", "the price of {0}"))),
    Scenario(("set_volume", "change_volume", "volume_set"), "Set the speaker volume.",
             (_slot("level volume value percent", "integer", "the volume level",
                    _integer(0, 100)),),
             ("Set the volume to {0}.", "Turn the volume to {0}.", "Change the volume to {0}%.")),
    Scenario(("start_vacuum", "clean_room", "vacuum"), "Send the robot vacuum to a room.",
             (_slot("room area zone space", "string", "the room",
                    ("kitchen", "hallway", "bedroom", "living room", "office")),),
             ("Vacuum the {0}.", "Clean the {0} with the robot.", "Send the vacuum to the {0}.")),
    Scenario(("log_meal", "track_calories", "add_food"), "Log a meal's calories.",
             (_slot("food meal item dish", "string", "the food", DISHES),
              _slot("calories kcal energy amount", "integer", "the calories",
                    _integer(80, 1200))),
             ("Log {0} with {1} calories.", "Add {0}, {1} calories, to my food diary.",
              "Track {1} calories of {0}.")),
    Scenario(("get_distance", "distance_between", "route_distance"),
             "The driving distance between two cities.",
             (_slot("origin from_city start source", "string", "where from", CITIES),
              _slot("destination to_city end target", "string", "where to", CITIES)),
             (),
             (("How far is it from {0} to {1}?", "the distance from {0} to {1}"),
              ("What's the distance between {0} and {1}?", "the distance from {0} to {1}"),
              ("How many miles from {0} to {1}?", "the distance from {0} to {1}"))),
    Scenario(("follow_account", "follow_user", "subscribe_to"), "Follow an account.",
             (_slot("handle username account user", "string", "the account",
                    ("@nasa", "@chef_ana", "@techdaily", "@k_osei", "@greenmaps")),),
             ("Follow {0}.", "Start following {0}.", "Subscribe me to {0}.")),
    Scenario(("archive_emails", "archive_mail", "mail_archive"), "Archive a sender's emails.",
             (_slot("sender from_address from contact", "string", "the sender", NAMES),),
             ("Archive the emails from {0}.", "Move {0}'s mail to the archive.")),
    Scenario(("is_holiday", "check_holiday", "public_holiday"),
             "Whether a date is a public holiday.",
             (_slot("date day when on", "string", "the date", DATES),
              _slot("country nation region country_name", "string", "the country",
                    COUNTRIES)),
             (),
             (("Is {0} a holiday in {1}?", "whether {0} is a holiday in {1}"),
              ("Are banks closed on {0} in {1}?", "whether {0} is a holiday in {1}"))),
)


def scenarios(split: str) -> tuple[Scenario, ...]:
    """The scenarios of `split` (held-out ones, about a fifth, by their first name)."""
    kept = set(split_items(tuple(scenario.names[0] for scenario in SCENARIOS), split))
    return tuple(scenario for scenario in SCENARIOS if scenario.names[0] in kept)


def _tool(rng: random.Random, scenario: Scenario, split: str) -> Tool:
    arguments: list[Argument] = []
    taken: set[str] = set()
    for slot in scenario.slots:
        name = rng.choice([n for n in slot.names if n not in taken] or [f"{slot.names[0]}_2"])
        if split == TRAIN and rng.random() < MADE_UP_ARGUMENT_SHARE:
            name = made_up_word(rng)
            while name in taken:
                name += "x"
        taken.add(name)
        arguments.append(Argument(name, slot.type, f"{capitalized(slot.about)}.", True,
                                  slot.options))
    name = rng.choice(scenario.names)
    verb, _, noun = name.partition("_")
    return Tool(name, verb, None, noun.replace("_", " ") or verb, scenario.description,
                tuple(arguments), rng.choice(("status", "result", "id", "message")))


def _request(rng: random.Random, scenario: Scenario, values: list[str]
             ) -> tuple[str, str, str]:
    """The request, its restatement (the reasoning's first sentence) and the action a decline
    names."""
    person = rng.choice(NAMES)
    if scenario.questions and (not scenario.actions or rng.random() < 0.5):
        question, thing = rng.choice(scenario.questions)
        request = question.format(*values)
        thing = thing.format(*values)
        restated, action = asks_for(thing), f"find {thing}"
    else:
        sentence = rng.choice(scenario.actions).format(*values)
        action = sentence[:1].lower() + sentence[1:].rstrip(".!?")
        restated = asks(action)
        request = sentence
        if rng.random() < LEAD_IN_SHARE:
            lead_in = rng.choice(NATURAL_LEAD_INS + tuple(
                capitalized(lead) for lead in QUESTION_LEAD_INS))
            asking = not lead_in.startswith(("Please", "I ", "Go", "Help"))
            request = f"{lead_in} {action}{'?' if asking else '.'}"
    if rng.random() < OPENER_SHARE:
        request = f"{rng.choice(OPENERS).format(person=person)} {request}"
    if rng.random() < CLOSER_SHARE:
        request += rng.choice(CLOSERS).format(person=person)
    return request, restated, action


def sample_case(rng: random.Random, split: str, kind: str | None = None) -> UnseenToolCase:
    """A case of `kind` (random by the unseen tools' KIND_WEIGHTS when None) from the
    scenarios of `split`."""
    if kind is None:
        kind = rng.choices(KINDS, weights=KIND_WEIGHTS)[0]
    pool = scenarios(split)
    scenario = rng.choice(pool)
    requested = _tool(rng, scenario, split)
    values = [slot.draw(rng) for slot in scenario.slots]
    arguments = {argument.name: value for argument, value in zip(requested.arguments, values)}
    request, restated, action = _request(rng, scenario, [spoken(value) for value in values])
    count = distractor_count(rng, split, kind)
    groups = {}  # one scenario of each other overlap group, so no two offered overlap
    for other in rng.sample(pool, len(pool)):
        groups.setdefault(other.group, other)
    groups.pop(scenario.group)
    others = [_tool(rng, other, split) for other in rng.sample(list(groups.values()), count)]
    return completed_case(rng, split, kind, request, requested, others, arguments,
                          restated=restated, declined=action)

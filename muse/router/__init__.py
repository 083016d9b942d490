"""`muse router`: an OpenAI-compatible proxy in front of prefill and decode instances."""

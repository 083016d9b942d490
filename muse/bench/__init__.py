"""Serving benchmarks: seeded workload traces, an asyncio load generator, metrics and plots.

`muse bench serve` drives any OpenAI-compatible server (muse, vLLM, SGLang) by URL; see
docs/benchmarking.md.
"""

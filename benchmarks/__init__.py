"""Offline speed benchmarks: muse side by side with transformers, with roofline estimates."""

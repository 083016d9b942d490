"""Prefill / decode disaggregation: instances that only prefill hand the prompt's KV blocks
to instances that decode (`config`, `transport`, `kv_export`, `kv_import`); `muse.router`
sends each request to one of each."""

"""Quantized checkpoints: detecting their layout and the quant methods that run them."""

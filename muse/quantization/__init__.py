"""Quantized checkpoints: detecting their layout and the quant methods that run them."""

# Formats whose scales need no calibration: what an unquantized model can be quantized to as
# it loads (`EngineArgs.quantization`, vLLM's `--quantization`).
ONLINE_FORMATS = ("fp8", "nvfp4-w4a16", "mxfp4")

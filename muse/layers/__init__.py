"""The engine's layers: each owns how its parameters are created, sharded and loaded.

- `quantization.py`: the quant-method interface (`create_weights`,
  `process_weights_after_loading`, `apply`) and the unquantized methods.
- `lazy_slice.py`: narrowing a checkpoint tensor or safetensors slice to a rank's part.
- `linear.py`: replicated, column, merged column, QKV and row parallel linear layers.
- `embedding.py`: vocabulary-parallel embedding and LM head.
- `fused_moe.py`: the latent MoE's routed experts, sharded over TP or EP.
- `norm.py`: RMSNorm's replicated weight (the math is the kernel backend's).

Nothing here imports `muse.engine`: the layers sit below it.
"""

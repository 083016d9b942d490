"""Piecewise CUDA graphs: steps no whole-step graph covers (several prefills, prefills mixed
with decodes), with everything but attention replayed from graphs.

The decode, verify and one-request prefill graphs (`cuda_graphs.py`) capture a whole step,
attention included, which needs a fixed batch shape. A mixed step has any number of requests
of any query lengths, so its attention metadata has no fixed shape; the rest of a layer (the
norms, the projections, the MoE) only sees a flat row of tokens. Like vLLM's `PIECEWISE` mode
and SGLang's piecewise CUDA graph, the forward of each token-count bucket is cut at the
attention of every layer:

    piece 0:      embedding, rotary tables, layer 0 up to its attention (q, k, v)
    piece i:      layer i-1 from its attention's output (o_proj, norm, MLP / MoE),
                  layer i up to its attention
    piece L:      layer L-1 from its attention's output, the final hidden states

and between two pieces the attention runs eagerly over the step's real tokens with the
step's metadata (`EngineAttention.attend`: the K/V store and the paged attention). Pieces
hand their tensors over in static buffers of the largest bucket (each bucket uses their
first rows), so a bucket's pieces own no memory of their own beyond their intermediates.

A step of n tokens runs the smallest bucket T >= n: its first n rows of the input buffers
take the step's tokens and positions; rows n..T-1 keep whatever an earlier step left
there (valid token ids and positions) and the attention output's padding rows are zeroed,
so they go through the pieces as finite values and are never read: every operation in a
piece is row by row (norms, products, routing, experts), and attention only reads the real
rows. The padded count may still change how real rows round (the experts' kernels group
tokens by expert and pick tiles from the count), as a different batch would. Not used for steps with LoRA adapters, media embeddings, per-layer
hooks, FP8 scale calculation, context parallelism or a drafter's captured layers (those
run eagerly), nor with several ranks (no graph is captured there yet).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from muse.kernels.attention_metadata import BatchMetadata

logger = logging.getLogger("muse")
# A piece made replayable: `capture(run)` returns what replays it (on CUDA a captured graph;
# the tests' stand-in runs it eagerly).
Capture = Callable[[Callable[[], None]], Callable[[], None]]


def piecewise_buckets(max_tokens: int, smallest: int = 16) -> list[int]:
    """Token counts the pieces are captured for: powers of two and 1.5 times each from
    `smallest` (a step is padded by less than half its tokens) up to `max_tokens`, which is
    always included."""
    sizes, size = [], smallest
    while size < max_tokens:
        sizes += [size, size * 3 // 2]
        size *= 2
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


class PiecewiseGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 max_tokens: int, device: torch.device) -> None:
        self.model = model
        self.layers = list(model.model.layers.values())
        self.kv_caches = kv_caches
        self.buckets = piecewise_buckets(max_tokens)
        size = self.buckets[-1]
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        # The hand-over buffers, made on the first (eager) run of a piece, when their shapes
        # and dtypes are known: q, k, v, residual, rotary tables by kind, attention output,
        # final hidden states.
        self.buffers: dict[str, torch.Tensor] = {}
        self.pieces: dict[int, list[Callable[[], None]]] = {}
        self.steps = 0  # steps run through the pieces

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.buckets[-1]

    @torch.inference_mode()
    def capture(self, capture: Capture) -> None:
        """Make every bucket's pieces replayable, the largest bucket first (its eager warm-up
        run sizes the buffers)."""
        start = time.perf_counter()
        for size in reversed(self.buckets):
            self.pieces[size] = [capture(self._piece(size, index))
                                 for index in range(len(self.layers) + 1)]
        if self.input_ids.is_cuda:
            torch.cuda.synchronize(self.input_ids.device)
        logger.info("captured piecewise CUDA graphs (%d pieces each) for %s tokens in %.1f s",
                    len(self.layers) + 1, ", ".join(map(str, self.buckets)),
                    time.perf_counter() - start)

    def run(self, input_ids: torch.Tensor, meta: BatchMetadata) -> torch.Tensor:
        """The step's final hidden states [tokens, hidden] (a view of a static buffer, valid
        until the next step)."""
        count = input_ids.shape[0]
        size = next(s for s in self.buckets if s >= count)
        pieces = self.pieces[size]
        self.input_ids[:count].copy_(input_ids)
        self.positions[:count].copy_(meta.positions)
        buffers = self.buffers
        self._clear_padding(count, size)
        pieces[0]()
        for index, (layer, kv_cache) in enumerate(zip(self.layers, self.kv_caches)):
            attended = layer.self_attn.attend(buffers["q"][:count], buffers["k"][:count],
                                              buffers["v"][:count], meta, kv_cache)
            buffers["attended"][:count].copy_(attended)
            pieces[index + 1]()
        self.steps += 1
        return buffers["hidden"][:count]

    def _clear_padding(self, count: int, size: int) -> None:
        """Attention writes only the real rows; the padding rows see zeros (not what an
        earlier step left), so nothing they compute can overflow to inf or NaN (a NaN row
        would still route to experts that exist, but zeros keep the pieces' work finite)."""
        self.buffers["attended"][count:size].zero_()

    # ---- the pieces ----------------------------------------------------------------------
    def _piece(self, size: int, index: int) -> Callable[[], None]:
        """Piece `index` of bucket `size`: what a graph of it replays."""
        last = len(self.layers)

        def piece() -> None:
            if index == 0:
                x, residual = self.model.model.embed_tokens(self.input_ids[:size]), None
                for kind, (cos, sin) in self.model.rotary(self.positions[:size]).items():
                    self._store(f"cos.{kind}", cos, size)
                    self._store(f"sin.{kind}", sin, size)
            else:
                attended = self._buffer("attended", size, self._attended_shape())
                x, residual = self.layers[index - 1].after_attention(
                    attended, self.buffers["residual"][:size])
            if index == last:
                self._store("hidden", x + residual, size)
                return
            rotary = {kind: (self.buffers[f"cos.{kind}"][:size],
                             self.buffers[f"sin.{kind}"][:size])
                      for kind in {layer.layer_type for layer in self.layers}}
            q, k, v, residual = self.layers[index].before_attention(x, residual, rotary)
            for name, value in (("q", q), ("k", k), ("v", v), ("residual", residual)):
                self._store(name, value, size)
        return piece

    def _attended_shape(self) -> tuple[torch.Size, torch.dtype]:
        attention = self.layers[0].self_attn
        q = self.buffers["q"]
        return torch.Size((attention.num_heads * attention.head_dim,)), q.dtype

    def _buffer(self, name: str, size: int, like: tuple[torch.Size, torch.dtype]
                ) -> torch.Tensor:
        """The first `size` rows of buffer `name` (made with rows of shape and dtype `like`
        on first use)."""
        buffer = self.buffers.get(name)
        if buffer is None:
            shape, dtype = like
            buffer = torch.zeros((self.buckets[-1], *shape), dtype=dtype,
                                 device=self.input_ids.device)
            self.buffers[name] = buffer
        return buffer[:size]

    def _store(self, name: str, value: torch.Tensor, size: int) -> None:
        self._buffer(name, size, (value.shape[1:], value.dtype)).copy_(value)


def eager_capture(run: Callable[[], None]) -> Callable[[], None]:
    """The pieces without CUDA (tests): one run now, as `cuda_capture`'s warm-up, then each
    replay runs the piece eagerly over the same buffers."""
    run()
    return run


def cuda_capture(pool: tuple) -> Capture:
    """Capture a piece into a CUDA graph in `pool` after one eager run (which compiles its
    kernels and makes its buffers outside the graph's memory)."""
    def capture(run: Callable[[], None]) -> Callable[[], None]:
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            run()
        return graph.replay
    return capture

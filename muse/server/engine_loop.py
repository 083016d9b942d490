"""The engine core's main loop: take commands, step the engine, report deltas and stats.

The loop is the same in its own process (commands and results over ZMQ) and in a thread of
the server process (tests, `--engine-in-process`); only `receive` and `send` differ.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from muse.disagg.config import KVTransferConfig
from muse.engine.args import EngineArgs
from muse.engine.data_parallel import Engine, make_engine
from muse.engine.errors import InvalidRequestError
from muse.engine.request import Request
from muse.lora.request import LoRARequest
from muse.server.messages import (
    AbortRequest,
    AddRequest,
    EngineReady,
    EngineStats,
    ExpandedPrompt,
    ExpandPrompt,
    LoadLoRA,
    LoRAAdapters,
    RequestFailed,
    ResetPrefixCache,
    SampleDelta,
    Shutdown,
    UnloadLoRA,
    multi_modal_data,
)

logger = logging.getLogger("muse.engine")
STATS_INTERVAL_S = 0.2


def kv_producer_address(value: object) -> tuple[str, int] | None:
    config = KVTransferConfig.parse(value)
    return (config.kv_ip, config.kv_port) if config is not None and config.is_producer \
        else None


def engine_stats(engine: Engine) -> EngineStats:
    """Summed over the data-parallel ranks (KV usage: their mean)."""
    replicas = engine.replicas
    spec = replicas[0].spec_stats  # speculation runs on one rank
    speculative = {} if spec is None else dict(
        spec_num_drafts=spec.num_drafts, spec_num_draft_tokens=spec.num_draft_tokens,
        spec_num_accepted_tokens=spec.num_accepted_tokens,
        spec_accepted_per_position=list(spec.accepted_per_position))
    return EngineStats(**speculative,
        running=sum(len(r.scheduler.running) for r in replicas),
        waiting=sum(len(r.scheduler.waiting) for r in replicas),
        kv_usage=sum(r.kv_cache.usage() for r in replicas) / len(replicas),
        kv_blocks_used=sum(p.num_used for r in replicas for p in r.kv_cache.pools.values()),
        prefix_cache_queries=sum(r.kv_cache.stats.queries for r in replicas),
        prefix_cache_hits=sum(r.kv_cache.stats.hits for r in replicas),
        num_preemptions=sum(r.scheduler.num_preemptions for r in replicas),
        # Media runs on one rank only (encoders are not built with several), so rank 0's
        # cache is the whole story.
        encoder_cache=replicas[0].encoder_cache_stats(),
        **kv_tier_stats(replicas))


def kv_tier_stats(replicas: list) -> dict[str, dict[str, int]]:
    """Hits, bytes held and byte budgets of the prefix cache's tiers, summed over the
    data-parallel ranks (a GPU block counts as held while a request holds it or it keeps a
    cached prefix)."""
    hits: dict[str, int] = {"gpu": 0}
    used: dict[str, int] = {"gpu": 0}
    capacity: dict[str, int] = {"gpu": 0}
    for replica in replicas:
        kv_cache, offload = replica.kv_cache, replica.kv_cache.offload
        lower = 0
        for kind, group in kv_cache.groups.items():
            pool, size = group.pool, replica.block_bytes[kind]
            cached_free = sum(1 for block in group.index.keys if pool.ref_counts[block] == 0)
            used["gpu"] += (pool.num_used + cached_free) * size
            capacity["gpu"] += (pool.num_blocks - 1) * size
        if offload is not None:
            for tier, count in offload.stats.hit_tokens.items():
                hits[tier] = hits.get(tier, 0) + count
                lower += count
            for tier, count in offload.used_bytes().items():
                used[tier] = used.get(tier, 0) + count
            for tier, count in offload.capacity_bytes().items():
                capacity[tier] = capacity.get(tier, 0) + count
        hits["gpu"] += kv_cache.stats.hits - lower
    return {"kv_tier_hit_tokens": hits, "kv_tier_used_bytes": used,
            "kv_tier_capacity_bytes": capacity}


class EngineLoop:
    def __init__(self, engine: Engine, receive: Callable[[float], list],
                 send: Callable[[list], None]) -> None:
        self.engine = engine
        self.receive = receive  # (timeout seconds) -> commands
        self.send = send
        self.reported: dict[str, int] = {}  # request_id of a sample -> tokens sent

    def ready_message(self) -> EngineReady:
        engine = self.engine
        return EngineReady(model=engine.args.model, vocab_size=engine.config.vocab_size,
                           max_model_len=engine.max_model_len,
                           max_num_seqs=engine.args.max_num_seqs,
                           eos_token_ids=list(engine.eos_token_ids),
                           max_grammar_bytes=engine.args.max_grammar_bytes,
                           media_kinds=engine.replicas[0].media_kinds(),
                           video_fps=engine.replicas[0].video_fps(),
                           kv_producer=kv_producer_address(engine.args.kv_transfer_config),
                           lora_adapters=self._lora_adapters())

    def _handle(self, command) -> list:
        if isinstance(command, AddRequest):
            try:
                self._add(command)
            except InvalidRequestError as error:
                if command.media and error.param in ("prompt", "multi_modal_data"):
                    # Media comes only from chat requests, whose prompt is `messages`.
                    error.param = "messages"
                return [self._failure(command.request_id, error)]
        elif isinstance(command, AbortRequest):
            for sample in self.engine.requests.get(command.request_id, []):
                self.reported.pop(sample.request_id, None)
            self.engine.abort(command.request_id)
        elif isinstance(command, ResetPrefixCache):
            self.engine.reset_prefix_cache()
        elif isinstance(command, ExpandPrompt):
            try:
                ids = self.engine.expand_media_prompt(command.prompt_token_ids,
                                                      multi_modal_data(command.media))
            except InvalidRequestError as error:
                if error.param in ("prompt", "multi_modal_data"):
                    error.param = "messages"
                return [self._failure(command.request_id, error)]
            return [ExpandedPrompt(command.request_id, ids)]
        elif isinstance(command, (LoadLoRA, UnloadLoRA)):
            # Between two steps: a replaced adapter serves every step from the next one on.
            try:
                self._change_lora(command)
            except InvalidRequestError as error:
                return [self._failure(command.request_id, error)]
            return [LoRAAdapters(command.request_id, self._lora_adapters())]
        return []

    def _change_lora(self, command: LoadLoRA | UnloadLoRA) -> None:
        engine = self.engine
        if isinstance(command, UnloadLoRA):
            engine.remove_lora(command.lora_name)
            return
        known = {loaded.name: loaded.lora_int_id for loaded in engine.list_loras()}
        if command.lora_name in known and not command.load_inplace:
            raise InvalidRequestError(f"the adapter {command.lora_name!r} is already loaded; "
                                      f"set load_inplace to replace its weights",
                                      param="lora_name")
        # A new id: a loaded name gets its next version.
        lora_int_id = max(known.values(), default=0) + 1
        engine.add_lora(LoRARequest(command.lora_name, lora_int_id, command.lora_path))

    def _lora_adapters(self) -> dict[str, str]:
        return {loaded.name: loaded.path for loaded in self.engine.list_loras()}

    def _add(self, command: AddRequest) -> None:
        media = multi_modal_data(command.media) if command.media else None
        self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                media, command.cache_salt, command.kv_transfer_params,
                                command.lora_name)

    @staticmethod
    def _failure(request_id: str, error: InvalidRequestError) -> RequestFailed:
        return RequestFailed(request_id, str(error), error.param,
                             getattr(error, "status", 400))

    def _outputs(self, requests: list[Request]) -> list:
        """A delta per sample that changed; one failure per request that failed in the step
        (its grammar did not compile), which fails it in the front end like an admission
        error."""
        outputs, failed = [], set()
        for request in requests:
            if request.error is None:
                outputs.append(self._delta(request))
                continue
            self.reported.pop(request.request_id, None)
            if request.group_id not in failed:
                failed.add(request.group_id)
                outputs.append(self._failure(request.group_id, request.error))
        return outputs

    def _delta(self, request: Request) -> SampleDelta:
        sent = self.reported.get(request.request_id, 0)
        wants_logprobs = request.params.logprobs is not None
        first = sent == 0
        if request.is_finished:
            self.reported.pop(request.request_id, None)
        else:
            self.reported[request.request_id] = len(request.output_token_ids)
        return SampleDelta(
            request_id=request.group_id, index=request.sample_index,
            token_ids=request.output_token_ids[sent:],
            logprobs=request.output_logprobs[sent:] if wants_logprobs else None,
            finish_reason=request.finish_reason, num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            prompt_logprobs=request.prompt_logprobs if first and request.wants_prompt_logprobs
            else None, lora_version=request.lora.version if request.lora is not None else None)

    def run(self) -> None:
        last_stats = 0.0
        while True:
            busy = self.engine.has_unfinished()
            outputs: list = []
            for command in self.receive(0.0 if busy else STATS_INTERVAL_S):
                if isinstance(command, Shutdown):
                    return
                outputs.extend(self._handle(command))
            if self.engine.has_unfinished():
                outputs.extend(self._outputs(self.engine.step()))
            else:
                self.engine.serve_kv_pulls()  # a step serves them itself
            now = time.monotonic()
            if now - last_stats >= STATS_INTERVAL_S or outputs:
                self.engine.check_health()  # a worker rank that died while idle
                outputs.append(engine_stats(self.engine))
                last_stats = now
            if outputs:
                self.send(outputs)


def run_engine_process(args: EngineArgs, input_address: str, output_address: str) -> None:
    """Entry point of the engine process: build the engine, then serve the loop over ZMQ."""
    import msgspec
    import zmq

    from muse.server.messages import EngineDead, ToEngine

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.connect(input_address)
    outbox = context.socket(zmq.PUSH)
    outbox.connect(output_address)
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ToEngine)

    def send(messages: list) -> None:
        outbox.send(encoder.encode(messages))

    parent = os.getppid()

    def receive(timeout: float) -> list:
        if os.getppid() != parent:
            # The front end is gone (even SIGKILL leaves no time to stop us): exit rather than
            # hold the GPU as an orphan.
            raise SystemExit("the front end exited")
        commands = []
        if inbox.poll(int(timeout * 1000)):
            while True:
                try:
                    commands.append(decoder.decode(inbox.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    break
        return commands

    engine = None
    try:
        engine = make_engine(args)
        loop = EngineLoop(engine, receive, send)
        send([loop.ready_message()])
        loop.run()
    except Exception as error:  # reported to the front end, which fails in-flight requests
        logger.exception("engine core died")
        send([EngineDead(f"{type(error).__name__}: {error}")])
        raise
    finally:
        if engine is not None:
            engine.shutdown()  # the worker processes of other ranks, if any
        outbox.close(linger=1000)
        inbox.close(linger=0)
        context.term()

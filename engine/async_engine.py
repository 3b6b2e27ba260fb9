"""`AsyncEngine`: the synchronous engine stepped by one background thread, results fanned out to
per-request asyncio streams.

The step loop never runs on the event loop (torch releases the GIL in its kernels, so the server
stays responsive). Requests and aborts reach the loop through a thread-safe inbox and are applied
between steps; each step's outputs go back to the event loop in one `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import queue
import threading
import time
from collections import deque
from typing import AsyncIterator

from specserve.engine.config import EngineConfig
from specserve.engine.core import _DEFAULT, LLMEngine
from specserve.engine.errors import (EngineDeadError, EngineError, InvalidRequestError, QueueFullError,
                                     RequestFailedError)
from specserve.engine.outputs import RequestOutput
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.stats import EngineStats
from specserve.kernels.cpu import release_thread_team

logger = logging.getLogger("specserve")


class RequestStream:
    """Async iterator over one request's `RequestOutput` deltas; ends after the finished one."""

    def __init__(self, request_id: str, engine: "AsyncEngine", loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.error is not None:   # the engine failed this request (and only this one)
            self.finished = True
            raise RequestFailedError(item.error, item.error_code)
        if item.finished:
            self.finished = True
        return item

    async def aclose(self) -> None:
        """Stop listening; aborts the request (freeing its KV) if it is still running."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    """The engine behind the server. Admission: a request that can be scheduled soon -- a free
    sequence slot (`max_num_seqs` less the running sequences and those admitted ahead of it) and
    room in the KV pool for its prompt -- is always taken; only the requests beyond that count as
    queued, and a new one is refused (`QueueFullError`, HTTP 429 with Retry-After) when
    `max_queue_len` of them already wait. So a burst of `max_num_seqs + max_queue_len` requests
    sent at once into an idle engine is taken whole."""

    RATE_WINDOW_S = 60.0    # completions counted for the Retry-After estimate
    MAX_RETRY_AFTER_S = 60

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.model_name = engine.model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.eos_token_ids = sorted(engine.eos_token_ids)
        self.max_queue_len = engine.config.max_queue_len
        self.max_num_seqs = engine.config.max_num_seqs
        self._streams: dict[str, RequestStream] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: BaseException | None = None
        self.dead = threading.Event()    # set when the step loop has died (an unrecoverable device error)
        self._lock = threading.Lock()
        self._stats = engine.get_stats()
        # admission (see `add_request`): what is left for requests not yet running once those ahead of
        # them that can be scheduled soon are counted, as of the loop's last look plus what came since
        self._pending: dict[str, tuple[int, int]] = {}   # added, not yet seen by the loop: (sequences, KV blocks)
        self._free_slots = self.max_num_seqs
        self._free_blocks = engine.blocks.num_free_blocks
        self._num_queued = 0           # requests not yet running that cannot be scheduled soon
        self._finish_times: deque[float] = deque()      # when requests finished, the last RATE_WINDOW_S
        self._started_at = time.monotonic()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        return cls(LLMEngine(config))

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping = False
        # the step loop's OpenMP team is then the only one (`kernels.cpu.release_thread_team`)
        release_thread_team()
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        grammars = getattr(self.engine, "grammars", None)
        if grammars is not None:
            grammars.close()   # the compile sandboxes' children

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    # ---- requests ---------------------------------------------------------------------------

    @property
    def drafter_names(self) -> list[str]:
        return self.engine.drafter_names

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    drafter=_DEFAULT, drafter_options: dict | None = None, grammar=None) -> RequestStream:
        """Validate and enqueue. Raises InvalidRequestError, QueueFullError or EngineDeadError.
        `drafter`: a loaded drafter's name, "none", or omitted for the server default;
        `drafter_options`: the request's own options for it; `grammar`: the compiled matcher of
        `params.guided` (`Grammars.submit`'s result), which the request then carries to the engine
        thread (without it the constraint is taken from the grammar cache, or compiled here)."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop died: {self._dead!r}")
        drafter, drafter_options = self.engine.check_request(prompt_token_ids, params, drafter, drafter_options,
                                                             grammar)
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        num_seqs = params.n
        num_blocks = num_seqs * self.engine.blocks.blocks_for(len(prompt_token_ids) + 1)
        with self._lock:
            if not self._take(num_seqs, num_blocks):
                raise QueueFullError(f"the server is busy: {self._num_queued} requests are queued beyond the "
                                     f"{self.max_num_seqs} sequence slots; retry later",
                                     retry_after=self.retry_after())
            self._pending[request_id] = (num_seqs, num_blocks)
        stream = RequestStream(request_id, self, asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._inbox.put(("add", request_id, list(prompt_token_ids), params, time.monotonic(), drafter,
                         drafter_options, grammar))
        self._wakeup.set()
        return stream

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       drafter=_DEFAULT) -> AsyncIterator[RequestOutput]:
        """add_request + iterate; aborts the request if the caller stops early or is cancelled."""
        stream = self.add_request(request_id, prompt_token_ids, params, drafter)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request's stream (if still read) ends with finish_reason "abort"."""
        self._inbox.put(("abort", request_id))
        self._wakeup.set()

    def fail_all(self, error: EngineError) -> None:
        """Thread-safe: end every request in the engine (freeing its KV) and raise `error` in its
        stream -- e.g. when a graceful shutdown runs out of time."""
        self._inbox.put(("fail_all", error))
        self._wakeup.set()

    def get_stats(self) -> EngineStats:
        """The stats as of the loop's last step (or its last look at its inbox), with the requests added
        since and not yet seen by the loop counted as waiting: a burst arriving during a long step is
        waiting at once in the gauge routers read, not a step later."""
        stats = self._stats
        with self._lock:
            pending = sum(num_seqs for num_seqs, _ in self._pending.values())
        return dataclasses.replace(stats, num_waiting=stats.num_waiting + pending) if pending else stats

    # ---- admission --------------------------------------------------------------------------

    def _take(self, num_seqs: int, num_blocks: int, force: bool = False) -> bool:
        """Under the lock: count a request behind every one counted so far -- into a free slot with
        KV room if it can be scheduled soon (nobody ahead is queued, first come first served as the
        scheduler admits), else into the queue. False (nothing counted) when it would queue and the
        queue is full, unless `force`."""
        if self._num_queued == 0 and num_seqs <= self._free_slots and num_blocks <= self._free_blocks:
            self._free_slots -= num_seqs
            self._free_blocks -= num_blocks
            return True
        if self._num_queued >= self.max_queue_len and not force:
            return False
        self._num_queued += 1
        return True

    def _refresh_admission(self) -> None:
        """Loop thread, between steps: recount from the scheduler's own queues (running sequences,
        the waiting ones in order, the free pool), then the requests still in the inbox."""
        scheduler, blocks = self.engine.scheduler, self.engine.blocks
        with self._lock:
            self._free_slots = self.max_num_seqs - len(scheduler.running)
            self._free_blocks = blocks.num_free_blocks
            self._num_queued = 0
            queued: set[int] = set()
            for seq in scheduler.waiting:
                need = blocks.blocks_needed(seq.seq_id, len(seq.token_ids) + 1)
                if not queued and self._free_slots >= 1 and need <= self._free_blocks:
                    self._free_slots -= 1
                    self._free_blocks -= need
                else:
                    queued.add(id(seq.request))
            self._num_queued = len(queued)
            for num_seqs, num_blocks in self._pending.values():
                self._take(num_seqs, num_blocks, force=True)
            now = time.monotonic()
            while self._finish_times and self._finish_times[0] < now - self.RATE_WINDOW_S:
                self._finish_times.popleft()

    def admission(self) -> dict[str, int]:
        """{free_slots, free_blocks, queued}: what a new request would find (for tests and logs)."""
        with self._lock:
            return {"free_slots": self._free_slots, "free_blocks": self._free_blocks, "queued": self._num_queued}

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the mean gap between completions over the last
        RATE_WINDOW_S (one completion frees a slot, which takes one queued request and frees a queue
        place); with none in that window, the window so far. At least 1, at most MAX_RETRY_AFTER_S."""
        now = time.monotonic()
        window = min(self.RATE_WINDOW_S, now - self._started_at)
        recent = sum(1 for t in list(self._finish_times) if t >= now - window)
        gap = window / recent if recent else window
        return max(1, min(self.MAX_RETRY_AFTER_S, math.ceil(gap)))

    # ---- the loop ---------------------------------------------------------------------------

    def _drain_inbox(self) -> bool:
        """Hand the inbox to the engine; whether a request was added."""
        engine, added = self.engine, False
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return added
            if msg[0] == "add":
                added = True
                _, request_id, prompt, params, arrival, drafter, drafter_options, grammar = msg
                with self._lock:   # its room stays counted until `_refresh_admission` finds it in the scheduler
                    self._pending.pop(request_id, None)
                stream = self._streams.get(request_id)
                if stream is None or stream.finished:   # closed before it started
                    self._streams.pop(request_id, None)
                    continue
                try:
                    engine.add_request(request_id, prompt, params, arrival, drafter, drafter_options, checked=True,
                                       grammar=grammar)
                except Exception as exc:  # validated already; anything here is reported to that request only
                    self._deliver_error(request_id, exc)
            elif msg[0] == "abort":
                engine.abort_request(msg[1])
            else:
                for request_id in list(self._streams):
                    engine.abort_request(request_id)
                    self._deliver_error(request_id, msg[1])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                self._finish_times.append(now)
            if stream is not None:
                by_loop.setdefault(stream._loop, []).append((stream, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed: nobody is listening
                pass

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            try:
                stream._loop.call_soon_threadsafe(stream._put, exc)
            except RuntimeError:
                pass

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self._wakeup.clear()
                added = self._drain_inbox()
                if not engine.has_unfinished_requests():
                    self._stats = engine.get_stats()
                    self._refresh_admission()
                    self._wakeup.wait(timeout=0.5)
                    continue
                if added:
                    self._stats = engine.get_stats()   # the new requests waiting during the step that admits them
                outputs = engine.step()
                self._stats = engine.get_stats()
                if outputs:
                    self._deliver(outputs)
                self._refresh_admission()
        except BaseException as exc:  # noqa: BLE001 - the loop must report any death to every waiter
            # engine.step() isolates request-scoped failures itself: what reaches here is unrecoverable
            logger.exception("engine loop died")
            self._dead = exc
            self.dead.set()
            err = EngineDeadError(f"the engine loop died: {exc!r}")
            for request_id in list(self._streams):
                self._deliver_error(request_id, err)


def _put_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, out in items:
        stream._put(out)

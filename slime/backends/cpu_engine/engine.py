"""The CPU engine: a scheduler thread that owns the model and runs generation and weight changes.

One worker thread does every forward pass and every write to the weights, in order, so a
weight update always lands between two decode steps and never under a running forward. The
HTTP side only queues work: requests go to a pending queue, everything else (weight updates,
release/resume, pause) is a "control" callable the worker runs at the next step boundary.

Scheduling: at each step boundary the worker admits pending requests while the batch has
room (`max_running_requests`, and at most `max_prefill_tokens` padded prompt tokens per
prefill), prefills them together and merges them into the running batch, then runs one
decode step for all rows. Finished rows leave the batch right away.

A request submitted with a `TokenWatch` is reported token by token (streaming, top log-probs);
requests without one cost nothing extra.
"""

from __future__ import annotations

import concurrent.futures
import logging
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from slime.backends.cpu_engine import batch as batching
from slime.backends.cpu_engine import weights
from slime.backends.cpu_engine.lora import LoraAdapter, LoraStore
from slime.backends.cpu_engine.protocol import GenerationRequest, RequestError
from slime.backends.cpu_engine.sampling import sample_next_tokens
from slime.backends.cpu_engine.vision import Vision, load_vision
from slime.utils.misc import release_free_host_memory
from slime.utils.moe_routing import HFRouters, has_topk_routers, routing_shape
from slime.utils.processing_utils import is_vision_language
from slime.utils.weight_transport import MappedSegments

logger = logging.getLogger(__name__)

T = TypeVar("T")
# The most top log-probs one token may ask for (OpenAI's limit).
MAX_TOP_LOGPROBS = 20


@dataclass
class TokenWatch:
    """A hook into the decode loop for the requests it was submitted with.

    Args:
        on_token: Called on the worker thread right after each sampled token is appended to
            `request.output_ids` / `request.output_logprobs`, as `on_token(request, top_logprobs, last)`:
            `top_logprobs` holds the `top_logprobs` most likely `(token_id, log_prob)` pairs, most likely
            first, by the same convention as the sampled token's log-prob (`log_softmax(raw_logits /
            temperature)`, see `sampling.py`), empty when `top_logprobs` is 0; `last` is True for the
            token that ends the request (its `on_finish` follows). It runs between two decode steps of the
            whole batch: hand the data off (e.g. `loop.call_soon_threadsafe`) and return.
        top_logprobs: How many most likely tokens to report per step, 0 to 20.
    """

    on_token: Callable[[GenerationRequest, list[tuple[int, float]], bool], None]
    top_logprobs: int = 0

    def __post_init__(self):
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")


class CpuEngine:
    """A HuggingFace causal LM served with batched decoding on CPU.

    Args:
        model_path: Local HF folder (safetensors weights, tokenizer).
        dtype: Parameter dtype; keep float32 on CPUs without fast bf16.
        max_running_requests: Most sequences decoding at once.
        max_prefill_tokens: Most padded prompt tokens prefilled in one forward (one prompt always fits).
        context_length: Longest prompt + output; defaults to the config's `max_position_embeddings`.
        random_seed: Seeds torch's generator, used by requests without `sampling_seed`.
        num_threads: torch intra-op threads for the worker; None leaves torch's setting alone.
        tokenizer_path: Tokenizer folder when it is not `model_path`.
        trust_remote_code: Let transformers run Python code shipped in the model folder.
        enable_lora: Serve LoRA adapters per request (`lora_path`); without it requests naming one are refused.
        max_lora_rank: Highest adapter rank accepted; None for any.
        lora_target_modules: Linear leaf names adapters may target (or ["all-linear"]); None for all.
        max_loras_per_batch: Most distinct adapters in the running batch; requests of further ones wait.
        max_loaded_loras: Most adapters held at once.
        true_on_policy_threads: Report every finished response's log-probs as the FSDP trainer computes them, on
            this many threads (`--true-on-policy-mode`): bit-identical to the trainer's for the same weights. None
            reports the decode-time log-probs.
    """

    def __init__(
        self,
        model_path: str | Path,
        dtype: torch.dtype = torch.float32,
        max_running_requests: int = 32,
        max_prefill_tokens: int = 16384,
        context_length: int | None = None,
        random_seed: int = 0,
        num_threads: int | None = None,
        tokenizer_path: str | Path | None = None,
        trust_remote_code: bool = False,
        enable_lora: bool = False,
        max_lora_rank: int | None = None,
        lora_target_modules: list[str] | None = None,
        max_loras_per_batch: int = 8,
        max_loaded_loras: int = 16,
        true_on_policy_threads: int | None = None,
    ):
        if not Path(model_path).is_dir():
            raise ValueError(
                f"model_path {str(model_path)!r} is not a local directory; the CPU engine loads HF folders"
            )
        self.model_path = str(Path(model_path).resolve())
        self.tokenizer_path = str(Path(tokenizer_path).resolve()) if tokenizer_path else self.model_path
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.num_threads = num_threads
        self.true_on_policy_threads = true_on_policy_threads
        torch.manual_seed(random_seed)
        self.model, self.tokenizer = weights.load_model(self.model_path, dtype, tokenizer_path, trust_remote_code)
        config = self.model.config
        # Vision-language models: requests may carry images (`image_data`); None for text-only ones.
        self.vision: Vision | None = (
            load_vision(self.model, self.model_path, trust_remote_code) if is_vision_language(config) else None
        )
        text_config = config.get_text_config()
        self.vocab_size = self.model.get_input_embeddings().weight.shape[0]
        self.context_length = context_length or getattr(text_config, "max_position_embeddings", None) or 4096
        self.eos_token_ids = _eos_token_ids(self.model, self.tokenizer)
        self.pad_token_id = next(
            t for t in (self.tokenizer.pad_token_id, *sorted(self.eos_token_ids), 0) if t is not None
        )
        self.weight_version = "default"
        # MoE models: the routers' choices, for requests with return_routed_experts
        reports_routing = routing_shape(config) is not None and has_topk_routers(self.model)
        self.routers = HFRouters(self.model, text_config.num_hidden_layers) if reports_routing else None
        self.lora = (
            LoraStore(self.model, max_lora_rank, lora_target_modules, max_loras_per_batch, max_loaded_loras)
            if enable_lora
            else None
        )

        # A file or folder that holds exactly the live weights, reloaded by resume; None once they drift.
        on_disk = weights.safetensors_names(self.model_path)
        self._weights_source: str | None = (
            self.model_path if not weights.parameters_missing_from(self.model, on_disk) else None
        )
        self._scratch_dir: str | None = None
        self._released_layout: dict | None = None

        self._cond = threading.Condition()
        self._pending: deque[GenerationRequest] = deque()
        self._active: dict[str, GenerationRequest] = {}
        # Requests are hashed by identity (GenerationRequest has eq=False).
        self._watches: dict[GenerationRequest, TokenWatch] = {}
        self._controls: deque[tuple[Callable[[], Any], concurrent.futures.Future]] = deque()
        self._paused = False
        self._stopping = False
        self._abort_signal = False
        self._batch: batching.RunningBatch | None = None
        self._thread = threading.Thread(target=self._worker, name="cpu-engine-worker", daemon=True)
        self._thread.start()

    # ----- called from any thread -------------------------------------------------------------

    @property
    def released(self) -> bool:
        return self._released_layout is not None

    @property
    def paused(self) -> bool:
        return self._paused

    def submit(self, requests: list[GenerationRequest], watch: TokenWatch | None = None) -> None:
        """Queue requests; each one's `on_finish` is called (on the worker thread) when it ends.

        With `watch`, its `on_token` is called for every token of these requests as it is sampled.

        Raises:
            RequestError: 503 while the weights are released, 400 when a `rid` is already in flight.
        """
        with self._cond:
            if self._stopping:
                raise RequestError("the engine is shutting down", status=503)
            if self.released:
                raise RequestError(
                    "the engine's weights are released (/release_memory_occupation); "
                    "call /resume_memory_occupation before generating",
                    status=503,
                )
            if self.routers is None and any(r.return_routed_experts for r in requests):
                raise RequestError(
                    "return_routed_experts: this model has no MoE router the CPU engine reports (a dense model, or "
                    "a router kind slime.utils.moe_routing.HFRouters does not know); drop the field (and "
                    "--use-rollout-routing-replay)"
                )
            taken = [r.rid for r in requests if r.rid in self._active]
            if taken:
                raise RequestError(f"rid {taken[0]!r} is already in flight; use a fresh rid")
            self._check_adapters(requests)
            for request in requests:
                if request.params.sampling_seed is not None:
                    request.generator = torch.Generator().manual_seed(request.params.sampling_seed)
                self._active[request.rid] = request
                if watch is not None:
                    self._watches[request] = watch
                self._pending.append(request)
            self._cond.notify()

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        """Abort one request (by `rid`) or all of them; returns how many were in flight.

        Waiting requests end at once with no output; running ones end at the next step boundary
        with what they have generated so far. Both report finish_reason `{"type": "abort"}`.
        """
        with self._cond:
            if abort_all:
                hits = list(self._active.values())
            else:
                hits = [self._active[rid]] if rid in self._active else []
            waiting = self._mark_aborted(hits)
        for request in waiting:
            self._finish(request, _abort_reason())
        return len(hits)

    def _mark_aborted(self, hits: list[GenerationRequest]) -> list[GenerationRequest]:
        """Flag `hits` for abort (under `_cond`); returns those still waiting, taken off the queue: the caller
        finishes them (running ones end at the next step boundary)."""
        waiting = []
        for request in hits:
            request.abort_requested = True
            if request in self._pending:
                self._pending.remove(request)
                waiting.append(request)
        self._abort_signal = True
        self._cond.notify()
        return waiting

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` on the worker thread at the next step boundary; the future holds its result."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cond:
            if self._stopping:
                raise RuntimeError("the engine is shut down")
            self._controls.append((fn, future))
            self._cond.notify()
        return future

    def pause(self, mode: str = "abort") -> concurrent.futures.Future[None]:
        """Stop decoding at the next step boundary; new requests wait until `continue_generation`.

        Args:
            mode: "abort" ends every request in flight with its partial output (SGLang's default);
                "in_place" / "retract" keep them, with their KV cache, and carry on after
                `continue_generation` (here both behave the same).

        Returns:
            A future that completes once the worker has stopped between two steps.
        """
        if mode not in ("abort", "in_place", "retract"):
            raise RequestError(f"mode must be 'abort', 'in_place' or 'retract', got {mode!r}")
        with self._cond:
            self._paused = True
        if mode == "abort":
            self.abort(abort_all=True)
        return self.call(lambda: None)

    def continue_generation(self) -> None:
        """Undo `pause`."""
        with self._cond:
            self._paused = False
            self._cond.notify()

    def load(self) -> dict[str, int]:
        """Request counts, named as SGLang's /v1/loads does."""
        with self._cond:
            waiting = len(self._pending)
            total = len(self._active)
        return {"num_running_reqs": total - waiting, "num_waiting_reqs": waiting, "num_total_reqs": total}

    def generated_tokens_in_flight(self) -> int:
        """Tokens the requests still in flight have produced so far (what an abort now would hand back)."""
        with self._cond:
            return sum(len(r.output_ids) for r in self._active.values())

    def update_weights(
        self, named_tensors: list[tuple[str, torch.Tensor]], weight_version: str | None = None
    ) -> concurrent.futures.Future[str]:
        """Copy (HF name, tensor) pairs into the model between two steps; the future holds the new version."""

        def run() -> str:
            self._require_weights("update weights")
            weights.copy_named_tensors(weights.weight_targets(self.model), named_tensors)
            return self._updated(weight_version)

        return self.call(run)

    def update_weights_from_segments(
        self,
        named_tensors: Callable[[], list[tuple[str, torch.Tensor]]],
        segments: MappedSegments,
        weight_version: str | None = None,
    ) -> concurrent.futures.Future[tuple[str, list[str]]]:
        """Take (HF name, view) pairs from `named_tensors()`, views into `segments`, between two steps.

        `named_tensors` runs on the worker thread, the one thread that uses `segments`. Parameters of the
        view's dtype are pointed at it (no copy: `weights.adopt_named_tensors`); the sender never writes a
        segment the weights live in until an answer says they left it.

        Returns:
            A future holding the new version and the names of the segments the weights now live in.
        """

        def run() -> tuple[str, list[str]]:
            self._require_weights("update weights")
            weights.adopt_named_tensors(weights.weight_targets(self.model), named_tensors())
            return self._updated(weight_version), segments.holding(self.model.state_dict(keep_vars=True).values())

        return self.call(run)

    def receive_weights(
        self,
        layout: list[tuple[str, torch.dtype, tuple[int, ...]]],
        receive: Callable[[torch.Tensor], None],
        weight_version: str | None = None,
    ) -> concurrent.futures.Future[str]:
        """Receive (name, dtype, shape) tensors into the model between two steps, all or nothing (a broadcast's
        `receive(buffer)` per tensor); the future holds the new version."""

        def run() -> str:
            if self.released:
                weights.drain_named_tensors(layout, receive)
            self._require_weights("update weights")
            weights.receive_named_tensors(weights.weight_targets(self.model), layout, receive)
            return self._updated(weight_version)

        return self.call(run)

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> concurrent.futures.Future:
        """Load every safetensors tensor of a HF folder into the model; the future holds the new version."""

        def run() -> str:
            self._require_weights("update weights")
            weights.load_safetensors_folder(weights.weight_targets(self.model), model_path)
            return self._updated(weight_version)

        return self.call(run)

    def set_weight_version(self, version: str) -> concurrent.futures.Future[str]:
        """Label the live weights `version` between two steps (SGLang's /update_weight_version, sent after an
        adapter push that changed what the engine generates); the future holds it."""
        return self.call(lambda: self._bump_version(version))

    def lora_adapters(self) -> dict[str, str]:
        """name -> source of every loaded adapter ({} without LoRA)."""
        with self._cond:
            return self.lora.loaded() if self.lora is not None else {}

    def lora_store(self) -> LoraStore:
        """The adapter store; RequestError (400) when the engine was started without --enable-lora."""
        if self.lora is None:
            raise RequestError(_LORA_OFF)
        return self.lora

    def add_lora_adapter(self, adapter: LoraAdapter) -> concurrent.futures.Future[dict[str, str]]:
        """Hold `adapter` (built by `lora_store().build`) from the next step on; the future holds `lora_adapters()`."""
        store = self.lora_store()

        def run() -> dict[str, str]:
            with self._cond:
                store.add(adapter)
                return store.loaded()

        return self.call(run)

    def remove_lora_adapter(self, name: str) -> concurrent.futures.Future[dict[str, str]]:
        """Abort the requests in flight that use adapter `name`, then drop it; the future holds `lora_adapters()`.

        Both happen under one lock hold between two steps, so a request naming it either is aborted here or,
        submitted later, is refused.
        """
        store = self.lora_store()

        def run() -> dict[str, str]:
            with self._cond:
                if name not in store.adapters:
                    raise RequestError(f"no adapter named {name!r} is loaded; loaded: {sorted(store.adapters)}")
                waiting = self._mark_aborted([r for r in self._active.values() if r.lora_path == name])
                store.remove(name)  # the worker drops the running rows that use it before the next forward
                loaded = store.loaded()
            for request in waiting:
                self._finish(request, _abort_reason(f"adapter {name!r} was unloaded"))
            return loaded

        return self.call(run)

    def release_memory(self) -> concurrent.futures.Future[None]:
        """Free the weights' memory. Refused (400) while requests are in flight.

        Weights that no longer match a checkpoint on disk are first saved to a scratch
        safetensors file, which `resume_memory` reloads.
        """
        return self.call(self._release)

    def resume_memory(self) -> concurrent.futures.Future[None]:
        """Reallocate the weights and reload them from the checkpoint or the release snapshot."""
        return self.call(self._resume)

    def shutdown(self) -> None:
        """Abort everything, stop the worker and remove scratch files."""
        self.abort(abort_all=True)
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=60)
        if self._scratch_dir is not None:
            shutil.rmtree(self._scratch_dir, ignore_errors=True)

    # ----- worker thread ----------------------------------------------------------------------

    def _check_adapters(self, requests: list[GenerationRequest]) -> None:
        """Refuse requests naming an adapter that is not loaded (called under `_cond`).

        While generation is paused a weight push may be replacing the adapter (unload, then load): such requests
        wait in the queue, and admission ends those whose adapter is still missing then (`_take_pending`).
        """
        names = [r.lora_path for r in requests if r.lora_path is not None]
        if not names:
            return
        if self.lora is None:
            raise RequestError(f"lora_path: {_LORA_OFF}")
        if self._paused:
            return
        unknown = next((name for name in names if name not in self.lora.adapters), None)
        if unknown is not None:
            raise RequestError(
                f"lora_path {unknown!r} is not a loaded adapter; loaded: {sorted(self.lora.adapters)} "
                "(load it first with /load_lora_adapter)"
            )

    def _has_work(self) -> bool:
        can_run = not self._paused and not self.released and (self._pending or self._batch is not None)
        return self._stopping or bool(self._controls) or self._abort_signal or bool(can_run)

    def _worker(self) -> None:
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        while True:
            with self._cond:
                self._cond.wait_for(self._has_work)
                if self._stopping:
                    return
                controls = list(self._controls)
                self._controls.clear()
                self._abort_signal = False
            # Requests aborted so far end before the controls run: an abort pause then returns with none running
            # (the flush after it would refuse), and a weight update does not label their tokens with its version.
            self._drop_aborted()
            for fn, future in controls:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as error:  # handed to the caller through the future
                        future.set_exception(error)
            self._drop_aborted()  # and those a control aborted (an adapter unloaded)
            if self._paused or self.released:
                continue
            admitted = self._take_pending()
            try:
                if admitted:
                    self._admit(admitted)
                if self._batch is not None:
                    self._decode_step()
            except Exception as error:
                logger.exception("generation step failed")
                failed = admitted + (self._batch.requests if self._batch is not None else [])
                self._set_batch(None)
                for request in failed:
                    if not request.finished:
                        request.error = f"generation failed: {error!r}"
                        self._finish(request, _abort_reason(request.error))

    def _take_pending(self) -> list[GenerationRequest]:
        running = len(self._batch) if self._batch is not None else 0
        if self._batch is not None and not batching.caches_can_merge(self._batch.cache):
            return []
        taken: list[GenerationRequest] = []
        # Requests of an adapter beyond --max-loras-per-batch wait, in order, for the batch to drop one.
        adapters = {r.lora_path for r in self._batch.requests} if self._batch is not None else set()
        adapters.discard(None)
        held_back, missing = [], []
        with self._cond:
            longest = 0
            while self._pending and running + len(taken) < self.max_running_requests:
                name = self._pending[0].lora_path
                if name is not None and name not in self.lora.adapters:  # queued while paused, never loaded
                    missing.append(self._pending.popleft())
                    continue
                if name is not None and name not in adapters and len(adapters) >= self.lora.max_per_batch:
                    held_back.append(self._pending.popleft())
                    continue
                longest = max(longest, len(self._pending[0].input_ids))
                if taken and longest * (len(taken) + 1) > self.max_prefill_tokens:
                    break
                taken.append(self._pending.popleft())
                if name is not None:
                    adapters.add(name)
            self._pending.extendleft(reversed(held_back))
        for request in missing:
            request.error = f"lora_path {request.lora_path!r} is not a loaded adapter (it was not loaded again)"
            request.error_status = 400
            self._finish(request, _abort_reason(request.error))
        return taken

    def _admit(self, requests: list[GenerationRequest]) -> None:
        for request in requests:
            if request.logprob_start_len >= 0:
                request.input_logprobs = batching.prompt_log_probs(
                    self.model,
                    request.input_ids,
                    request.logprob_start_len,
                    request.params.temperature,
                    self.lora,
                    request.lora_path,
                    request.vision,
                )
        generating = []
        for request in requests:
            if request.max_new_tokens == 0:
                self._finish(request, {"type": "length", "length": 0})
            else:
                generating.append(request)
        if not generating:
            return
        joining, logits = batching.prefill(self.model, generating, self.pad_token_id, self.routers, self.lora)
        joining, finished = self._advance(joining, logits)
        try:
            if joining is not None:
                self._set_batch(joining if self._batch is None else batching.merge(self.model, self._batch, joining))
        finally:  # the finished ones are answered even when the merge fails (the step's handler fails the rest)
            self._finish_all(finished)

    def _decode_step(self) -> None:
        logits = batching.decode(self.model, self._batch, self.routers, self.lora)
        batch, finished = self._advance(self._batch, logits)
        del logits
        self._set_batch(batch)  # before the answers go out: a client that has them finds a drained batch's memory freed
        self._finish_all(finished)

    def _finish_all(self, finished: list[tuple[GenerationRequest, dict[str, Any]]]) -> None:
        for request, reason in finished:
            self._finish(request, reason)

    def _advance(
        self, batch: batching.RunningBatch, logits: torch.Tensor
    ) -> tuple[batching.RunningBatch | None, list[tuple[GenerationRequest, dict[str, Any]]]]:
        """Sample one token per row and record it. Returns the batch without the rows that finished (None when
        none is left) and the finished requests with their reasons, for the caller to finish once the batch is
        set."""
        requests = batch.requests
        banned = [self._stop_token_ids(r) if len(r.output_ids) < r.params.min_new_tokens else [] for r in requests]
        failed: dict[int, str] = {}
        try:
            tokens, log_probs = sample_next_tokens(
                logits, [r.params for r in requests], [r.generator for r in requests], banned
            )
        except Exception as error:
            # One request's parameters can fail the batched sampler: sample row by row, so that only the rows
            # that fail on their own end (with the error), and the others go on.
            logger.warning("batched sampling failed (%r): sampling the %d rows one by one", error, len(requests))
            tokens, log_probs = [], []
            for row, request in enumerate(requests):
                try:
                    (token,), (log_prob,) = sample_next_tokens(
                        logits[row : row + 1], [request.params], [request.generator], [banned[row]]
                    )
                except Exception as row_error:
                    failed[row], token, log_prob = f"sampling failed: {row_error!r}", 0, 0.0
                tokens.append(token)
                log_probs.append(log_prob)
        batch.last_tokens = torch.tensor(tokens, dtype=torch.long)
        watches = [self._watches.get(r) for r in requests] if self._watches else None
        tops = _top_log_probs(logits, requests, watches) if watches else None
        alive, finished = [], []
        for row, (request, token, log_prob) in enumerate(zip(requests, tokens, log_probs)):
            if row in failed:
                request.error = failed[row]
                finished.append((request, _abort_reason(request.error)))
                continue
            request.output_ids.append(token)
            request.output_logprobs.append(log_prob)
            reason = self._finish_reason(request)
            if watches and watches[row] is not None:
                try:
                    watches[row].on_token(request, tops[row], reason is not None)
                except Exception:
                    logger.exception("on_token of request %s failed", request.rid)
            if reason is None:
                alive.append(row)
            else:
                if self.true_on_policy_threads and request.return_logprob:
                    self._rescore(request)
                finished.append((request, reason))
        if len(alive) == len(requests):
            return batch, finished
        return (batching.keep_rows(self.model, batch, alive) if alive else None), finished

    def _rescore(self, request: GenerationRequest) -> None:
        """`true_on_policy_threads`: replace the decode-time log-probs of a finished response with the trainer's
        computation of them (`batching.response_log_probs`) on the trainer's thread count, since a matmul's
        rounding depends on how many threads split it."""
        threads = torch.get_num_threads()
        torch.set_num_threads(self.true_on_policy_threads)
        try:
            request.output_logprobs = batching.response_log_probs(
                self.model, request.input_ids, request.output_ids, request.params.temperature
            )
        finally:
            torch.set_num_threads(threads)

    def _stop_token_ids(self, request: GenerationRequest) -> list[int]:
        if request.params.ignore_eos:
            return []
        return sorted(self.eos_token_ids.union(request.params.stop_token_ids))

    def _finish_reason(self, request: GenerationRequest) -> dict[str, Any] | None:
        """SGLang's order: the length limit first, then stop tokens, then stop strings."""
        produced = len(request.output_ids)
        if produced >= request.max_new_tokens:
            return {"type": "length", "length": request.max_new_tokens}
        if produced < request.params.min_new_tokens:
            return None
        token = request.output_ids[-1]
        if not request.params.ignore_eos and (token in self.eos_token_ids or token in request.params.stop_token_ids):
            return {"type": "stop", "matched": token}
        if request.params.stop:
            tail = self.tokenizer.decode(request.output_ids[-request.stop_str_window :])
            for stop in request.params.stop:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        return None

    def _drop_aborted(self) -> None:
        if self._batch is None:
            return
        keep = []
        for row, request in enumerate(self._batch.requests):
            if request.abort_requested:
                self._finish(request, _abort_reason())
            else:
                keep.append(row)
        if len(keep) < len(self._batch):
            self._set_batch(batching.keep_rows(self.model, self._batch, keep) if keep else None)

    def _set_batch(self, batch: batching.RunningBatch | None) -> None:
        drained = batch is None and self._batch is not None
        self._batch = batch
        if drained:
            # The drained batch's KV caches and logits, freed by the line above: glibc keeps their pages otherwise
            # (0.5 GiB after 32 requests of 100 tokens on a 135M model), resident through the next training step.
            release_free_host_memory()

    def _finish(self, request: GenerationRequest, reason: dict[str, Any]) -> None:
        with self._cond:
            self._active.pop(request.rid, None)
            self._watches.pop(request, None)
        request.finish_reason = reason
        request.weight_version = self.weight_version
        request.finish_time = time.time()
        if request.on_finish is not None:
            try:
                request.on_finish(request)
            except Exception:
                logger.exception("on_finish of request %s failed", request.rid)

    def _require_weights(self, action: str) -> None:
        if self.released:
            raise RequestError(f"cannot {action}: the weights are released; call /resume_memory_occupation first")

    def _updated(self, weight_version: str | None) -> str:
        """After new weights landed: they no longer match a file (a release snapshots them instead), the update's
        buffers go back to the OS (glibc keeps them otherwise: a second copy of the weights resident for the rest
        of the run), and the version moves on. Returns the new version."""
        self._weights_source = None
        release_free_host_memory()
        return self._bump_version(weight_version)

    def _bump_version(self, explicit: str | None) -> str:
        if explicit is not None:
            self.weight_version = str(explicit)
        elif self.weight_version.isdigit():
            self.weight_version = str(int(self.weight_version) + 1)
        else:
            self.weight_version = "1"
        return self.weight_version

    def _release(self) -> None:
        with self._cond:
            if self.released:
                return
            if self._active:
                raise RequestError(
                    f"cannot release memory with {len(self._active)} request(s) in flight; "
                    "abort them (/abort_request with abort_all) or wait for them first"
                )
            # Mark released now (submit refuses from here on); the layout is filled in below.
            self._released_layout = {}
        try:
            if self._weights_source is None:
                if self._scratch_dir is None:
                    self._scratch_dir = tempfile.mkdtemp(prefix="slime-cpu-engine-")
                snapshot = Path(self._scratch_dir) / "released-weights.safetensors"
                weights.save_weights(self.model, snapshot)
                self._weights_source = str(snapshot)
        except Exception:
            self._released_layout = None
            raise
        self._released_layout = weights.free_parameters(self.model)

    def _resume(self) -> None:
        if not self.released:
            return
        weights.allocate_parameters(self.model, self._released_layout)
        try:
            loaded = weights.load_safetensors_folder(weights.weight_targets(self.model), self._weights_source)
            missing = weights.parameters_missing_from(self.model, loaded)
            if missing:
                raise RuntimeError(f"{self._weights_source} lacks parameters {missing[:8]}; the weights stay released")
        except Exception:
            weights.free_parameters(self.model)
            raise
        with self._cond:
            self._released_layout = None
            self._cond.notify()


def _top_log_probs(
    logits: torch.Tensor, requests: list[GenerationRequest], watches: list[TokenWatch | None]
) -> list[list[tuple[int, float]]]:
    """Per row, the `top_logprobs` most likely (token id, log-prob) pairs its watch asks for ([] otherwise).

    The same arithmetic as `sample_next_tokens` (fp32 raw logits / temperature, 1 when greedy, log-softmax),
    so a sampled token's reported log-prob and its entry here agree exactly.
    """
    rows = [row for row, watch in enumerate(watches) if watch is not None and watch.top_logprobs > 0]
    tops: list[list[tuple[int, float]]] = [[] for _ in requests]
    if not rows:
        return tops
    temperatures = torch.tensor(
        [requests[r].params.temperature if not requests[r].params.greedy else 1.0 for r in rows]
    )
    log_probs = (logits[rows].float() / temperatures.unsqueeze(-1)).log_softmax(dim=-1)
    k = min(max(watches[r].top_logprobs for r in rows), log_probs.shape[-1])
    values, ids = log_probs.topk(k, dim=-1)
    for i, row in enumerate(rows):
        count = watches[row].top_logprobs
        tops[row] = list(zip(ids[i, :count].tolist(), values[i, :count].tolist()))
    return tops


_LORA_OFF = "LoRA is not enabled on this engine; start it with --enable-lora to serve adapters"


def _abort_reason(message: str = "aborted") -> dict[str, Any]:
    return {"type": "abort", "message": message}


def _eos_token_ids(model, tokenizer) -> set[int]:
    """EOS ids from the tokenizer, the generation config and the model config (each may be a list)."""
    ids: set[int] = set()
    for value in (
        tokenizer.eos_token_id,
        getattr(model.generation_config, "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
    ):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return ids

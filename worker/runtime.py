"""The batch runtime: static batches through `generate` on the loaded model (worker/model_loading.py), with the
adapter per batch (or per row through PEFT), out-of-memory splitting and NaN containment.

No Celery or database here: the engine hands in `GenerationRequest`s and records the `BatchOutcome`.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import time
from dataclasses import dataclass

import torch
from peft import PeftModel
from peft.tuners.lora.model import _adapter_names_pre_forward_hook
from transformers import (
    BatchEncoding,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedTokenizerBase,
    StoppingCriteria,
    StoppingCriteriaList,
)

from shared.settings import Settings
from worker.generation import BatchOutcome, GenerationRequest, GenerationResult
from worker.model_loading import load_model
from worker.tokens import check_request, decode_with_spans, encode_chats

__all__ = ["AdapterRuntime", "BatchOutcome", "GenerationRequest", "GenerationResult"]

log = logging.getLogger("kevlaya.runtime")


@dataclass
class _Run:
    """Results of one or more generate calls over a list of requests (in their order)."""

    results: list[GenerationResult]
    prefill_ms: float = 0.0
    decode_ms: float = 0.0

    def __add__(self, other: _Run) -> _Run:
        return _Run(self.results + other.results, self.prefill_ms + other.prefill_ms, self.decode_ms + other.decode_ms)


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc)
    )


def remove_stale_peft_hooks(model: torch.nn.Module) -> int:
    """Remove `adapter_names` pre-forward hooks that a failed `generate(adapter_names=...)` left behind.

    PEFT registers them in a context manager without try/finally (peft issue #3475), so after an exception they
    stay and inject stale adapter names (of the failed batch's size) into every later forward pass.
    """
    removed = 0
    for module in model.modules():
        for hook_id, hook in list(module._forward_pre_hooks.items()):
            if isinstance(hook, functools.partial) and hook.func is _adapter_names_pre_forward_hook:
                # what RemovableHandle.remove() does for a pre-hook registered with_kwargs=True
                del module._forward_pre_hooks[hook_id]
                module._forward_pre_hooks_with_kwargs.pop(hook_id, None)
                removed += 1
    return removed


class _Monitor(LogitsProcessor):
    """Times prefill vs decode and stops rows whose logits went non-finite, without disturbing the other rows."""

    def __init__(self, prompt_len: int, limits: torch.Tensor, eos_ids: torch.Tensor):
        self.prompt_len, self.limits, self.eos_ids = prompt_len, limits, eos_ids
        self.step_times: list[float] = []  # when each step's logits were ready; step k picks token k
        self.bad_step: dict[int, int] = {}  # row -> generated tokens before its logits went non-finite
        self.chosen_logprobs: list[torch.Tensor] = []  # per step: log p(chosen token) for every row
        self._last_logprobs: torch.Tensor | None = None

    def record_choice(self, chosen: torch.Tensor) -> None:
        """Log-probability of the tokens picked from the previous step's distribution."""
        if self._last_logprobs is not None:
            self.chosen_logprobs.append(self._last_logprobs.gather(1, chosen[:, None]).squeeze(1))
            self._last_logprobs = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # This processor runs before temperature/top-p, so these are the model's own probabilities.
        if input_ids.shape[1] > self.prompt_len:
            self.record_choice(input_ids[:, -1])
        self._last_logprobs = torch.log_softmax(scores.float(), dim=-1)
        # -inf alone is legitimate (processors mask tokens with it); NaN, +inf or nothing left to pick is not.
        broken = torch.isnan(scores).any(-1) | torch.isposinf(scores).any(-1) | torch.isneginf(scores).all(-1)
        any_broken = bool(broken.any())  # also synchronises CUDA, so each timestamp marks the step's real end
        self.step_times.append(time.perf_counter())
        if not any_broken:
            return scores
        generated = input_ids[:, self.prompt_len:]
        finished = torch.isin(generated, self.eos_ids).any(-1) | (generated.shape[1] >= self.limits)
        for row in (broken & ~finished).nonzero().flatten().tolist():
            self.bad_step.setdefault(row, generated.shape[1])
        # Finished rows are sanitised too: their scores are still sampled (then replaced by padding), and
        # multinomial sampling fails on NaN.
        scores = scores.masked_fill(broken[:, None], float("-inf"))
        scores[broken, self.eos_ids[0]] = 0.0
        return scores


class _RowLimits(StoppingCriteria):
    """Per-row max_new_tokens: generate runs to the batch's maximum, each row stops at its own limit."""

    def __init__(self, prompt_len: int, limits: torch.Tensor):
        self.prompt_len, self.limits = prompt_len, limits

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: object) -> torch.BoolTensor:
        return (input_ids.shape[1] - self.prompt_len) >= self.limits


def _failure(request: GenerationRequest, code: str, message: str, prompt_tokens: int = 0) -> GenerationResult:
    return GenerationResult(job_id=request.job_id, text=None, prompt_tokens=prompt_tokens, completion_tokens=0,
                            prefill_ms=0.0, decode_ms=0.0, error_code=code, error_message=message)


SamplingKey = tuple[float, float, int | None]


def _sampling_key(request: GenerationRequest) -> SamplingKey:
    # Greedy ignores top_p and seed, so all greedy requests can share one generate call.
    if request.temperature == 0:
        return (0.0, 1.0, None)
    return (request.temperature, request.top_p, request.seed)


class AdapterRuntime:
    """The base model with every available adapter loaded once; serves batches of requests."""

    def __init__(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, device: str,
                 unavailable: dict[str, str], *, ignore_eos: bool = False):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.unavailable = unavailable
        # Benchmarks only: every row generates exactly its max_new_tokens, so random weights cannot stop early.
        self.ignore_eos = ignore_eos
        self.oom_splits = 0
        loaded = set(model.peft_config) if isinstance(model, PeftModel) else set()
        self.adapters: set[str] = loaded - unavailable.keys()
        self.active_adapter: str | None = model.active_adapter if self.adapters else None
        self.numerical_errors = 0
        eos = model.generation_config.eos_token_id
        eos_ids = [tokenizer.eos_token_id, *([eos] if isinstance(eos, int) else eos or [])]
        self.eos_ids = list(dict.fromkeys(i for i in eos_ids if i is not None))  # tokenizer's first: it is forced
        self.pad_id = tokenizer.pad_token_id
        self._input_device = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")

    @classmethod
    def load(cls, settings: Settings) -> AdapterRuntime:
        loaded = load_model(settings)
        return cls(loaded.model, loaded.tokenizer, loaded.device, loaded.unavailable, ignore_eos=settings.ignore_eos)

    # -- batches -----------------------------------------------------------------------------------------------

    def run_batch(self, requests: list[GenerationRequest], *, mixed: bool = False) -> BatchOutcome:
        """Run `requests`; per-request failures are results, never exceptions.

        Not mixed: one set_adapter per adapter group. Mixed: adapters are chosen per row (`adapter_names`).
        Either way a group is split further by sampling settings, since one generate call has one config.
        """
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        started, oom_splits = time.perf_counter(), self.oom_splits
        results: list[GenerationResult | None] = [None] * len(requests)
        groups: dict[tuple[str | None, SamplingKey], list[int]] = {}
        for index, request in enumerate(requests):
            if reason := self.refusal(request.adapter):
                results[index] = _failure(request, "adapter_unavailable", reason)
            elif problem := self.check(request)[1]:
                results[index] = _failure(request, "invalid_input", problem)
            else:
                groups.setdefault((None if mixed else request.adapter, _sampling_key(request)), []).append(index)

        switch_ms = prefill_ms = decode_ms = 0.0
        # The active adapter's groups first (saves a switch), then each other adapter's groups together.
        order = sorted(groups.items(), key=lambda item: (item[0][0] != self.active_adapter, item[0][0] or ""))
        for (adapter, _), indices in order:
            if adapter is not None:
                switch_ms += self._activate(adapter)
            run = self._run_splitting([requests[i] for i in indices], mixed, started)
            for index, result in zip(indices, run.results, strict=True):
                results[index] = result
            prefill_ms += run.prefill_ms
            decode_ms += run.decode_ms

        return self._outcome(results, switch_ms, prefill_ms, decode_ms, self.oom_splits - oom_splits)

    def run_base_only(self, requests: list[GenerationRequest]) -> BatchOutcome:
        """The bare base model with every adapter disabled: a baseline for evaluation, never used for jobs."""
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        started, oom_splits = time.perf_counter(), self.oom_splits
        context = self.model.disable_adapter() if isinstance(self.model, PeftModel) else contextlib.nullcontext()
        results: list[GenerationResult | None] = [None] * len(requests)
        prefill_ms = decode_ms = 0.0
        with context:
            groups: dict[SamplingKey, list[int]] = {}
            for index, request in enumerate(requests):
                groups.setdefault(_sampling_key(request), []).append(index)
            for indices in groups.values():
                run = self._run_splitting([requests[i] for i in indices], False, started)
                for index, result in zip(indices, run.results, strict=True):
                    results[index] = result
                prefill_ms += run.prefill_ms
                decode_ms += run.decode_ms
        return self._outcome(results, 0.0, prefill_ms, decode_ms, self.oom_splits - oom_splits)

    def _outcome(self, results: list[GenerationResult | None], switch_ms: float, prefill_ms: float,
                 decode_ms: float, oom_splits: int) -> BatchOutcome:
        done = [r for r in results if r is not None]
        assert len(done) == len(results)
        return BatchOutcome(
            results=done, switch_ms=switch_ms, prefill_ms=prefill_ms, decode_ms=decode_ms,
            tokens=sum(r.completion_tokens for r in done),
            peak_vram_bytes=torch.cuda.max_memory_allocated() if self.device == "cuda" else None,
            oom_splits=oom_splits,
        )

    def refusal(self, adapter: str) -> str | None:
        """Why `adapter` cannot be served, or None; never fall back to the bare base model."""
        if adapter in self.adapters:
            return None
        if adapter in self.unavailable:
            return self.unavailable[adapter]
        return f"unknown adapter {adapter!r}; this worker serves {', '.join(sorted(self.adapters)) or 'none'}"

    def check(self, request: GenerationRequest) -> tuple[int, str | None]:
        """The request's prompt tokens, and why it cannot run on this model (or None)."""
        context = getattr(self.model.config, "max_position_embeddings", None)
        return check_request(self.tokenizer, context, request, self._input_device)

    def _activate(self, adapter: str) -> float:
        if adapter == self.active_adapter:
            return 0.0
        started = time.perf_counter()
        self.model.set_adapter(adapter, inference_mode=True)  # the default would make it trainable
        self.active_adapter = adapter
        return (time.perf_counter() - started) * 1000

    def _run_splitting(self, batch: list[GenerationRequest], mixed: bool, batch_started: float) -> _Run:
        """Generate for `batch`; on out-of-memory clean up, split it in halves and retry each half.

        `batch_started` (perf_counter) is when the whole batch began: each row's time to first token counts from it.

        A request that runs out of memory alone fails with `out_of_memory`; the others still succeed.
        """
        encoded = self._encode(batch)
        try:
            return self._generate(batch, encoded, mixed, batch_started)
        except Exception as exc:
            if removed := remove_stale_peft_hooks(self.model):
                log.warning("removed %d PEFT forward hook(s) left behind by a failed generate", removed)
            if not is_out_of_memory(exc):
                raise
        # Retry only out here: inside the except block the traceback keeps the failed attempt's activations
        # alive, and the retry would run out of memory as well.
        self._free_memory()
        if len(batch) == 1:
            prompt_tokens = int(encoded["attention_mask"].sum())
            log.warning("job %s ran out of memory alone (%d prompt tokens, max_new_tokens %d)",
                        batch[0].job_id, prompt_tokens, batch[0].max_new_tokens)
            return _Run([_failure(
                batch[0], "out_of_memory",
                f"out of memory even when run alone ({prompt_tokens} prompt tokens, "
                f"max_new_tokens {batch[0].max_new_tokens}); shorten the input or lower max_new_tokens",
                prompt_tokens,
            )])
        half = len(batch) // 2
        self.oom_splits += 1
        log.warning("out of memory on a batch of %d; retrying as %d + %d", len(batch), half, len(batch) - half)
        return (self._run_splitting(batch[:half], mixed, batch_started)
                + self._run_splitting(batch[half:], mixed, batch_started))

    def _free_memory(self) -> None:
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()

    def _encode(self, batch: list[GenerationRequest]) -> BatchEncoding:
        return encode_chats(self.tokenizer, batch, self._input_device)

    def _generate(self, batch: list[GenerationRequest], encoded: BatchEncoding, mixed: bool,
                  batch_started: float) -> _Run:
        """One generate call; all rows share the sampling settings of the first."""
        input_ids = encoded["input_ids"]
        prompt_len = input_ids.shape[1]
        limits = torch.tensor([r.max_new_tokens for r in batch], device=input_ids.device)
        eos_ids = torch.tensor(self.eos_ids, device=input_ids.device)
        monitor = _Monitor(prompt_len, limits, eos_ids)
        temperature, top_p, seed = _sampling_key(batch[0])
        options: dict[str, object] = dict(do_sample=temperature > 0)
        if temperature > 0:
            options.update(temperature=temperature, top_p=top_p)
        if mixed:
            options["adapter_names"] = [r.adapter for r in batch]
        if self.ignore_eos:
            options["min_new_tokens"] = int(limits.max())
        if seed is not None:
            torch.manual_seed(seed)

        started = time.perf_counter()
        with torch.inference_mode():
            output = self.model.generate(
                input_ids=input_ids, attention_mask=encoded["attention_mask"],
                max_new_tokens=int(limits.max()), pad_token_id=self.pad_id, eos_token_id=self.eos_ids,
                logits_processor=LogitsProcessorList([monitor]),
                stopping_criteria=StoppingCriteriaList([_RowLimits(prompt_len, limits)]),
                **options,
            )
        if self.device == "cuda":
            torch.cuda.synchronize()
        finished = time.perf_counter()
        steps = monitor.step_times or [finished]
        prefill_ms, decode_ms = (steps[0] - started) * 1000, (finished - steps[0]) * 1000

        monitor.record_choice(output[:, -1])
        logprobs = torch.stack(monitor.chosen_logprobs, dim=1).tolist() if monitor.chosen_logprobs else []
        prompt_tokens = encoded["attention_mask"].sum(-1).tolist()
        eos = set(self.eos_ids)
        results = []
        for row, request in enumerate(batch):
            tokens = output[row, prompt_len:prompt_len + request.max_new_tokens].tolist()
            # A row ends at its first EOS (counted: the model produced it); after that it holds padding.
            count = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
            text, spans = decode_with_spans(self.tokenizer, tokens[:count])
            last_step = steps[min(max(count, 1), len(steps)) - 1]
            result = GenerationResult(
                job_id=request.job_id, text=text,
                prompt_tokens=int(prompt_tokens[row]), completion_tokens=count,
                prefill_ms=prefill_ms, decode_ms=(last_step - steps[0]) * 1000, 
                first_token_ms=(steps[0] - batch_started) * 1000,
                token_ids=tokens[:count], token_logprobs=logprobs[row][:count] if logprobs else [],
                token_spans=spans,
            )
            if row in monitor.bad_step:
                self.numerical_errors += 1
                result.error_code = "numerical_error"
                result.error_message = (f"non-finite logits (NaN/Inf) after {monitor.bad_step[row]} generated "
                                        f"token(s); the sequence was stopped and its partial text kept")
                log.error("job %s: %s", request.job_id, result.error_message)
            results.append(result)
        return _Run(results, prefill_ms, decode_ms)

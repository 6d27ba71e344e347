"""The reference runtime: static batches through transformers' `generate` on the model the worker loads
(worker/model/loading.py). Not a serving path: it is what `kevlaya eval`, the benchmark's recipe and the
equality tests compare the worker's slot decoder against (docs/architecture.md §14)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from peft import PeftModel
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from shared.settings import Settings
from worker.decoder.sampling import broken_rows
from worker.generation import GenerationRequest, GenerationResult, numerical_error
from worker.model.loading import LoadedModel, load_model
from worker.model.tokens import decode_with_spans, encode_chats


@dataclass
class ReferenceRun:
    results: list[GenerationResult]  # in the requests' order
    prefill_ms: float
    decode_ms: float


class _Monitor(LogitsProcessor):
    """Times prefill vs decode, records each chosen token's raw log-probability, and stops rows whose logits went
    non-finite (the decoder's rule: worker/decoder/sampling.py `broken_rows`) without disturbing the others."""

    def __init__(self, prompt_len: int, limits: torch.Tensor, eos_ids: torch.Tensor):
        self.prompt_len, self.limits, self.eos_ids = prompt_len, limits, eos_ids
        self.step_times: list[float] = []  # when each step's logits were ready; step k picks token k
        self.bad_step: dict[int, int] = {}  # row -> generated tokens before its logits went non-finite
        self.chosen_logprobs: list[torch.Tensor] = []  # per step: log p(chosen token) for every row
        self._last_logprobs: torch.Tensor | None = None

    def record_choice(self, chosen: torch.Tensor) -> None:
        if self._last_logprobs is not None:
            self.chosen_logprobs.append(self._last_logprobs.gather(1, chosen[:, None]).squeeze(1))
            self._last_logprobs = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # This processor runs before temperature/top-p, so these are the model's own probabilities.
        if input_ids.shape[1] > self.prompt_len:
            self.record_choice(input_ids[:, -1])
        self._last_logprobs = torch.log_softmax(scores.float(), dim=-1)
        broken = broken_rows(scores)
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


SamplingKey = tuple[float, float, int | None]


def _sampling_key(request: GenerationRequest) -> SamplingKey:
    # Greedy ignores top_p and seed, so all greedy requests can share one generate call.
    if request.temperature == 0:
        return (0.0, 1.0, None)
    return (request.temperature, request.top_p, request.seed)


class ReferenceRuntime:
    """`generate` per adapter and sampling settings on a loaded model (one `set_adapter` per adapter group)."""

    def __init__(self, loaded: LoadedModel, *, ignore_eos: bool = False):
        self.loaded = loaded
        self.model, self.tokenizer, self.device = loaded.model, loaded.tokenizer, loaded.device
        self.adapters, self.eos_ids, self.pad_id = loaded.adapters, loaded.eos_ids, loaded.tokenizer.pad_token_id
        self.ignore_eos = ignore_eos  # every row generates exactly its max_new_tokens (benchmarks)
        self._input_device = torch.device("cuda", 0) if self.device == "cuda" else torch.device("cpu")

    @classmethod
    def load(cls, settings: Settings) -> ReferenceRuntime:
        return cls(load_model(settings), ignore_eos=settings.engine.ignore_eos)

    def run_batch(self, requests: list[GenerationRequest]) -> ReferenceRun:
        """Every request to the end; each adapter's rows with that adapter active, split by sampling settings."""
        for request in requests:
            if reason := self.loaded.refusal(request.adapter):
                raise ValueError(reason)
        return self._run(requests, lambda r: (r.adapter, _sampling_key(r)), self._activate)

    def run_base_only(self, requests: list[GenerationRequest]) -> ReferenceRun:
        """The bare base model with every adapter disabled: a baseline for evaluation, never used for jobs."""
        context = self.model.disable_adapter() if isinstance(self.model, PeftModel) else contextlib.nullcontext()
        with context:
            return self._run(requests, _sampling_key, lambda _key: None)

    def _activate(self, key: tuple[str, SamplingKey]) -> None:
        self.model.set_adapter(key[0], inference_mode=True)  # the default would make it trainable

    def _run(self, requests: list[GenerationRequest], key, before) -> ReferenceRun:  # noqa: ANN001
        for request in requests:
            if request.grammar is not None or request.stop:  # only the slot decoder constrains an answer
                raise ValueError(f"job {request.job_id}: the reference runtime honours neither grammars nor stop "
                                 "strings")
        started = time.perf_counter()
        groups: dict[object, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(key(request), []).append(index)
        results: list[GenerationResult | None] = [None] * len(requests)
        prefill_ms = decode_ms = 0.0
        for group_key, indices in groups.items():
            before(group_key)
            run = self._generate([requests[i] for i in indices], started)
            for index, result in zip(indices, run.results, strict=True):
                results[index] = result
            prefill_ms += run.prefill_ms
            decode_ms += run.decode_ms
        return ReferenceRun([r for r in results if r is not None], prefill_ms, decode_ms)

    def _generate(self, batch: list[GenerationRequest], batch_started: float) -> ReferenceRun:
        """One generate call; all rows share the sampling settings of the first."""
        encoded = encode_chats(self.tokenizer, batch, self._input_device)
        input_ids = encoded["input_ids"]
        prompt_len = input_ids.shape[1]
        limits = torch.tensor([r.max_new_tokens for r in batch], device=input_ids.device)
        monitor = _Monitor(prompt_len, limits, torch.tensor(self.eos_ids, device=input_ids.device))
        temperature, top_p, seed = _sampling_key(batch[0])
        options: dict[str, object] = dict(do_sample=temperature > 0)
        if temperature > 0:
            options.update(temperature=temperature, top_p=top_p)
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
                job_id=request.job_id, text=text, prompt_tokens=int(prompt_tokens[row]), completion_tokens=count,
                prefill_ms=prefill_ms, decode_ms=(last_step - steps[0]) * 1000,
                first_token_ms=(steps[0] - batch_started) * 1000,
                token_ids=tokens[:count], token_logprobs=logprobs[row][:count] if logprobs else [],
                token_spans=spans,
            )
            if row in monitor.bad_step:
                numerical_error(result, monitor.bad_step[row])
            results.append(result)
        return ReferenceRun(results, prefill_ms, decode_ms)

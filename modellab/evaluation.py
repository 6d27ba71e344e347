"""`kevlaya eval`: decision quality and latency on the held-out test split, through the worker's slot decoder.

Modes: `base` (the bare base model, through the reference runtime: it has no adapter for the decoder to apply),
`laya`, `kev`, and `auto` (the cascade: Laya, then Kev for the answers the engine would escalate). Decision answers
are generated under the decision grammar, as the worker generates them, unless `grammar=False` (the answers as the
model writes them, free). Decoding is greedy so results are repeatable; each batch's wall time is the latency of
every job in it (batch size 1 = a job served alone)."""

from __future__ import annotations

import dataclasses
import functools
import json
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from modellab.decision_data import NONE, Scenario, render_prompt, score_decision
from modellab.reference import ReferenceRuntime
from shared.calibration import Calibration, adapter_calibration, fit_calibration, log_loss
from shared.lifecycle import JobOutcome
from shared.schemas import answer_grammar
from shared.settings import Settings
from worker.decoder.slot_decoder import SlotDecoder
from worker.engine.build import decoder_options
from worker.engine.offline import run_to_end
from worker.generation import GenerationRequest, GenerationResult
from worker.ledger.cascade import needs_escalation
from worker.ledger.outcomes import decision_probability, job_outcome
from worker.model.loading import LoadedModel

MODES = ("base", "laya", "kev", "auto")
THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.92, 0.93, 0.94, 0.95, 0.96, 0.97, 0.98, 0.99)


@dataclass
class Answer:
    """One scenario answered in one mode."""

    id: str
    label: str
    decision: str | None
    confidence: float | None  # as the service reports it: the adapter's calibration applied
    correct: bool
    latency_ms: float
    completion_tokens: int
    escalated: bool = False
    offered: bool = False  # the decision is one of the options the question lists, or "none"
    error_code: str | None = None  # why no decision: length, invalid_output, ...
    probability: float | None = None  # the model's probability of its decision, before calibration


@dataclass
class ModeReport:
    mode: str
    n: int
    accuracy: float
    valid_json_rate: float
    offered_rate: float  # decisions naming an option the question offers, or "none", over all answers
    failures: dict[str, int]  # answers without a decision, by error code
    mean_latency_ms: float
    p95_latency_ms: float
    mean_completion_tokens: float
    total_completion_tokens: int
    escalation_rate: float | None = None
    answers: list[Answer] = field(default_factory=list, repr=False)


def load_scenarios(path: Path, limit: int | None = None) -> list[tuple[str, Scenario]]:
    """The first `limit` (all: None) rows of a scenarios JSONL (`{"id", "scenario", ...}` a line, as `kevlaya
    models data` writes them). Raises ValueError naming the file and line of the first row that is not one."""
    items: list[tuple[str, Scenario]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if limit is not None and len(items) == limit:
            break
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            items.append((str(row["id"]), Scenario.from_dict(row["scenario"])))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a scenario row (a JSON object with `id` and `scenario`): "
                             f"{exc.__class__.__name__}: {exc}") from exc
    if not items:
        raise ValueError(f"{path}: no scenarios")
    return items


def slot_decoder(loaded: LoadedModel, settings: Settings, slots: int) -> SlotDecoder:
    """The worker's decoder (its options from the settings, as served) with `slots` slots."""
    window = min(settings.engine.window_tokens, loaded.context or settings.engine.window_tokens)
    return SlotDecoder(loaded.model, loaded.tokenizer, sorted(loaded.adapters), slots=slots, window=window,
                       eos_ids=loaded.eos_ids, options=dataclasses.replace(decoder_options(settings, loaded.device), spare_adapters=0))


class Evaluator:
    def __init__(self, loaded: LoadedModel, settings: Settings, batch_size: int = 1, grammar: bool = True):
        self.loaded, self.settings, self.batch_size, self.grammar = loaded, settings, batch_size, grammar

    def calibration(self, mode: str) -> Calibration:
        """The adapter's, as the worker applies it (the bare base has none)."""
        return Calibration() if mode == "base" else adapter_calibration(self.settings.adapter_profile(
            "kev" if mode == "kev" else "laya").path)

    def answers(self, mode: str, scenarios: list[tuple[str, Scenario]], progress: bool = True) -> list[Answer]:
        """Answers of `base`, `laya` or `kev` (the base is prompted exactly as Laya is, and never constrained)."""
        adapter = "kev" if mode == "kev" else "laya"
        requests = [self._request(adapter, scenario, constrained=mode != "base") for _, scenario in scenarios]
        if mode == "base":
            reference = ReferenceRuntime(self.loaded)
            return self._answered(mode, scenarios, requests, lambda chunk: reference.run_base_only(chunk).results,
                                  progress)
        decoder = self._decoder()
        try:
            run = functools.partial(run_to_end, decoder, prefill_tokens=self.settings.engine.prefill_tokens)
            return self._answered(mode, scenarios, requests, run, progress)
        finally:
            decoder.close()

    def _answered(self, mode: str, scenarios: list[tuple[str, Scenario]], requests: list[GenerationRequest],
                  run: Callable[[list[GenerationRequest]], list[GenerationResult]], progress: bool) -> list[Answer]:
        answers: list[Answer] = []
        calibration = self.calibration(mode)
        starts = range(0, len(scenarios), self.batch_size)
        for i in tqdm(starts, desc=f"eval {mode}", unit="batch", disable=not progress):
            started = time.perf_counter()
            results = run(requests[i:i + self.batch_size])
            latency_ms = (time.perf_counter() - started) * 1000
            answers += self._scored(scenarios[i:i + self.batch_size], results, latency_ms, calibration)
        return answers

    def _decoder(self) -> SlotDecoder:
        return slot_decoder(self.loaded, self.settings, self.batch_size)

    def _request(self, adapter: str, scenario: Scenario, constrained: bool) -> GenerationRequest:
        profile = self.settings.adapter_profile(adapter)
        messages = [{"role": "system", "content": profile.system_prompt},
                    {"role": "user", "content": render_prompt(scenario)}]
        grammar = answer_grammar({"output": "decision"}, messages, profile.analysis) if constrained else None
        return GenerationRequest(job_id=uuid.uuid4(), adapter=adapter, messages=messages,
                                 max_new_tokens=profile.max_new_tokens, temperature=0.0, top_p=1.0, seed=None,
                                 grammar=grammar if self.grammar else None)

    @staticmethod
    def _scored(chunk: list[tuple[str, Scenario]], results: list[GenerationResult], latency_ms: float,
                calibration: Calibration) -> list[Answer]:
        answers = []
        for (scenario_id, scenario), result in zip(chunk, results, strict=True):
            outcome = job_outcome(result, "decision", calibration)
            decision = outcome.decision or {}
            answers.append(Answer(
                id=scenario_id, label=scenario.label, decision=decision.get("decision"),
                confidence=decision.get("confidence"),
                probability=decision_probability(result) if decision else None,
                correct=bool(decision) and score_decision(scenario, decision["decision"]),
                latency_ms=latency_ms, completion_tokens=result.completion_tokens,
                offered=decision.get("decision") in {*(o.name for o in scenario.options), NONE},
                error_code=outcome.error_code,
            ))
        return answers

    def cascade(self, laya: list[Answer], kev: list[Answer]) -> list[Answer]:
        """What `auto` answers: Laya's decision, or Kev's where the engine's rule escalates."""
        combined = []
        for first, second in zip(laya, kev, strict=True):
            decision = {"decision": first.decision, "confidence": first.confidence} if first.decision else None
            outcome = JobOutcome(status="succeeded" if decision else "failed", decision=decision)
            if needs_escalation(outcome, self.settings.cascade.threshold):
                combined.append(Answer(
                    id=first.id, label=first.label, decision=second.decision, confidence=second.confidence,
                    correct=second.correct, latency_ms=first.latency_ms + second.latency_ms,
                    completion_tokens=first.completion_tokens + second.completion_tokens, escalated=True,
                    offered=second.offered, error_code=second.error_code,
                ))
            else:
                combined.append(first)
        return combined


def summarize(mode: str, answers: list[Answer]) -> ModeReport:
    latencies = sorted(a.latency_ms for a in answers)
    tokens = [a.completion_tokens for a in answers]
    return ModeReport(
        mode=mode, n=len(answers),
        accuracy=sum(a.correct for a in answers) / len(answers),
        valid_json_rate=sum(a.decision is not None for a in answers) / len(answers),
        offered_rate=sum(a.offered for a in answers) / len(answers),
        failures=dict(Counter(a.error_code for a in answers if a.error_code)),
        mean_latency_ms=statistics.fmean(latencies),
        p95_latency_ms=latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))],
        mean_completion_tokens=statistics.fmean(tokens), total_completion_tokens=sum(tokens),
        escalation_rate=sum(a.escalated for a in answers) / len(answers) if mode == "auto" else None,
        answers=answers,
    )


def calibration(answers: list[Answer], bins: int = 10, of: str = "confidence") -> dict[str, object]:
    """Reliability of a confidence (`of="probability"`: of the model's probability before the adapter's
    calibration): per bin, mean confidence vs accuracy; ECE = their weighted gap."""
    rated = [(getattr(a, of), a) for a in answers if getattr(a, of) is not None]
    table = []
    ece = 0.0
    for b in range(bins):
        low, high = b / bins, (b + 1) / bins
        members = [a for c, a in rated if low <= c < high or (b == bins - 1 and c == 1.0)]
        if not members:
            continue
        confidence = statistics.fmean(getattr(a, of) for a in members)
        accuracy = sum(a.correct for a in members) / len(members)
        ece += len(members) / len(rated) * abs(confidence - accuracy)
        table.append({"bin": [low, high], "n": len(members), "mean_confidence": confidence, "accuracy": accuracy})
    return {"n": len(rated), "ece": ece if rated else None, "bins": table}


def run_evaluation(loaded: LoadedModel, settings: Settings, scenarios: list[tuple[str, Scenario]],
                   modes: tuple[str, ...] = MODES, batch_size: int = 1, grammar: bool = True) -> dict[str, object]:
    evaluator = Evaluator(loaded, settings, batch_size, grammar)
    answers: dict[str, list[Answer]] = {}
    for mode in ("base", "laya", "kev"):
        if mode in modes or (mode in ("laya", "kev") and "auto" in modes):
            answers[mode] = evaluator.answers(mode, scenarios)
    if "auto" in modes:
        answers["auto"] = evaluator.cascade(answers["laya"], answers["kev"])
    reports = {mode: summarize(mode, answers[mode]) for mode in modes}
    sweep = None
    if "auto" in modes:
        # The stored answers re-combine for any threshold: the accuracy / latency trade-off at no extra cost.
        sweep = []
        for threshold in THRESHOLDS:
            tuned = Evaluator(loaded, settings.updated(cascade={"threshold": threshold}), batch_size)
            summary = summarize("auto", tuned.cascade(answers["laya"], answers["kev"]))
            sweep.append({"threshold": threshold, "accuracy": summary.accuracy,
                          "mean_latency_ms": summary.mean_latency_ms, "escalation_rate": summary.escalation_rate})
    return {
        "scenarios": len(scenarios),
        "batch_size": batch_size,
        "grammar": grammar,
        "device": loaded.device,
        "cascade_threshold": settings.cascade.threshold,
        "modes": {mode: {k: v for k, v in asdict(r).items() if k != "answers"} for mode, r in reports.items()},
        "laya_calibration": calibration(answers["laya"]) if "laya" in answers else None,
        "kev_calibration": calibration(answers["kev"]) if "kev" in answers else None,
        # what each adapter's calibration file changed: its fit, and the ECE of the probabilities before it
        "confidence_calibration": {a: evaluator.calibration(a).to_dict() for a in ("laya", "kev") if a in answers},
        "ece_before_calibration": {a: calibration(answers[a], of="probability")["ece"]
                                   for a in ("laya", "kev") if a in answers},
        "cascade_threshold_sweep": sweep,
        "answers": {mode: [asdict(a) for a in r.answers] for mode, r in reports.items()},
    }


def fit_adapter_calibrations(loaded: LoadedModel, settings: Settings, scenarios: list[tuple[str, Scenario]],
                             adapters: tuple[str, ...], batch_size: int = 1,
                             progress: bool = True) -> dict[str, tuple[Calibration, dict[str, object]]]:
    """Each adapter's calibration, fitted on its answers to `scenarios` (validation scenarios: answered as the
    worker answers, under the decision grammar), with what it changes there: log-loss and ECE before and after."""
    evaluator = Evaluator(loaded, settings, batch_size)
    fits = {}
    for adapter in adapters:
        answers = [a for a in evaluator.answers(adapter, scenarios, progress) if a.probability]
        if not answers:
            raise ValueError(f"{adapter} decided none of the {len(scenarios)} scenarios: nothing to calibrate on")
        probabilities, correct = [a.probability for a in answers], [a.correct for a in answers]
        fitted = fit_calibration(probabilities, correct)
        after = [replace(a, confidence=fitted.confidence(a.probability)) for a in answers]
        fits[adapter] = (fitted, {
            "answers": len(answers), "accuracy": sum(correct) / len(answers),
            "log_loss_before": log_loss(probabilities, correct, Calibration()),
            "log_loss_after": log_loss(probabilities, correct, fitted),
            "ece_before": calibration(answers, of="probability")["ece"], "ece_after": calibration(after)["ece"],
        })
    return fits


def agreement(first: list[dict[str, object]], second: list[dict[str, object]]) -> float:
    """Share of scenarios where two runs' answers (e.g. on NF4 and fp16) reach the same decision."""
    return sum(a["decision"] == b["decision"] for a, b in zip(first, second, strict=True)) / len(first)


def table(report: dict[str, object]) -> str:
    lines = [f"{'mode':<6} {'n':>5} {'accuracy':>9} {'valid JSON':>11} {'offered':>8} {'mean ms':>9} {'p95 ms':>9} "
             f"{'tokens':>7} {'escalated':>10}  failures"]
    for mode, r in report["modes"].items():
        escalated = f"{r['escalation_rate']:.1%}" if r["escalation_rate"] is not None else "-"
        failures = ", ".join(f"{code} {n}" for code, n in r["failures"].items()) or "-"
        lines.append(f"{mode:<6} {r['n']:>5} {r['accuracy']:>9.1%} {r['valid_json_rate']:>11.1%} "
                     f"{r['offered_rate']:>8.1%} {r['mean_latency_ms']:>9.1f} {r['p95_latency_ms']:>9.1f} "
                     f"{r['mean_completion_tokens']:>7.1f} {escalated:>10}  {failures}")
    for adapter in ("laya", "kev"):
        if (rated := report.get(f"{adapter}_calibration")) and rated["ece"] is not None:
            fitted = Calibration(**(report.get("confidence_calibration") or {}).get(adapter, {}))
            before = (report.get("ece_before_calibration") or {}).get(adapter)
            lines.append(f"{adapter.capitalize()} confidence calibration: ECE {rated['ece']:.3f} over {rated['n']} "
                         f"answers (confidence {fitted.describe()}" + (f"; {before:.3f} before it)" if fitted !=
                                                                     Calibration() and before is not None else ")"))
    for row in report.get("cascade_threshold_sweep") or []:
        lines.append(f"  auto at threshold {row['threshold']:.2f}: accuracy {row['accuracy']:.1%}, "
                     f"mean {row['mean_latency_ms']:.1f} ms, escalated {row['escalation_rate']:.1%}")
    return "\n".join(lines)


def plot(report: dict[str, object], path: Path) -> None:
    """Accuracy and mean latency per mode, and Laya's reliability diagram, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(report["modes"])
    figure, (accuracy_axis, latency_axis, reliability_axis) = plt.subplots(1, 3, figsize=(13, 3.8))
    accuracy_axis.bar(modes, [report["modes"][m]["accuracy"] * 100 for m in modes], color="#4c72b0")
    accuracy_axis.set_ylabel("decision accuracy (%)")
    accuracy_axis.set_ylim(0, 100)
    latency_axis.bar(modes, [report["modes"][m]["mean_latency_ms"] for m in modes], color="#dd8452")
    latency_axis.set_ylabel("mean latency per job (ms)")
    bins = (report.get("laya_calibration") or {}).get("bins", [])
    reliability_axis.plot([0, 1], [0, 1], linestyle="--", color="grey")
    reliability_axis.plot([b["mean_confidence"] for b in bins], [b["accuracy"] for b in bins], marker="o")
    reliability_axis.set_xlabel("Laya confidence")
    reliability_axis.set_ylabel("accuracy")
    reliability_axis.set_title("calibration")
    figure.suptitle(f"{report['scenarios']} held-out scenarios on {report['device']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)

"""The shipped demo model, built reproducibly from one seed: decision data, a byte-level BPE tokenizer trained on
the domain text, a small Llama-style base pretrained on that text, and the Kev and Laya adapters.

The base never sees the answer formats (Kev's analysis lines, the JSON decision objects); the adapters teach
them. Its text is the scenario prompts with prose about constraint checks, comparisons and the best option, the
way a general model knows a domain, plus notes in the symbols and JSON the answers are written with. That last
part matters: LoRA cannot train embeddings, so a token the base never read is one an adapter can hardly write.
The tokenizer is trained on the same text, so every token exists in the base's training data.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

from modellab import decision_data as dd
from modellab.model_factory import SPECIAL_TOKENS, chat_tokenizer
from modellab.presets import ALL_LINEAR, preset
from modellab.training import (
    PretrainConfig,
    TrainConfig,
    pretrain_base,
    read_samples,
    score_decisions,
    train_adapter,
)
from shared.calibration import write_calibration
from shared.manifest import MANIFEST_NAME, verify_manifest, write_manifest
from shared.settings import ADAPTERS, Settings
from worker.model.loading import load_causal_lm, load_model, resolve_device

log = logging.getLogger("kevlaya.training")

SCENARIOS = "test_scenarios.jsonl"  # the held-out split, beside the models for `kevlaya eval`
VAL_SCENARIOS = "val_scenarios.jsonl"  # the validation split, for `kevlaya models calibrate`
PROGRESS = "BUILD.progress.json"  # the trained stages finished so far, for `build-demo --resume`
OUTPUTS = ("base", "kev", "laya", SCENARIOS, VAL_SCENARIOS, "BUILD.json", MANIFEST_NAME, PROGRESS)


@dataclass(frozen=True)
class AdapterPlan:
    epochs: float
    batch_size: int
    max_steps: int | None = None
    max_seq_tokens: int = 512
    # LoRA on q_proj/v_proj alone (the CLI default) is too weak for a base this small: the demo adapts every
    # linear layer, with the recipe's rank and alpha.
    target_modules: tuple[str, ...] = ALL_LINEAR
    lr_scale: float = 1.0  # multiplies the preset learning rate


@dataclass(frozen=True)
class DemoSpec:
    n_train: int
    n_val: int
    n_test: int
    vocab_size: int
    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    intermediate_size: int
    pretrain_docs: int
    pretrain: PretrainConfig
    adapters: dict[str, AdapterPlan]
    eval_samples: int  # of the validation split, scored at the end of adapter training
    test_samples: int  # of the test split, scored on the unquantized base at the end of the build
    # Of the training prompts and of the base's scenario documents: the same decisions asked in plain words
    # (`kevlaya models build-demo --question-share`; docs/model-lab.md, The demo model, gives the shipped build's).
    question_share: float = 0.0


# Sized for about seven minutes on one H200, where a step of this model is bound by kernel launches, not
# arithmetic (measured: pretraining ~0.9M tokens/s, QLoRA ~10-12 steps/s). At the presets' learning rates
# (1e-4 / 2e-4) a LoRA on a 4M-parameter base learns too slowly for that budget, so the demo trains at 10x
# (kev 1e-3, laya 2e-3).
FULL = DemoSpec(
    n_train=60_000, n_val=1_000, n_test=1_000, vocab_size=1024,
    hidden_size=256, layers=6, heads=8, kv_heads=4, intermediate_size=640,
    pretrain_docs=120_000,
    pretrain=PretrainConfig(seq_len=256, batch_size=128, lr=2e-3, epochs=3.0, warmup_steps=100,
                            log_every=100, checkpoint_every=200),
    adapters={"kev": AdapterPlan(epochs=2.2, batch_size=64, lr_scale=10.0),
              "laya": AdapterPlan(epochs=4.6, batch_size=128, lr_scale=10.0)},
    eval_samples=512, test_samples=1_000, question_share=0.25,
)

QUICK = DemoSpec(
    n_train=300, n_val=16, n_test=16, vocab_size=384,
    hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128,
    pretrain_docs=400,
    pretrain=PretrainConfig(seq_len=128, batch_size=8, lr=2e-3, max_steps=20, warmup_steps=5, log_every=10,
                            checkpoint_every=10),
    adapters={name: AdapterPlan(epochs=1.0, max_steps=10, batch_size=8) for name in ADAPTERS},
    eval_samples=8, test_samples=8, question_share=0.25,
)


# -- domain text for the tokenizer and the base -----------------------------------------------------------------

_GENERIC_SYSTEMS = ("You are a helpful assistant.", "You answer questions about options and constraints.",
                    "Be brief and exact.")


def _checks(s: dd.Scenario, o: dd.Option) -> str:
    parts = []
    if s.budget is not None:
        parts.append(f"costs {o.cost}, {'within' if o.cost <= s.budget else 'over'} the budget of {s.budget}")
    if s.max_risk is not None:
        ok = dd.RISKS.index(o.risk) <= dd.RISKS.index(s.max_risk)
        parts.append(f"has {o.risk} risk, {'within' if ok else 'above'} the limit of {s.max_risk}")
    if s.deadline is not None:
        parts.append(f"takes {o.days} days, {'meeting' if o.days <= s.deadline else 'missing'} "
                     f"the deadline of {s.deadline}")
    return f"Option {o.name} " + "; it ".join(parts) + "."


_OBJECTIVE_WORDS = {"lowest cost": ("costs", "the cheapest"), "shortest time": ("takes", "the fastest"),
                    "highest quality": ("has quality", "the best quality"), "lowest risk": ("has risk", "the safest")}


def _objective_value(objective: str, o: dd.Option) -> str:
    return {"lowest cost": str(o.cost), "shortest time": f"{o.days} days", "highest quality": str(o.quality),
            "lowest risk": o.risk}[objective]


def _names(options: list[dd.Option]) -> str:
    names = [o.name for o in options]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _walkthrough(s: dd.Scenario, rng: random.Random) -> str:
    """A prose explanation of the scenario: every option's checks in order, the survivors compared on the
    objective, and the verdict, which comes first in some documents so the base also learns to decide at once."""
    kept = [o for o in s.options if dd.feasible(s, o)]
    checks = [_checks(s, o) for o in s.options]
    if kept:
        which = f"Only option {kept[0].name} meets" if len(kept) == 1 else f"Options {_names(kept)} meet"
        verb, best = _OBJECTIVE_WORDS[s.objective]
        values = ", ".join(f"{o.name} {verb} {_objective_value(s.objective, o)}" for o in kept)
        summary = [f"{which} every constraint.", f"Of these, {values}, so {s.label} is {best}."]
        verdict = f"For {s.objective}, the best choice is {s.label}."
    else:
        summary = ["No option meets every constraint."]
        verdict = "No option can be chosen: the answer is none."
    if rng.random() < 0.5:
        return " ".join([verdict, *checks, *summary])
    return " ".join([*checks, *summary, verdict])


def _doc_scenario(rng: random.Random, question_share: float) -> dd.Scenario:
    """A scenario for a document: at `question_share`, a question in plain words with named options, so the
    base reads those names in every form the adapters write them (in prose, at a line's start, in JSON)."""
    # No draw at all without questions, so a build without them is the one shipped, byte for byte.
    return dd.sample_question(rng) if question_share and rng.random() < question_share else dd.sample_scenario(rng)


def _option_name(rng: random.Random, question_share: float) -> str:
    """A letter, or at `question_share` an option's name from a question's theme."""
    if question_share and rng.random() < question_share:
        return rng.choice(rng.choice(dd.THEMES)["names"])
    return rng.choice(dd.LETTERS)


def _scenario_doc(rng: random.Random, question_share: float) -> str:
    s = _doc_scenario(rng, question_share)
    return dd.render_prompt(s) + " " + _walkthrough(s, rng)


def _number_pair(rng: random.Random) -> tuple[int, int]:
    """Two numbers, often close: near ties are where a small model's sense of magnitude fails first."""
    top = rng.choice((9, 30, 99))
    a = rng.randint(1, top)
    b = max(1, min(top, a + rng.choice((-3, -2, -1, 1, 2, 3)))) if rng.random() < 0.5 else rng.randint(1, top)
    return a, b


def _extremes(rng: random.Random) -> str:
    """Which of a few labelled values is smallest and largest, in prose."""
    top = rng.choice((9, 30, 99))
    values = rng.sample(range(1, top + 1), rng.randint(2, 5))
    names = rng.sample(dd.LETTERS, len(values))
    pairs = [f"{n} at {v}" for n, v in zip(names, values)]
    listed = ", ".join(pairs[:-1]) + " and " + pairs[-1]
    low, high = names[values.index(min(values))], names[values.index(max(values))]
    return f"Among {listed}, {low} has the smallest value and {high} the largest."


def _number_doc(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(3, 8)):
        kind = rng.randrange(4)
        if kind == 0:
            a, b = _number_pair(rng)
            sentences.append(f"{a} is {'less than' if a < b else 'more than' if a > b else 'equal to'} {b}.")
        elif kind == 1:
            a, b = _number_pair(rng)
            sentences.append(f"{a} is {'at most' if a <= b else 'over'} {b}.")
        elif kind == 2:
            sentences.append(_extremes(rng))
        else:
            ra, rb = rng.sample(dd.RISKS, 2)
            sentences.append(f"{ra} risk is {'lower' if dd.RISKS.index(ra) < dd.RISKS.index(rb) else 'higher'} "
                             f"than {rb} risk.")
    return " ".join(sentences)


def _notation_doc(rng: random.Random, question_share: float) -> str:
    """Lines in the notation of written analyses (<=, <, =, >, ->, ;), over numbers, risk levels and plain words."""
    words = ("plan", "build", "test", "ship", "review", "keep", "take", "drop", "start", "stop", "low", "medium",
             "high")
    lines = []
    for _ in range(rng.randint(3, 8)):
        kind = rng.randrange(4)
        if kind == 0:
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            lines.append(f"{rng.choice(('cost', 'days', 'quality', 'size', 'price'))} {a}{'<=' if a <= b else '>'}{b}")
        elif kind == 1:
            ra, rb = rng.choice(dd.RISKS), rng.choice(dd.RISKS)
            lines.append(f"risk {ra}{'<=' if dd.RISKS.index(ra) <= dd.RISKS.index(rb) else '>'}{rb}")
        elif kind == 2:
            pairs = []
            for _ in range(rng.randint(1, 4)):
                if rng.random() < 0.7:
                    a, b = rng.randint(1, 99), rng.randint(1, 99)
                    rank_a, rank_b = a, b
                else:
                    a, b = rng.choice(dd.RISKS), rng.choice(dd.RISKS)
                    rank_a, rank_b = dd.RISKS.index(a), dd.RISKS.index(b)
                sign = "<" if rank_a < rank_b else ">" if rank_a > rank_b else "="
                pairs.append(f"{_option_name(rng, question_share)} {a}{sign}{b}")
            lines.append("; ".join(pairs))
        else:
            lines.append(" -> ".join(rng.sample(words, rng.randint(2, 4))))
    return "\n".join(lines)


_GLOSSARY = (
    ("decision", "the option that is chosen"), ("rationale", "the reason for a choice"),
    ("feasible", "meets every constraint"), ("options", "the choices on the table"),
    ("risks", "what could go wrong"), ("none", "no option at all"), ("cheapest", "lowest cost"),
    ("fastest", "shortest time"), ("safest", "lowest risk"), ("best quality", "highest quality"),
    ("kept", "still in the running"), ("dropped", "not kept after a check"), ("fails", "does not meet a constraint"),
)
_PHRASES = ("risk low", "risk medium", "risk high", "cheapest feasible", "fastest feasible", "safest feasible",
            "best quality feasible", "every option fails a constraint", "no option meets all constraints")


def _json_doc(rng: random.Random, question_share: float) -> str:
    """A JSON record: a scenario as data, a glossary entry, or facts about a scenario (never a decision object)."""
    kind = rng.randrange(3)
    if kind == 0:
        return json.dumps(_doc_scenario(rng, question_share).to_dict())
    if kind == 1:
        term, meaning = rng.choice(_GLOSSARY)
        entry = {"term": term, "meaning": meaning}
        if rng.random() < 0.5:
            entry["examples"] = rng.sample(_PHRASES, rng.randint(0, 3))
        return json.dumps(entry)
    s = _doc_scenario(rng, question_share)
    return json.dumps({
        "feasible": [o.name for o in s.options if dd.feasible(s, o)],
        rng.choice(("cheapest", "fastest", "safest")): rng.choice(s.options).name,
        "notes": [f"risk {o.risk}" for o in rng.sample(s.options, rng.randint(1, len(s.options)))],
    })


def _chat_doc(rng: random.Random, question_share: float) -> list[dict[str, str]]:
    """A conversation about a scenario, so the role tokens are known to the base (answers are prose)."""
    s = _doc_scenario(rng, question_share)
    o = rng.choice(s.options)
    question, answer = rng.choice([
        (f"Does option {o.name} meet the constraints?", _checks(s, o)),
        ("Which option is the cheapest?", f"{min(s.options, key=lambda x: x.cost).name} is the cheapest."),
        ("Which option is the fastest?", f"{min(s.options, key=lambda x: x.days).name} is the fastest."),
        ("Which option should be chosen, and why?", _walkthrough(s, rng)),
    ])
    return [{"role": "system", "content": rng.choice(_GENERIC_SYSTEMS)},
            {"role": "user", "content": f"{dd.render_prompt(s)} {question}"},
            {"role": "assistant", "content": answer}]


def pretraining_corpus(n_docs: int, seed: int,
                       question_share: float = 0.0) -> tuple[list[str], list[list[dict[str, str]]]]:
    """(plain documents, chat conversations) of generic domain text; no Kev or Laya answer format in either."""
    rng = random.Random(f"{seed}/pretrain")
    texts: list[str] = []
    chats: list[list[dict[str, str]]] = []
    for _ in range(n_docs):
        roll = rng.random()
        if roll < 0.5:
            texts.append(_scenario_doc(rng, question_share))
        elif roll < 0.65:
            texts.append(_number_doc(rng))
        elif roll < 0.75:
            texts.append(_notation_doc(rng, question_share))
        elif roll < 0.85:
            texts.append(_json_doc(rng, question_share))
        else:
            chats.append(_chat_doc(rng, question_share))
    return texts, chats


# -- tokenizer and base -----------------------------------------------------------------------------------------


def train_tokenizer(corpus: Iterator[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on the domain text, with model_factory's special tokens and chat template.

    Every byte stays in the alphabet, so any text still encodes; frequent words and the 2-digit numbers the
    scenarios are made of become single tokens."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(corpus, trainer)
    return chat_tokenizer(backend)


def base_config(spec: DemoSpec, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        intermediate_size=spec.intermediate_size, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _prepare_out(out: Path, keep: bool = False) -> None:
    """Start from an empty output (`keep`: from the earlier build's outputs); refuse to touch anything else."""
    if out.exists():
        other = sorted(p.name for p in out.iterdir() if p.name not in OUTPUTS)
        if other:
            raise ValueError(f"{out} holds files that are not a demo build ({', '.join(other[:5])}); "
                             "choose another --out")
        # A resumed build keeps its trained stages, not the finished build's record: that describes stages
        # which may be trained again.
        for name in ("BUILD.json", MANIFEST_NAME) if keep else OUTPUTS:
            path = out / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    out.mkdir(parents=True, exist_ok=True)


@dataclass
class _Stages:
    """Runs the build's stages, logging and keeping how long each took. The trained stages (`run_kept`) are
    recorded in `progress` as they finish, so a build cut short can resume after the last of them."""

    progress: Path
    settings: dict[str, Any]  # what the base is made of: a resumed build must have the same
    seconds: dict[str, float] = field(default_factory=dict)
    finished: dict[str, dict[str, Any]] = field(default_factory=dict)
    resumed: list[str] = field(default_factory=list)

    def resume(self) -> None:
        """Take the stages an earlier build with the same settings finished (none when it left no record)."""
        if not self.progress.exists():
            log.info("no earlier build to resume in %s: building everything", self.progress.parent)
            return
        earlier = json.loads(self.progress.read_text(encoding="utf-8"))
        if earlier["settings"] != _plain(self.settings):
            raise ValueError(f"the build in {self.progress.parent} was made with other settings (seed, device, "
                             "data, base or question share): build it again without --resume, or choose "
                             "another --out")
        self.finished = earlier["finished"]

    def run(self, name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        log.info("stage %s ...", name)
        result = fn(*args, **kwargs)
        self.seconds[name] = round(time.perf_counter() - started, 2)
        log.info("stage %s done in %.1fs", name, self.seconds[name])
        return result

    def kept(self, name: str, output: Path, plan: Any = None) -> bool:
        """Whether stage `name` finished in the resumed build, with the same `plan`, and still verifies."""
        finished = self.finished.get(name)
        if finished is None:
            return False
        earlier, now = finished.get("plan") or {}, _plain(plan) or {}
        if earlier != now:
            changed = {key: f"{earlier.get(key)} -> {now.get(key)}" for key in sorted(earlier.keys() | now.keys())
                       if earlier.get(key) != now.get(key)}
            log.info("stage %s: trained again, its plan changed (%s)", name, changed)
            return False
        return verify_manifest(output) == []

    def run_kept(self, name: str, output: Path, fn: Callable[..., Any], *args: Any, plan: Any = None) -> dict[str, Any]:
        """A trained stage writing `output` (with its manifest): its report as a dict, taken from the resumed build
        where `kept` with the same `plan` (what the stage alone is made of: an adapter's epochs), else run and
        recorded."""
        if self.kept(name, output, plan):
            log.info("stage %s: kept from the earlier build (%s verifies)", name, output)
            self.seconds[name] = self.finished[name]["seconds"]
            self.resumed.append(name)
            return self.finished[name]["report"]
        if output.exists():  # what an earlier build left there no longer verifies, or came from another base
            shutil.rmtree(output)
        report = asdict(self.run(name, fn, *args))
        self.finished[name] = {"seconds": self.seconds[name], "report": report, "plan": _plain(plan)}
        self._save()
        return report

    def forget(self) -> None:
        """Keep nothing of the earlier build (its base is trained again, so its adapters do not fit it)."""
        self.finished.clear()
        self._save()

    def _save(self) -> None:
        record = {"settings": self.settings, "finished": self.finished}
        self.progress.write_text(json.dumps(record, indent=1, default=str) + "\n", encoding="utf-8")


def _plain(value: Any) -> Any:
    """`value` as it reads back from JSON (tuples as lists, paths as strings), to compare with a recorded one."""
    return json.loads(json.dumps(value, default=str))


def _tokenizer_for(spec: DemoSpec, texts: list[str], chats: list[list[dict[str, str]]]) -> PreTrainedTokenizerFast:
    """Trained on the base's own text only, so each merged token is one the base reads during pretraining."""
    def corpus() -> Iterator[str]:
        yield from texts
        for chat in chats:
            yield from (m["content"] for m in chat)

    return train_tokenizer(corpus(), spec.vocab_size)


def token_coverage(tokenizer: PreTrainedTokenizerFast, documents: list[str], paths: dict[str, Path]) -> dict[str, Any]:
    """How much of what the adapters must write uses tokens the base never read (ideally nothing)."""
    seen: set[int] = set()
    for start in range(0, len(documents), 4096):
        for ids in tokenizer(documents[start:start + 4096], add_special_tokens=False)["input_ids"]:
            seen.update(ids)
    needed: dict[int, int] = {}
    for adapter in ADAPTERS:
        completions = [s.completion for s in read_samples(paths[f"{adapter}/train"])]
        for ids in tokenizer(completions, add_special_tokens=False)["input_ids"]:
            for token in ids:
                needed[token] = needed.get(token, 0) + 1
    unseen = {token: n for token, n in needed.items() if token not in seen}
    if unseen:
        log.warning("the adapters must write %d token type(s) the base never read: %s", len(unseen),
                    tokenizer.convert_ids_to_tokens(sorted(unseen, key=unseen.get, reverse=True)[:20]))
    return {"completion_token_types": len(needed), "unseen_token_types": len(unseen),
            "unseen_share": sum(unseen.values()) / max(1, sum(needed.values()))}


def _documents(tokenizer: PreTrainedTokenizerFast, texts: list[str], chats: list[list[dict[str, str]]],
               seed: int) -> list[str]:
    """The pretraining documents: plain texts and chats rendered with the chat template, shuffled."""
    documents = texts + list(tokenizer.apply_chat_template(chats, tokenize=False) if chats else [])
    random.Random(f"{seed}/mix").shuffle(documents)
    return documents


def _build_base(spec: DemoSpec, tokenizer: PreTrainedTokenizerFast, documents: list[str], base_dir: Path,
                device: str, seed: int, progress: bool) -> Any:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(base_config(spec, tokenizer), dtype=torch.float32)
    pretrain = PretrainConfig(**{**asdict(spec.pretrain), "seed": seed, "device": device, "progress": progress})
    report = pretrain_base(model, tokenizer, documents, pretrain)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model.to("cpu").save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    write_manifest(base_dir)
    return report


def score_test_split(out: Path, paths: dict[str, Path], limit: int, device: str) -> dict[str, Any]:
    """Test-split scores on the unquantized base (as the CPU serves it): each adapter, and the base alone."""
    tokenizer = AutoTokenizer.from_pretrained(out / "base")
    base = load_causal_lm(out / "base", dtype=torch.float32).to(device)
    model = PeftModel.from_pretrained(base, out / "kev", adapter_name="kev")
    model.load_adapter(out / "laya", adapter_name="laya")
    scores: dict[str, Any] = {}
    for adapter in ADAPTERS:
        samples = read_samples(paths[f"{adapter}/test"])[:limit]
        system_prompt = preset(adapter)["system_prompt"]
        max_new = max(len(ids) for ids in tokenizer([s.completion for s in samples],
                                                    add_special_tokens=False)["input_ids"]) + 8
        model.set_adapter(adapter)
        scores[adapter] = score_decisions(model, tokenizer, samples, system_prompt, max_new_tokens=max_new,
                                          batch_size=256)
        with model.disable_adapter():
            scores[f"base_with_{adapter}_prompt"] = score_decisions(
                model, tokenizer, samples, system_prompt, max_new_tokens=max_new, batch_size=256)
        log.info("test %s: %s; base alone: %s", adapter, scores[adapter], scores[f"base_with_{adapter}_prompt"])
    return scores


def calibrate_adapters(out: Path, device: str) -> dict[str, Any]:
    """Fit each adapter's confidence calibration on the validation scenarios, answered as the worker serves them
    (the NF4 base on CUDA), and write it beside the adapter (shared/calibration.py)."""
    from modellab.evaluation import fit_adapter_calibrations, load_scenarios

    settings = Settings(_env_file=None, model={"base": str(out / "base"), "device": device},
                        kev={"path": str(out / "kev")}, laya={"path": str(out / "laya")})
    loaded, scenarios = load_model(settings), load_scenarios(out / VAL_SCENARIOS)
    calibrations: dict[str, Any] = {}
    for adapter in ADAPTERS:
        try:
            [(fitted, report)] = fit_adapter_calibrations(loaded, settings, scenarios, (adapter,), batch_size=64,
                                                          progress=False).values()
        except ValueError as exc:  # an adapter that decides nothing (a quick build's) has nothing to fit on
            log.warning("%s left uncalibrated: %s", adapter, exc)
            calibrations[adapter] = {"skipped": str(exc)}
            continue
        write_calibration(out / adapter, fitted, {"fitted_on": VAL_SCENARIOS, **report})
        log.info("calibrated %s: confidence %s; ECE %.4f -> %.4f", adapter, fitted.describe(), report["ece_before"],
                 report["ece_after"])
        calibrations[adapter] = fitted.to_dict() | report
    return calibrations


def build_demo(out: Path, *, data_dir: Path, device: str = "auto", quick: bool = False, seed: int = 0,
               progress: bool = True, command: str | None = None,
               question_share: float | None = None, train_examples: int | None = None,
               epochs: dict[str, float] | None = None, resume: bool = False) -> dict[str, Any]:
    """Build base/, kev/ and laya/ (each with a manifest), the test scenarios and BUILD.json in `out`.

    The generated train/val/test data goes to `data_dir`. `question_share`, `train_examples` and `epochs` (per
    adapter) replace the spec's. `resume`: keep the base and adapters an earlier build of the same settings
    finished in `out`; an adapter whose plan changed (its epochs) is trained again, any other change is refused
    (the other stages are cheap and run again, the same for the same seed). Returns BUILD.json's content."""
    out, data_dir = Path(out), Path(data_dir)
    spec = QUICK if quick else FULL
    if unknown := set(epochs or {}) - set(ADAPTERS):
        raise ValueError(f"epochs for unknown adapter(s) {', '.join(sorted(unknown))}: the adapters are "
                         f"{', '.join(ADAPTERS)}")
    spec = replace(spec, question_share=spec.question_share if question_share is None else question_share,
                   n_train=train_examples or spec.n_train,
                   adapters={name: replace(plan, epochs=(epochs or {}).get(name, plan.epochs))
                             for name, plan in spec.adapters.items()})
    device = resolve_device(device)
    started = time.perf_counter()
    # What the base and the data are made of; each adapter's own plan is compared when its stage runs.
    made_of = {key: value for key, value in asdict(spec).items() if key != "adapters"}
    stages = _Stages(out / PROGRESS, {"seed": seed, "quick": quick, "device": device, "spec": made_of})
    if resume:  # refused before anything in `out` is touched
        stages.resume()
    _prepare_out(out, keep=resume)

    paths = stages.run("data", dd.write_dataset, data_dir, spec.n_train, spec.n_val, spec.n_test, seed,
                       question_share=spec.question_share)
    shutil.copyfile(paths["test_scenarios"], out / SCENARIOS)
    shutil.copyfile(paths["val_scenarios"], out / VAL_SCENARIOS)
    texts, chats = stages.run("corpus", pretraining_corpus, spec.pretrain_docs, seed, spec.question_share)
    base_dir = out / "base"
    if stages.kept("base", base_dir):  # the adapters were trained on this base's tokens
        tokenizer = stages.run("tokenizer", AutoTokenizer.from_pretrained, base_dir)
    else:
        stages.forget()
        tokenizer = stages.run("tokenizer", _tokenizer_for, spec, texts, chats)
    documents = stages.run("documents", _documents, tokenizer, texts, chats, seed)
    coverage = stages.run("coverage", token_coverage, tokenizer, documents[:20_000], paths)  # every type is frequent
    pretrain_report = stages.run_kept("base", base_dir, _build_base, spec, tokenizer, documents, base_dir, device,
                                      seed, progress)

    reports = {}
    for index, adapter in enumerate(ADAPTERS, start=1):
        plan = spec.adapters[adapter]
        defaults = preset(adapter)
        defaults["lr"] *= plan.lr_scale
        config = TrainConfig(
            **defaults, base_model=base_dir, data_file=paths[f"{adapter}/train"], output_dir=out / adapter,
            adapter=adapter, target_modules=plan.target_modules, epochs=plan.epochs, max_steps=plan.max_steps,
            batch_size=plan.batch_size, max_seq_tokens=plan.max_seq_tokens, seed=seed + index, device=device,
            eval_file=paths[f"{adapter}/val"], eval_samples=spec.eval_samples, eval_batch_size=256, progress=progress,
            log_every=100, checkpoint_every=100,
        )
        reports[adapter] = stages.run_kept(f"adapter {adapter}", out / adapter, train_adapter, config,
                                           plan=asdict(plan))
    test = stages.run("test", score_test_split, out, paths, spec.test_samples, device)
    calibrations = stages.run("calibrate", calibrate_adapters, out, device)

    build = {
        "command": command,
        "seed": seed, "quick": quick, "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "spec": asdict(spec),
        "parameters": {"base": sum(p.numel() for p in load_causal_lm(base_dir).parameters())},
        "bytes": {name: _dir_bytes(out / name) for name in ("base", "kev", "laya")},
        "stage_seconds": stages.seconds, "total_seconds": round(time.perf_counter() - started, 2),
        "resumed": stages.resumed,  # stages kept from an earlier, cut build (their seconds are that build's)
        "token_coverage": coverage,
        "pretrain": pretrain_report,
        "adapters": reports,
        "test": test,
        "calibration": calibrations,
        "versions": {"torch": torch.__version__},
    }
    (out / "BUILD.json").write_text(json.dumps(build, indent=2) + "\n", encoding="utf-8")
    write_manifest(out)
    return build

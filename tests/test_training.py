"""Training on the CPU with tiny models: the loss falls, NaN rollback, input validation, overlong filtering,
class balancing, serving-identical formatting, manifests, the `train` command and the quick demo build."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from modellab.model_factory import build_random_model
from modellab.training import (
    IGNORE_INDEX,
    OUTPUT_FILES,
    DataError,
    Encoded,
    PretrainConfig,
    TrainConfig,
    TrainingDiverged,
    balance_by_label,
    chat_messages,
    encode_samples,
    pretrain_base,
    read_samples,
    train_adapter,
)
from modellab.training.data import example_batches
from modellab.training.loop import completion_loss
from shared.base_match import base_mismatch
from shared.manifest import MANIFEST_NAME, verify_manifest

SYSTEM = "You are Laya."
RECORDS = [  # few and short, so a tiny model memorises them in a few dozen steps
    {"prompt": "Pick A or B.", "completion": '{"decision": "A"}', "label": "A"},
    {"prompt": "Cheapest of A, B?", "completion": '{"decision": "B"}', "label": "B"},
    {"prompt": "Fastest one?", "completion": '{"decision": "A"}', "label": "A"},
    {"prompt": "None fits.", "completion": '{"decision": "none"}', "label": "none"},
]


@pytest.fixture(scope="module")
def random_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_model(tmp_path_factory.mktemp("training-model"), "tiny", seed=0, adapters={})["base"]


@pytest.fixture(scope="module")
def base(random_base: Path) -> Path:
    """The tiny model after a little pretraining: a random one's output layer is too weak for LoRA to move."""
    tokenizer = AutoTokenizer.from_pretrained(random_base)
    model = AutoModelForCausalLM.from_pretrained(random_base)
    texts = ['Pick one of A, B or none. {"answer": "A"} {"choice": "B"} The decision is none.',
             'Options: A, B. {"decision": "maybe"}'] * 16
    pretrain_base(model, tokenizer, texts, PretrainConfig(seq_len=64, batch_size=8, lr=1e-2, max_steps=60,
                                                          warmup_steps=5, device="cpu", progress=False))
    path = random_base.parent / "pretrained"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def config(base: Path, tmp_path: Path, records: list[dict] = RECORDS, **overrides: object) -> TrainConfig:
    settings = dict(base_model=base, data_file=write_jsonl(tmp_path / "data.jsonl", records),
                    output_dir=tmp_path / "adapter", adapter="laya", system_prompt=SYSTEM, r=8, alpha=16,
                    dropout=0.0, lr=1e-2, max_steps=40, batch_size=4, warmup_steps=2, progress=False)
    return TrainConfig(**{**settings, **overrides})


def test_loss_falls_on_a_memorisable_set(base: Path, tmp_path: Path) -> None:
    report = train_adapter(config(base, tmp_path))
    assert report.steps == 40 and report.rollbacks == 0
    assert report.last_loss < 0.5 * report.first_loss, (report.first_loss, report.last_loss)
    assert report.tokens > 0 and report.tokens_per_second > 0


def test_same_seed_same_adapter(base: Path, tmp_path: Path) -> None:
    first = train_adapter(config(base, tmp_path / "one", max_steps=5))
    second = train_adapter(config(base, tmp_path / "two", max_steps=5))
    assert first.last_loss == second.last_loss
    a = load_file(tmp_path / "one" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "two" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_injected_nan_rolls_back_halves_the_rate_and_finishes(base: Path, tmp_path: Path) -> None:
    cfg = config(base, tmp_path, max_steps=8, checkpoint_every=2, inject_nan_at_step=3)
    report = train_adapter(cfg)
    assert report.rollbacks == 1 and report.steps == 8
    record = json.loads((cfg.output_dir / "training.json").read_text())
    assert record["rollbacks"] == [{"step": 3, "restored_step": 2, "lr_scale": 0.5}]
    assert len(record["losses"]) == 7  # the failed step applied no update
    weights = load_file(cfg.output_dir / "adapter_model.safetensors")
    assert weights and all(torch.isfinite(w).all() for w in weights.values())


def test_too_many_rollbacks_give_up_and_write_nothing(base: Path, tmp_path: Path) -> None:
    cfg = config(base, tmp_path, max_steps=4, inject_nan_at_step=2, max_rollbacks=0)
    with pytest.raises(TrainingDiverged, match="after 0 rollbacks"):
        train_adapter(cfg)
    assert not cfg.output_dir.exists()


def test_pretraining_loss_falls_and_survives_a_nan(random_base: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(random_base)
    model = AutoModelForCausalLM.from_pretrained(random_base)
    texts = ["Option A costs 40, within the budget of 50."] * 64
    report = pretrain_base(model, tokenizer, texts, PretrainConfig(
        seq_len=32, batch_size=8, lr=1e-2, max_steps=30, warmup_steps=2, checkpoint_every=5,
        inject_nan_at_step=12, device="cpu", progress=False))
    assert report.rollbacks == 1 and report.steps == 30
    assert report.last_loss < 0.5 * report.first_loss
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_bad_lines_are_listed_with_their_numbers_and_nothing_is_written(base: Path, tmp_path: Path) -> None:
    good = json.dumps(RECORDS[0]).encode()
    lines = [
        good,                                              # 1 fine
        b"",                                               # 2 empty
        b'{"prompt": "x", "completion": ',                 # 3 invalid JSON
        json.dumps({"prompt": "x"}).encode(),              # 4 missing completion
        b'{"prompt": "caf\xe9", "completion": "y"}',       # 5 Latin-1 byte, not UTF-8
        json.dumps({"prompt": 3, "completion": "y"}).encode(),  # 6 wrong type
        json.dumps({"prompt": " ", "completion": "y", "label": 1}).encode(),  # 7 empty prompt, label not a string
        json.dumps(["a list"]).encode(),                   # 8 not an object
    ]
    cfg = config(base, tmp_path)
    data = cfg.data_file
    data.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(DataError) as caught:
        train_adapter(cfg)
    problems = caught.value.problems
    expected = {
        2: "empty line", 3: "invalid JSON", 4: 'field "completion" is missing', 5: "not valid UTF-8",
        6: 'field "prompt" must be a string', 8: "expected a JSON object",
    }
    for number, text in expected.items():
        assert any(p.startswith(f"{data}:{number}: ") and text in p for p in problems), (number, problems)
    assert any(p.startswith(f"{data}:7: ") and 'field "prompt" is empty' in p for p in problems)
    assert any(p.startswith(f"{data}:7: ") and 'field "label" must be a string' in p for p in problems)
    assert not any(p.startswith(f"{data}:1:") for p in problems)
    assert not cfg.output_dir.exists()


def test_samples_are_formatted_exactly_as_served(base: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(base)
    samples = read_samples(write_jsonl(Path(base).parent / "fmt.jsonl", RECORDS[:1]))
    [encoded] = encode_samples(tokenizer, samples, SYSTEM)
    served = tokenizer.apply_chat_template(chat_messages(SYSTEM, RECORDS[0]["prompt"]), add_generation_prompt=True,
                                           tokenize=True, return_dict=True, sanitize_control_tokens=True)["input_ids"]
    completion = tokenizer(RECORDS[0]["completion"], add_special_tokens=False)["input_ids"]
    assert encoded.input_ids == [*served, *completion, tokenizer.eos_token_id]
    assert encoded.labels == [IGNORE_INDEX] * len(served) + [*completion, tokenizer.eos_token_id]


def test_overlong_samples_are_filtered_and_counted(base: Path, tmp_path: Path) -> None:
    long = {"prompt": "Pick one. " * 20, "completion": '{"decision": "A"}', "label": "A"}
    tokenizer = AutoTokenizer.from_pretrained(base)
    lengths = [len(e.input_ids) for e in encode_samples(tokenizer, read_samples(
        write_jsonl(tmp_path / "probe.jsonl", [*RECORDS, long])), SYSTEM)]
    limit = max(lengths[:-1])
    assert lengths[-1] > limit
    report = train_adapter(config(base, tmp_path, [*RECORDS, long, long], max_seq_tokens=limit, max_steps=2))
    assert report.filtered == 2
    assert sum(report.labels_before.values()) == len(RECORDS)


def test_completion_loss_is_the_models_own_loss_with_and_without_an_adapter(base: Path) -> None:
    from peft import LoraConfig, get_peft_model

    tokenizer = AutoTokenizer.from_pretrained(base)
    encoded = encode_samples(tokenizer, read_samples(write_jsonl(Path(base).parent / "loss.jsonl", RECORDS)), SYSTEM)
    batch = next(example_batches(encoded, len(encoded), tokenizer.pad_token_id, torch.Generator().manual_seed(0)))
    model = AutoModelForCausalLM.from_pretrained(base)
    torch.testing.assert_close(completion_loss(model, batch), model(**batch).loss)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    expected = peft_model(**batch).loss
    torch.testing.assert_close(completion_loss(peft_model, batch), expected)
    completion_loss(peft_model, batch).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in peft_model.parameters() if p.requires_grad)


def test_batches_hold_every_example_once_an_epoch_among_similar_lengths() -> None:
    lengths = [(i * 37) % 300 + 1 for i in range(640)]  # shuffled lengths 1..300
    examples = [Encoded([i] * n, [i] * n, None) for i, n in enumerate(lengths)]
    batches = example_batches(examples, 8, 0, torch.Generator().manual_seed(0))
    epoch = [next(batches) for _ in range(80)]
    firsts = sorted(int(b["input_ids"][row, 0]) for b in epoch for row in range(len(b["input_ids"])))
    assert firsts == list(range(640))
    padded = sum(b["input_ids"].numel() for b in epoch)
    assert padded < 1.15 * sum(lengths)  # random batches of 8 pad to about 1.7x here
    widths = [b["input_ids"].shape[1] for b in epoch]
    assert widths != sorted(widths) and widths != sorted(widths, reverse=True)


def test_balancing_oversamples_minorities_deterministically() -> None:
    examples = [Encoded([i], [i], label) for i, label in enumerate("AAAAABBC")]
    balanced, before, after = balance_by_label(examples, seed=3)
    assert before == {"A": 5, "B": 2, "C": 1} and after == {"A": 5, "B": 5, "C": 5}
    assert [e.label for e in balanced].count("B") == 5 and len(balanced) == 15
    b_repeats = sorted(sum(e is original for e in balanced) for original in examples if original.label == "B")
    assert b_repeats == [2, 3]  # whole copies first, then the remainder without replacement
    assert balanced == balance_by_label(examples, seed=3)[0]


def test_unlabelled_data_is_not_balanced() -> None:
    examples = [Encoded([i], [i], None) for i in range(3)]
    balanced, before, after = balance_by_label(examples, seed=0)
    assert balanced == examples and before == after == {"": 3}


def test_output_has_only_adapter_files_and_a_manifest_that_verifies(base: Path, tmp_path: Path) -> None:
    cfg = config(base, tmp_path, max_steps=3)
    report = train_adapter(cfg)
    assert {p.name for p in cfg.output_dir.iterdir()} == OUTPUT_FILES
    assert verify_manifest(cfg.output_dir) == []
    assert base_mismatch(cfg.output_dir, base) is None  # it records the base it was trained on
    record = json.loads((cfg.output_dir / "training.json").read_text())
    assert record["config"]["adapter"] == "laya" and record["report"]["steps"] == report.steps == 3
    assert record["report"]["labels_after"] == {"A": 2, "B": 2, "none": 2}
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), cfg.output_dir, adapter_name="laya")
    assert "laya" in model.peft_config


def test_output_dir_with_other_files_is_refused(base: Path, tmp_path: Path) -> None:
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds other files"):
        train_adapter(config(base, tmp_path, max_steps=1))


def kevlaya(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})


def test_train_command_reports_bad_lines_and_exits_2(base: Path, tmp_path: Path) -> None:
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps(RECORDS[0]) + "\n\nnot json\n", encoding="utf-8")
    result = kevlaya("train", str(data), "--adapter", "laya", "--base", str(base), "--out", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr
    assert f"{data}:2: empty line" in result.stderr and f"{data}:3: invalid JSON" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_train_command_trains_and_prints_the_report(base: Path, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", RECORDS)
    result = kevlaya("train", str(data), "--adapter", "kev", "--base", str(base), "--out", str(tmp_path / "out"),
                     "--max-steps", "2", "--batch-size", "2", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert "steps 2 on cpu" in result.stdout and "rollbacks 0" in result.stdout
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["r"] == 16  # kev's preset
    assert verify_manifest(tmp_path / "out") == []


def test_train_command_writes_half_precision_weights_and_can_leave_the_labels_as_they_are(base: Path,
                                                                                       tmp_path: Path) -> None:
    from safetensors import safe_open

    data = write_jsonl(tmp_path / "data.jsonl", RECORDS[:2] + RECORDS[:1])  # A twice, B once
    result = kevlaya("train", str(data), "--adapter", "laya", "--base", str(base), "--out", str(tmp_path / "out"),
                     "--max-steps", "2", "--batch-size", "2", "--device", "cpu", "--save-dtype", "float16",
                     "--no-balance")
    assert result.returncode == 0, result.stderr
    with safe_open(tmp_path / "out" / "adapter_model.safetensors", "pt") as weights:
        assert {str(weights.get_tensor(k).dtype) for k in weights.keys()} == {"torch.float16"}
    record = json.loads((tmp_path / "out" / "training.json").read_text())
    assert record["report"]["samples"] == 3 and record["report"]["labels_after"] == {}
    assert verify_manifest(tmp_path / "out") == []
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "out")
    assert model(torch.tensor([[1, 2, 3]])).logits.isfinite().all()
    bad = kevlaya("train", str(data), "--adapter", "laya", "--base", str(base), "--out", str(tmp_path / "x"),
                  "--save-dtype", "int8")
    assert bad.returncode == 2 and "--save-dtype must be float32 or float16" in bad.stderr


def test_quick_demo_build_loads_and_verifies(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    result = kevlaya("models", "build-demo", "--quick", "--out", str(out), "--data-dir", str(tmp_path / "data"),
                     "--device", "cpu", timeout=300)  # 26 s alone; the whole suite runs beside it
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("base", "kev", "laya"):
        assert verify_manifest(out / name) == [], name
    assert (out / MANIFEST_NAME).exists() and verify_manifest(out) == []
    build = json.loads((out / "BUILD.json").read_text())
    assert build["quick"] and build["seed"] == 0 and build["token_coverage"]["unseen_token_types"] == 0
    stages = {"data", "tokenizer", "base", "adapter kev", "adapter laya", "test", "calibrate"}
    assert stages <= build["stage_seconds"].keys()
    # each adapter fitted, or skipped with the reason (a quick model rarely decides anything)
    assert build["calibration"].keys() == {"kev", "laya"}
    assert len((out / "val_scenarios.jsonl").read_text().splitlines()) == build["spec"]["n_val"]
    assert (tmp_path / "data" / "laya" / "test.jsonl").exists()
    assert len((out / "test_scenarios.jsonl").read_text().splitlines()) == build["spec"]["n_test"]

    tokenizer = AutoTokenizer.from_pretrained(out / "base")
    base_model = AutoModelForCausalLM.from_pretrained(out / "base")
    model = PeftModel.from_pretrained(base_model, out / "kev", adapter_name="kev")
    model.load_adapter(out / "laya", adapter_name="laya")
    model.set_adapter("laya")
    encoded = tokenizer.apply_chat_template(chat_messages(SYSTEM, "Options: A cost 10."), add_generation_prompt=True,
                                            return_dict=True, return_tensors="pt")
    output = model.generate(**encoded, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert output.shape[1] > encoded["input_ids"].shape[1]


def test_named_options_are_balanced_by_their_place_with_the_letters() -> None:
    from modellab.training.data import balance_class

    question = "Which laptop? ThinkPad: 48 dollars. XPS: 34 dollars. Options: ThinkPad, XPS."
    scenario = "Options: A cost 10 risk low days 3 quality 4; B cost 20 risk low days 2 quality 5. Objective: x."
    assert balance_class(question, "XPS") == balance_class(scenario, "B") == "B"
    assert balance_class(question, "ThinkPad") == balance_class(scenario, "A") == "A"
    assert balance_class(question, "none") == "none"
    assert balance_class("no options line here", "XPS") == "XPS"
    assert balance_class(question, None) is None


def test_a_cut_demo_build_resumes_after_its_last_trained_stage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build cut in Laya's training keeps its base and Kev: `--resume` trains Laya alone and the result verifies;
    a resume with other settings is refused before anything is built."""
    from modellab import demo_model

    out, data = tmp_path / "demo", tmp_path / "data"
    real_train, trained = demo_model.train_adapter, []

    def cut_in_laya(config):  # noqa: ANN001, ANN202
        if config.adapter == "laya":
            raise KeyboardInterrupt  # as a call's time limit would
        return real_train(config)

    monkeypatch.setattr(demo_model, "train_adapter", cut_in_laya)
    with pytest.raises(KeyboardInterrupt):
        demo_model.build_demo(out, data_dir=data, device="cpu", quick=True, progress=False)
    kev_weights = (out / "kev" / "adapter_model.safetensors").read_bytes()

    def counted(config):  # noqa: ANN001, ANN202
        trained.append(config.adapter)
        return real_train(config)

    monkeypatch.setattr(demo_model, "train_adapter", counted)
    monkeypatch.setattr(demo_model, "_build_base", lambda *a: pytest.fail("the finished base was trained again"))
    with pytest.raises(ValueError, match="other settings"):
        demo_model.build_demo(out, data_dir=data, device="cpu", quick=True, progress=False, seed=1, resume=True)
    build = demo_model.build_demo(out, data_dir=data, device="cpu", quick=True, progress=False, resume=True)
    assert trained == ["laya"]
    assert build["resumed"] == ["base", "adapter kev"] and build["adapters"].keys() == {"kev", "laya"}
    assert build["pretrain"]["steps"] > 0 and "seconds" in build["adapters"]["kev"]
    assert verify_manifest(out) == [] and verify_manifest(out / "laya") == []
    assert (out / "kev" / "adapter_model.safetensors").read_bytes() == kev_weights and verify_manifest(out / "kev") == []


def test_a_finished_demo_build_resumes_after_one_of_its_adapters_changed(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished build whose Laya no longer verifies: `--resume` keeps the base and Kev, trains Laya again and
    ends with a build that verifies, calibrated (the finished build's manifest described the old Laya, and a
    calibration refuses to vouch for a directory that does not match its manifest)."""
    from modellab import demo_model, evaluation
    from shared.calibration import Calibration, read_calibration

    def fitted(loaded, settings, scenarios, adapters, **kwargs):  # noqa: ANN001, ANN003, ANN202
        # a quick build's adapters decide nothing, so there is nothing to fit: a fixed exponent stands in
        return {adapter: (Calibration(exponent=0.5), {"ece_before": 0.1, "ece_after": 0.05}) for adapter in adapters}

    monkeypatch.setattr(evaluation, "fit_adapter_calibrations", fitted)
    out, data = tmp_path / "demo", tmp_path / "data"
    demo_model.build_demo(out, data_dir=data, device="cpu", quick=True, progress=False)
    with (out / "laya" / "adapter_model.safetensors").open("ab") as weights:
        weights.write(b"\0")  # as a copy cut short would leave it
    build = demo_model.build_demo(out, data_dir=data, device="cpu", quick=True, progress=False, resume=True)
    assert build["resumed"] == ["base", "adapter kev"]
    assert verify_manifest(out) == [] and verify_manifest(out / "laya") == []
    assert read_calibration(out / "laya").exponent == 0.5


def test_a_resumed_demo_build_trains_again_only_the_adapter_whose_epochs_changed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sweeping one adapter's epochs keeps the base and the other adapter; a change to what the base is made of
    is still refused, and epochs for an adapter the build does not have are refused before anything is built."""
    from modellab import demo_model

    out, data = tmp_path / "demo", tmp_path / "data"
    first = demo_model.build_demo(out, data_dir=data, device="cpu", quick=True, progress=False)
    kev_weights = (out / "kev" / "adapter_model.safetensors").read_bytes()
    real_train, trained = demo_model.train_adapter, []

    def counted(config):  # noqa: ANN001, ANN202
        trained.append((config.adapter, config.epochs))
        return real_train(config)

    monkeypatch.setattr(demo_model, "train_adapter", counted)
    monkeypatch.setattr(demo_model, "_build_base", lambda *a: pytest.fail("the finished base was trained again"))
    laya_epochs = first["spec"]["adapters"]["laya"]["epochs"] + 1
    build = demo_model.build_demo(out, data_dir=data, device="cpu", quick=True, progress=False, resume=True,
                                  epochs={"laya": laya_epochs})
    assert trained == [("laya", laya_epochs)] and build["resumed"] == ["base", "adapter kev"]
    assert build["spec"]["adapters"]["laya"]["epochs"] == laya_epochs
    assert build["spec"]["adapters"]["kev"] == first["spec"]["adapters"]["kev"]
    assert (out / "kev" / "adapter_model.safetensors").read_bytes() == kev_weights and verify_manifest(out) == []
    with pytest.raises(ValueError, match="other settings"):
        demo_model.build_demo(out, data_dir=data, device="cpu", quick=True, progress=False, resume=True,
                              train_examples=first["spec"]["n_train"] + 1)
    assert verify_manifest(out) == [] and (out / "BUILD.json").is_file()  # the refusal left the build whole
    with pytest.raises(ValueError, match="unknown adapter"):
        demo_model.build_demo(tmp_path / "other", data_dir=data, device="cpu", quick=True, progress=False,
                              epochs={"kevin": 1.0})
    assert not (tmp_path / "other").exists()


def test_build_demo_help_gives_the_builds_own_defaults() -> None:
    from typer.testing import CliRunner

    from cli.main import app
    from modellab.demo_model import FULL

    shown = CliRunner().invoke(app, ["models", "build-demo", "--help"], env={"COLUMNS": "240"}).output
    assert f"({FULL.n_train:,})" in shown and f"({FULL.question_share})" in shown
    assert f"({FULL.adapters['kev'].epochs})" in shown and f"({FULL.adapters['laya'].epochs})" in shown

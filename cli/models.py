"""Model-lab commands (`modellab/`): `models random`, `models build-demo`, `models questions`, `models data`,
`models prose-data`, `models calibrate`, `models prepare`, `models verify`, `train`, `eval` and `eval-tools`; and the
service's adapters: `models list`, `models load`, `models unload`."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from cli.common import fail, require_database
from modellab.presets import LORA_PRESETS
from shared.settings import ADAPTERS, get_settings

if TYPE_CHECKING:
    from modellab.decision_data import Scenario

app = typer.Typer(help="Model directories.", no_args_is_help=True)


def _presets(field: str) -> str:
    """`kev 16, laya 8`: one preset field per role, for the help of `train`."""
    values = {name: getattr(p, field) for name, p in LORA_PRESETS.items()}
    return ", ".join(f"{name} {value:.0e}".replace("e-0", "e-") if isinstance(value, float) else f"{name} {value}"
                     for name, value in values.items())


@contextmanager
def _batch_within_budget(batch_size: int, budget_gb: float) -> Iterator[None]:
    """A --batch-size whose rows do not fit the VRAM budget is a bad argument: one line naming it, not a CUDA
    traceback."""
    from worker.memory import is_out_of_memory

    try:
        yield
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        fail(f"--batch-size {batch_size}: its rows ran out of GPU memory within the {budget_gb:g} GiB budget "
             "(KEVLAYA_ENGINE__VRAM_BUDGET_GB); use a smaller --batch-size")


def _subset(text: str, allowed: tuple[str, ...], option: str) -> tuple[str, ...]:
    """A comma-separated option's values, in order and once each; a one-line error for anything else."""
    chosen = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    if not chosen or any(v not in allowed for v in chosen):
        fail(f"{option} takes a comma-separated subset of {', '.join(allowed)}")
    return chosen


def _scenarios(path: Path, limit: int | None) -> list[tuple[str, Scenario]]:
    """The scenarios a command runs, read before any model is loaded; a one-line error for a missing or bad file."""
    from modellab.evaluation import load_scenarios

    if not path.exists():
        fail(f"no scenarios at {path}: write them with `kevlaya models data` (or `models build-demo`) or pass "
             "--scenarios")
    try:
        return load_scenarios(path, limit)
    except ValueError as exc:
        fail(str(exc))


@app.command("random")
def models_random(
    out: Annotated[Path, typer.Argument(help="directory to write base/, kev/ and laya/ into")],
    shape: Annotated[str, typer.Option(help="tiny, slow-load, qwen2.5-1.5b, qwen2.5-3b or llama-2-7b")] = "tiny",
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Build a random-weight base model of a real shape plus Kev/Laya LoRA adapters (tests, benchmarks)."""
    from modellab.model_factory import SHAPES, build_random_model

    if shape not in SHAPES:
        fail(f"--shape must be one of {', '.join(SHAPES)}")
    paths = build_random_model(out, shape, seed=seed)
    for name, path in paths.items():
        typer.echo(f"{name}: {path}")


@app.command("build-demo")
def models_build_demo(
    out: Annotated[Path, typer.Option(help="directory to write base/, kev/, laya/ and BUILD.json into")] = Path(
        "models/demo"),
    data_dir: Annotated[Path, typer.Option(help="where the generated train/val/test data is written")] = Path(
        "build/demo-data"),
    device: Annotated[str, typer.Option(help="auto, cpu or cuda (CUDA: adapters trained on an NF4 base)")] = "auto",
    quick: Annotated[bool, typer.Option(help="a tiny model, a few steps each (tests); not the shipped one")] = False,
    seed: Annotated[int, typer.Option(help="the one seed every stage derives its randomness from")] = 0,
    question_share: Annotated[Optional[float], typer.Option(
        min=0.0, max=1.0, help="share of the training prompts asked as questions in plain words (none of the "
        "held-out questions); default: the build's own (0.25)")] = None,
    train_examples: Annotated[Optional[int], typer.Option(
        min=1, help="training prompts generated for the adapters; default: the build's own (60,000)")] = None,
    kev_epochs: Annotated[Optional[float], typer.Option(
        min=0.01, help="epochs of Kev's training; default: the build's own (2.2)")] = None,
    laya_epochs: Annotated[Optional[float], typer.Option(
        min=0.01, help="epochs of Laya's training; default: the build's own (4.6)")] = None,
    resume: Annotated[bool, typer.Option(
        help="keep the base and adapters a cut build with the same settings finished in --out, and build the "
             "rest; an adapter whose epochs changed is trained again")] = False,
) -> None:
    """Build the demo model reproducibly: data, BPE tokenizer, pretrained base, Kev and Laya adapters, manifests."""
    import logging
    import shlex

    from modellab.demo_model import build_demo

    if device not in ("auto", "cpu", "cuda"):
        fail("--device must be auto, cpu or cuda")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    command = shlex.join(["kevlaya", *sys.argv[1:]])
    try:
        build = build_demo(out, data_dir=data_dir, device=device, quick=quick, seed=seed, command=command,
                           question_share=question_share, train_examples=train_examples,
                           epochs={name: value for name, value in (("kev", kev_epochs), ("laya", laya_epochs))
                                   if value is not None}, resume=resume)
    except ValueError as exc:
        fail(str(exc))
    for name, seconds in build["stage_seconds"].items():
        typer.echo(f"{name:<12} {seconds:8.1f}s")
    typer.echo(f"{'total':<12} {build['total_seconds']:8.1f}s")
    typer.echo(f"base {build['parameters']['base'] / 1e6:.2f}M parameters; sizes (bytes): {build['bytes']}")
    typer.echo(f"pretrain {build['pretrain']['tokens_per_second']:,.0f} tokens/s; adapters "
               + ", ".join(f"{k} {v['tokens_per_second']:,.0f} tokens/s" for k, v in build["adapters"].items()))
    for name, score in build["test"].items():
        typer.echo(f"test {name:<22} valid JSON {score['valid_rate']:6.1%}  accuracy {score['accuracy']:6.1%}")
    typer.echo(f"written to {out}")


@app.command("questions")
def models_questions(
    out: Annotated[Path, typer.Option(help="JSONL to write (the held-out scenarios' format)")] = Path(
        "models/eval/test_questions.jsonl"),
    count: Annotated[int, typer.Option(min=1, max=1_000, help="questions to write (training never draws the "
                                                        "first 1,000 of a seed)")] = 200,
    seed: Annotated[int, typer.Option(help="the seed they are drawn from")] = 0,
) -> None:
    """Write decision questions asked in plain words with 2-4 named options (not the adapters' training format),
    for `kevlaya eval --scenarios`."""
    from modellab.decision_data import write_questions

    write_questions(out, count, seed)
    typer.echo(f"written {count} questions to {out}")


@app.command("prose-data")
def models_prose_data(
    out: Annotated[Path, typer.Option(help="directory for kev/train.jsonl, laya/train.jsonl, val_scenarios.jsonl, "
                                           "test_questions.jsonl and test_tool_questions.jsonl")],
    train: Annotated[int, typer.Option(min=1, help="plain-words training questions (training domains)")] = 6000,
    templated: Annotated[int, typer.Option(min=0, help="templated scenarios mixed in")] = 2000,
    val: Annotated[int, typer.Option(min=1, help="validation questions (for `kevlaya models calibrate`)")] = 400,
    test: Annotated[int, typer.Option(min=1, help="held-out questions: unseen domains and phrasings")] = 400,
    tool_calls: Annotated[int, typer.Option(
        min=0, help="tool-use requests shuffled into each role's train.jsonl: 2-5 function tools offered, the "
        "answer the calls the request asks for in the wire format the grammar enforces (or, where no tool fits, a "
        "plain sentence); 0: none, the decision data alone")] = 4000,
    tool_test: Annotated[int, typer.Option(
        min=0, help="held-out tool requests written to test_tool_questions.jsonl (tool domains and phrasings "
        "training never sees), for `kevlaya eval-tools`; 0: none")] = 400,
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Write the roles' training data for a real base: decision questions in plain words (named options, figures in
    any order and unit, objectives and limits said many ways) mixed with templated scenarios and tool-use requests,
    and the held-out questions and tool requests of domains and phrasings training never sees
    (modellab/prose_questions.py, modellab/tool_questions.py)."""
    from modellab.prose_questions import write_dataset
    from modellab.tool_questions import add_to_training, write_tool_questions

    paths = write_dataset(out, n_train=train, n_templated=templated, n_val=val, n_test=test, seed=seed)
    add_to_training(out, tool_calls, seed)  # the decision data is the same with tools or without
    if tool_test:
        paths["test_tool_questions"] = write_tool_questions(out / "test_tool_questions.jsonl", tool_test, seed)
    for name, path in paths.items():
        typer.echo(f"{name}: {path}")
    if tool_calls:
        typer.echo(f"tool requests: {tool_calls} in each train.jsonl")


@app.command("data")
def models_data(
    out: Annotated[Path, typer.Option(help="directory to write the data into")] = Path("build/demo-data"),
    train: Annotated[int, typer.Option(min=0, help="training prompts per adapter")] = 40_000,
    val: Annotated[int, typer.Option(min=1, help="validation scenarios")] = 1_000,
    test: Annotated[int, typer.Option(min=1, help="held-out test scenarios")] = 1_000,
    seed: Annotated[int, typer.Option(help="the seed every split is drawn from")] = 0,
    question_share: Annotated[float, typer.Option(
        min=0.0, max=1.0, help="share of the train and val prompts asked as questions in plain words")] = 0.0,
) -> None:
    """Write the decision data the demo build draws (the same for the same counts and seed):
    <adapter>/{train,val,test}.jsonl for `kevlaya train`, val_scenarios.jsonl for `kevlaya models calibrate` and
    test_scenarios.jsonl for `kevlaya eval`. The test and validation splits do not depend on --train."""
    from modellab.decision_data import write_dataset

    paths = write_dataset(out, n_train=train, n_val=val, n_test=test, seed=seed, question_share=question_share)
    for name, path in paths.items():
        typer.echo(f"{name:<16} {path}")


@app.command("calibrate")
def models_calibrate(
    scenarios: Annotated[Path, typer.Option(help="validation scenarios (never the held-out test split, which would "
                                                 "then grade its own fit)")] = Path("models/smollm2/val_scenarios.jsonl"),
    adapters: Annotated[str, typer.Option(help="comma-separated: laya, kev")] = "laya,kev",
    batch_size: Annotated[int, typer.Option(min=1, help="jobs per forward pass")] = 32,
    limit: Annotated[Optional[int], typer.Option(min=1, help="use only the first N scenarios")] = None,
    write: Annotated[bool, typer.Option(help="write each adapter's calibration.json (and its manifests); "
                                             "--no-write: only report the fit")] = True,
) -> None:
    """Fit each adapter's confidence calibration on its answers to validation scenarios and write it beside the
    adapter: a job's confidence is then sigmoid(exponent * ln p + linear * p + intercept) of its decision's
    probability p, fitted so that answers reported at 0.9 are right about 90 % of the time. Decisions do not
    change. Validation questions from domains the roles were never trained on fit the confidence they will have
    on people's questions.

    Uses the configured base model and adapters (KEVLAYA_MODEL__BASE, KEVLAYA_KEV__PATH, KEVLAYA_LAYA__PATH)."""
    import logging
    import shlex

    from modellab.evaluation import fit_adapter_calibrations
    from shared.calibration import CalibrationError, write_calibration
    from worker.model.loading import load_model

    chosen = _subset(adapters, ADAPTERS, "--adapters")
    items = _scenarios(scenarios, limit)
    logging.basicConfig(level=logging.WARNING)
    settings = get_settings()
    loaded = load_model(settings)
    if refused := {a: loaded.refusal(a) for a in chosen if loaded.refusal(a)}:
        fail("; ".join(refused.values()))
    try:
        with _batch_within_budget(batch_size, settings.engine.vram_budget_gb):
            fits = fit_adapter_calibrations(loaded, settings, items, chosen, batch_size)
    except ValueError as exc:
        fail(str(exc))
    command = shlex.join(["kevlaya", *sys.argv[1:]])
    for adapter, (fitted, report) in fits.items():
        typer.echo(f"{adapter}: confidence {fitted.describe()} over {report['answers']} answers (accuracy "
                   f"{report['accuracy']:.1%}); ECE {report['ece_before']:.4f} -> {report['ece_after']:.4f}, "
                   f"log-loss {report['log_loss_before']:.4f} -> {report['log_loss_after']:.4f}")
        if write:
            path = settings.adapter_profile(adapter).path
            try:
                written = write_calibration(Path(path), fitted, {"fitted_on": str(scenarios), "command": command,
                                                                 **report})
            except CalibrationError as exc:
                fail(str(exc))
            typer.echo(f"  written {written}")


@app.command("prepare")
def models_prepare() -> None:
    """Make the configured base servable: a GGUF base is read once into its cache (KEVLAYA_MODEL__CACHE_DIR).
    `kevlaya run` does this before it starts the worker and the API; the worker does it too when it is needed."""
    import logging

    from shared.base_source import BaseSourceError
    from worker.model.loading import prepare_base

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        typer.echo(f"base: {prepare_base(get_settings())}")
    except BaseSourceError as exc:
        fail(str(exc))


@app.command("list")
def models_list() -> None:
    """The adapters: each role's configured directory and the version it holds (the SHA-256 of its config and
    weights), and every version a worker loaded (`adapter_versions`) with when and how many jobs it answered."""
    from sqlalchemy import func, select

    from shared.adapter_identity import describe_adapter
    from shared.db import session_scope
    from shared.models import AdapterAssignment, AdapterVersion, Job

    settings = get_settings()
    require_database()
    with session_scope() as session:
        versions = session.scalars(select(AdapterVersion).order_by(AdapterVersion.name,
                                                                   AdapterVersion.loaded_at.desc())).all()
        answered = dict(session.execute(select(Job.adapter_version, func.count())
                                        .where(Job.adapter_version.is_not(None)).group_by(Job.adapter_version)).all())
        assigned = {row.role: row for row in session.scalars(select(AdapterAssignment))}
    for name in [*ADAPTERS, *sorted(set(assigned) - set(ADAPTERS))]:
        configured = None
        if name in ADAPTERS:
            path = settings.adapter_profile(name).path
            try:
                configured = describe_adapter(name, Path(path), settings.model.base).sha256
            except (OSError, ValueError) as exc:
                typer.echo(f"{name}: {path} unreadable: {exc}")
            else:
                typer.echo(f"{name}: {path} version {configured[:16]}")
        else:  # a role loaded at run time under a new name: its adapter is the load's
            row = assigned[name]
            typer.echo(f"{name}: {row.path} version {(row.sha256 or '?')[:16]}, loaded at run time"
                       f"{' (unloaded)' if row.unloaded else ''}")
        loaded = [v for v in versions if v.name == name]
        for i, version in enumerate(loaded):
            marks = [m for m, on in (("loaded last", i == 0), ("configured", version.sha256 == configured)) if on]
            typer.echo(f"  {version.sha256[:16]}  rank {version.rank}  loaded {version.loaded_at:%Y-%m-%d %H:%M:%S} "
                       f"(first {version.first_loaded_at:%Y-%m-%d %H:%M:%S})  {answered.get(version.sha256, 0)} "
                       f"job(s) answered{'  ' + ', '.join(marks) if marks else ''}")
        if not loaded:
            typer.echo("  no worker has loaded it yet")


def _wake(role: str) -> None:
    from shared.queue import QueueUnavailable, publish_wakeup

    try:
        publish_wakeup(None, role)
    except QueueUnavailable:
        typer.echo("Redis did not answer: workers follow the change at their next sweep", err=True)


@app.command("load")
def models_load(
    name: Annotated[str, typer.Argument(help="the role: kev or laya (their adapter replaced), or a new name (a "
                                        "role of its own, KEVLAYA_MODEL__SPARE_ROLES at once)")],
    path: Annotated[Path, typer.Argument(help="the adapter's directory (adapter_config.json, "
                                         "adapter_model.safetensors, MANIFEST.sha256), under "
                                         "KEVLAYA_MODEL__ADAPTER_ROOT")],
) -> None:
    """Load the adapter at PATH as role NAME while the service runs, replacing the role's adapter in place (a
    reload when it serves one already), as POST /v1/load_lora_adapter does.

    The adapter is checked first, with the API's own checks, and nothing is recorded if it is refused: its path
    must lie under KEVLAYA_MODEL__ADAPTER_ROOT, its files be there and verify, its base be the running one, its
    rank at most KEVLAYA_MODEL__ADAPTER_MAX_RANK, its target modules those the worker holds and its weights
    finite. Then it becomes the role's desired state in the database and every worker switches at a safe point:
    jobs claimed before finish on the old version, jobs claimed after run on the new one and record its version.
    `kevlaya models list` shows the version once a worker loaded it.

    Through the database rather than the API: like `kevlaya keys` and `kevlaya quotas`, it needs only the
    settings a deployment already has (the database URL; no admin key, no running API), and the checks and the
    record are the same shared code the API runs (shared/adapter_check.py, shared/adapter_assignments.py)."""
    from shared.adapter_assignments import assign
    from shared.adapter_check import AdapterRefused, check_adapter
    from shared.db import write_scope

    settings = get_settings()
    require_database()
    try:
        checked = check_adapter(name, str(path), settings)
    except AdapterRefused as refusal:
        fail(f"refused, nothing recorded: {refusal}")
    try:
        with write_scope() as session:
            assign(session, checked, settings.model.spare_roles)
    except AdapterRefused as refusal:
        fail(f"refused, nothing recorded: {refusal}")
    _wake(checked.role)
    typer.echo(f"{checked.role}: {checked.path} version {checked.sha256[:16]} asked for; workers switch once its "
               "rows in flight finish")


@app.command("unload")
def models_unload(
    name: Annotated[str, typer.Argument(help="the role: kev, laya, or one loaded under a new name")],
) -> None:
    """Stop role NAME taking jobs while the service runs, as POST /v1/unload_lora_adapter does: submits to it are
    refused (503 adapter_unloaded), its queued jobs wait until it is loaded again (`kevlaya models load`), its rows in
    flight finish, and /v1/models no longer lists it. Through the database, as `models load` (see there why)."""
    from shared.adapter_assignments import unload
    from shared.adapter_check import AdapterRefused, check_role
    from shared.db import write_scope

    require_database()
    try:
        role = check_role(name)
    except AdapterRefused as refusal:
        fail(f"refused: {refusal}")
    with write_scope() as session:
        changed = unload(session, role)
    if not changed:
        fail(f"{role} is not loaded: unloaded already, or never loaded")
    _wake(role)
    typer.echo(f"{role}: unloaded; its queued jobs wait until it is loaded again")


@app.command("verify")
def models_verify() -> None:
    """Check the SHA-256 manifests of the configured base model and adapters."""
    from shared.base_source import BaseSourceError, base_directory
    from shared.manifest import verify_manifest

    settings = get_settings()
    try:
        base = base_directory(settings.model.base, settings.model.cache_dir)
    except BaseSourceError as exc:
        fail(str(exc))
    bad = False
    for name, path in (("base", base), ("kev", settings.kev.path), ("laya", settings.laya.path)):
        problems = verify_manifest(Path(path))
        bad |= bool(problems)
        typer.echo(f"{name} ({path}): " + ("ok" if not problems else "; ".join(problems)))
    if bad:
        raise typer.Exit(1)


def train(
    data: Annotated[Path, typer.Argument(help='JSONL file of {"prompt", "completion", "label"?} records')],
    adapter: Annotated[str, typer.Option(help="kev or laya: picks the preset (r, alpha, lr, system prompt)")],
    base: Annotated[Path, typer.Option(help="base model: a directory (Hugging Face format, with its tokenizer) or a "
                                       ".gguf file (read once into KEVLAYA_MODEL__CACHE_DIR)")],
    out: Annotated[Path, typer.Option(help="directory to write the adapter, training.json and the manifest into")],
    r: Annotated[Optional[int], typer.Option(help=f"LoRA rank (preset: {_presets('r')})")] = None,
    alpha: Annotated[Optional[int], typer.Option(help=f"LoRA alpha (preset: {_presets('alpha')})")] = None,
    lr: Annotated[Optional[float], typer.Option(help=f"peak learning rate (preset: {_presets('lr')})")] = None,
    targets: Annotated[str, typer.Option(help="comma-separated module names to adapt")] = "q_proj,v_proj",
    epochs: Annotated[float, typer.Option(help="passes over the (resampled) data")] = 1.0,
    max_steps: Annotated[Optional[int], typer.Option(help="optimizer steps; overrides --epochs")] = None,
    batch_size: Annotated[int, typer.Option(help="samples per micro-batch")] = 16,
    grad_accum: Annotated[int, typer.Option(help="micro-batches per optimizer step")] = 1,
    max_seq_tokens: Annotated[int, typer.Option(help="longer samples (prompt + completion) are left out")] = 512,
    eval_file: Annotated[Optional[Path], typer.Option(help="labelled JSONL to score decisions on afterwards")] = None,
    system_prompt: Annotated[Optional[str], typer.Option(help="(default: the adapter's serving system prompt)")] = None,
    seed: Annotated[int, typer.Option()] = 0,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda (CUDA: QLoRA on an NF4 base)")] = "auto",
    quantization: Annotated[str, typer.Option(help="on CUDA: auto or nf4 trains on an NF4 base (QLoRA), none on the "
                                                   "full-precision base")] = "auto",
    save_dtype: Annotated[str, typer.Option(help="the adapter's weights as written: float32 or float16 (half the "
                                                 "size)")] = "float32",
    balance: Annotated[bool, typer.Option(help="oversample every label up to the most frequent one's count; "
                                               "--no-balance trains on the data as it is")] = True,
) -> None:
    """Train a Kev or Laya LoRA adapter on a base model (QLoRA on CUDA, full-precision base on the CPU)."""
    import logging

    from modellab.presets import preset
    from modellab.training import DataError, TrainConfig, TrainingDiverged, train_adapter

    if adapter not in ADAPTERS:
        fail("--adapter must be kev or laya")
    if quantization not in ("auto", "nf4", "none"):
        fail("--quantization must be auto, nf4 or none")
    if save_dtype not in ("float32", "float16"):
        fail("--save-dtype must be float32 or float16")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    defaults = preset(adapter)
    if base.is_file() and base.suffix.lower() == ".gguf":
        from shared.base_source import BaseSourceError
        from worker.model.gguf_cache import build_gguf_cache

        try:
            base = build_gguf_cache(base, get_settings().model.cache_dir)
        except BaseSourceError as exc:
            fail(str(exc))
    try:
        config = TrainConfig(
            base_model=base, data_file=data, output_dir=out, adapter=adapter,
            system_prompt=defaults["system_prompt"] if system_prompt is None else system_prompt,
            r=defaults["r"] if r is None else r, alpha=defaults["alpha"] if alpha is None else alpha,
            lr=defaults["lr"] if lr is None else lr,
            target_modules=tuple(t.strip() for t in targets.split(",") if t.strip()), epochs=epochs,
            max_steps=max_steps, batch_size=batch_size, grad_accum=grad_accum, max_seq_tokens=max_seq_tokens,
            eval_file=eval_file, seed=seed, device=device, quantization=quantization, save_dtype=save_dtype,
            balance_labels=balance,
        )
        report = train_adapter(config)
    except DataError as exc:  # every problem with its line number, no traceback: the file is at fault
        typer.secho(f"error: {exc.path} cannot be used for training; nothing was trained", fg=typer.colors.RED,
                    err=True)
        typer.echo(str(exc), err=True)
        raise typer.Exit(2)
    except (ValueError, OSError, TrainingDiverged) as exc:
        fail(str(exc))
    typer.echo(report.summary())
    typer.echo(f"adapter written to {out}")


def evaluate(
    scenarios: Annotated[Path, typer.Option(help="held-out scenarios or questions (JSONL): the default model's "
                                              "plain-words questions; the demo's are models/demo/test_scenarios.jsonl")] = Path(
        "models/smollm2/test_questions.jsonl"),
    out: Annotated[Path, typer.Option(help="directory for results.json and results.png")] = Path("models/eval"),
    modes: Annotated[str, typer.Option(help="comma-separated: base, laya, kev, auto")] = "base,laya,kev,auto",
    limit: Annotated[Optional[int], typer.Option(min=1, help="evaluate only the first N scenarios")] = None,
    batch_size: Annotated[int, typer.Option(help="jobs per forward pass; 1 = each job served alone")] = 1,
    grammar: Annotated[bool, typer.Option(
        help="generate decisions under the decision grammar, as the worker does; --no-grammar: as the model writes "
             "them, free")] = True,
    compare_precision: Annotated[bool, typer.Option(
        help="also run Laya and Kev with the other base precision (NF4 vs fp16 on CUDA, fp32 vs NF4 on the CPU) "
             "and report how often they reach the same decision")] = False,
) -> None:
    """Decision accuracy, valid-JSON rate, calibration and latency per mode on the held-out split, through the
    worker's slot decoder.

    Uses the configured base model and adapters (KEVLAYA_MODEL__BASE, KEVLAYA_KEV__PATH, KEVLAYA_LAYA__PATH)."""
    import json
    import logging
    import shlex

    from modellab.evaluation import MODES, agreement, plot, run_evaluation, table
    from worker.model.loading import base_parameters, load_model, prepare_base, uses_nf4

    chosen = _subset(modes, MODES, "--modes")
    if batch_size < 1:
        fail("--batch-size must be at least 1")
    items = _scenarios(scenarios, limit)
    logging.basicConfig(level=logging.WARNING)
    settings = get_settings()
    loaded = load_model(settings)
    with _batch_within_budget(batch_size, settings.engine.vram_budget_gb):
        report = run_evaluation(loaded, settings, items, chosen, batch_size, grammar)
    if compare_precision:
        nf4 = uses_nf4(loaded.device, settings.model.quantization, base_parameters(prepare_base(settings)))
        other = settings.updated(model={"quantization": "none" if nf4 else "nf4"})
        del loaded
        with _batch_within_budget(batch_size, settings.engine.vram_budget_gb):
            second = run_evaluation(load_model(other), other, items, ("laya", "kev"), batch_size, grammar)
        nf4_run, reference = (report, second) if nf4 else (second, report)
        report["precision_comparison"] = {
            "reference": "fp16" if second["device"] == "cuda" else "fp32",
            "nf4_modes": nf4_run["modes"],
            "reference_modes": {m: reference["modes"][m] for m in ("laya", "kev") if m in reference["modes"]},
            "agreement": {m: agreement(nf4_run["answers"][m], reference["answers"][m])
                          for m in ("laya", "kev") if m in report["answers"]},
        }
    report["command"] = shlex.join(["kevlaya", *sys.argv[1:]])
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out / "results.png")
    typer.echo(table(report))
    if comparison := report.get("precision_comparison"):
        for mode, value in comparison["agreement"].items():
            typer.echo(f"NF4 vs {comparison['reference']} on {report['device']}, {mode}: same decision {value:.1%}, "
                       f"accuracy {comparison['nf4_modes'][mode]['accuracy']:.1%} vs "
                       f"{comparison['reference_modes'][mode]['accuracy']:.1%}")
    typer.echo(f"written {out / 'results.json'} and {out / 'results.png'}")


def evaluate_tools(
    questions: Annotated[Path, typer.Option(help="held-out tool requests (JSONL): `kevlaya models prose-data --out DIR` "
                                                 "writes DIR/test_tool_questions.jsonl")],
    out: Annotated[Path, typer.Option(help="directory for results.json")] = Path("models/eval/tools"),
    roles: Annotated[str, typer.Option(help="comma-separated: laya, kev (`auto` with tools answers as Laya)")] = (
        "laya,kev"),
    limit: Annotated[Optional[int], typer.Option(min=1, help="evaluate only the first N requests")] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="jobs per forward pass; 1 = each job served alone")] = 1,
    max_new_tokens: Annotated[int, typer.Option(
        min=1, help="each job's max_new_tokens, as a client's max_tokens (two calls take under 160 tokens)")] = 256,
) -> None:
    """Which function each role calls, with what arguments, on held-out tool requests in plain words: each request
    run as the chat API stores it (tools in the system prompt, the tools' grammar, greedy) through the worker's slot
    decoder. Reports per role and tool_choice the right function, exact arguments, valid arguments (jsonschema) and
    "no call" where no offered tool fits.

    Uses the configured base model and adapters (KEVLAYA_MODEL__BASE, KEVLAYA_KEV__PATH, KEVLAYA_LAYA__PATH)."""
    import json
    import logging
    import shlex

    from modellab.tool_evaluation import ROLES, load_tool_items, run_tool_evaluation, table
    from worker.model.loading import load_model

    chosen = _subset(roles, ROLES, "--roles")
    if not questions.exists():
        fail(f"no tool questions at {questions}: write them with `kevlaya models prose-data --out DIR` "
             "(DIR/test_tool_questions.jsonl)")
    try:
        items = load_tool_items(questions, limit)
    except ValueError as exc:
        fail(str(exc))
    logging.basicConfig(level=logging.WARNING)
    settings = get_settings()
    loaded = load_model(settings)
    if refused := {r: loaded.refusal(r) for r in chosen if loaded.refusal(r)}:
        fail("; ".join(refused.values()))
    with _batch_within_budget(batch_size, settings.engine.vram_budget_gb):
        report = run_tool_evaluation(loaded, settings, items, chosen, batch_size, max_new_tokens)
    report["command"] = shlex.join(["kevlaya", *sys.argv[1:]])
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    typer.echo(table(report))
    typer.echo(f"written {out / 'results.json'}")

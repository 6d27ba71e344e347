"""The one settings object. Every value comes from a `KEVLAYA_*` variable or `.env`; defaults run locally.

The settings come in groups, one model each (`ApiSettings`, `EngineSettings`, …), read from
`KEVLAYA_<GROUP>__<NAME>` (`KEVLAYA_API__PORT` sets `settings.api.port`); the roles' profiles likewise
(`KEVLAYA_KEV__PATH`). The flat names of the release before the groups (`KEVLAYA_API_PORT`) still work, with a
warning naming the new one (`FLAT_NAMES`).

Each field's `description` is its documentation, and each group's docstring the note under its heading:
docs/configuration.md's tables are generated from them (`kevlaya dev settings-doc --write`;
`tests/test_settings_docs.py` checks they agree). Descriptions are Markdown, say what the setting does, and carry
no history or measurements."""

from __future__ import annotations

import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import (
    BaseSettings,
    DotEnvSettingsSource,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from shared.base_source import DEFAULT_BASE
from shared.schemas import ROLE_NAME_PATTERN, check_temperature  # noqa: F401 (re-exported)

Adapter = Literal["kev", "laya"]
ADAPTERS: tuple[Adapter, ...] = ("kev", "laya")

# The default: SmolLM2-135M-Instruct from its package (shared/base_source.py) with the roles trained on it. The demo
# model (a 4.4 M-parameter base the project builds) stays for tests and for programs that send its templated format.
DEFAULT_ADAPTERS_DIR = Path("models/smollm2")
DEMO_MODEL_DIR = Path("models/demo")


def _empty_is_unset(value: object) -> object:
    return None if value == "" else value


class AdapterProfile(BaseModel):
    """Per-role defaults: where the adapter lives and how it generates unless a job says otherwise."""

    path: str = Field(description="the role's PEFT LoRA adapter directory")
    max_new_tokens: int = Field(ge=1, description="the most new tokens a job generates, unless it sets its own "
                                "`max_new_tokens`; fewer where its prompt leaves less of the window")
    temperature: float = Field(ge=0, description="sampling temperature, unless the job sets its own: `0` (greedy) "
                               "or at least `0.01`")
    top_p: float = Field(default=1.0, gt=0, le=1, description="nucleus sampling's top-p, unless the job sets its "
                         "own; `1` samples from every token")
    system_prompt: str = Field(description="the system message put before a job's messages, unless the job brings "
                               "its own")
    reserved_slots: int = Field(
        default=0, ge=0, description="slots kept free for the role's jobs (at most a quarter of "
        "`KEVLAYA_ENGINE__MAX_BATCH`, on top of it when memory allows), so a job of the role starts at the next step "
        "while another role's backlog fills the rest")
    analysis: bool = Field(
        default=False, description="whether a decision answer may open with free-text analysis lines before its "
        "decision object (the object itself is always generated under the decision grammar)")

    # A default temperature must be runnable too: (0, 0.01) makes sampling overflow.
    _runnable_temperature = field_validator("temperature")(check_temperature)


# The roles' defaults. Their fields are described once, in `AdapterProfile`.
class KevProfile(AdapterProfile):
    path: str = str(DEFAULT_ADAPTERS_DIR / "kev")
    max_new_tokens: int = Field(default=512, ge=1)
    temperature: float = Field(default=0.0, ge=0)  # greedy: the answer that was evaluated, the same each time
    analysis: bool = True
    system_prompt: str = (
        "You are Kev, a deliberate analyst. Check every option against the constraints, "
        "eliminate, compare, then answer with one JSON decision object."
    )


class LayaProfile(AdapterProfile):
    path: str = str(DEFAULT_ADAPTERS_DIR / "laya")
    max_new_tokens: int = Field(default=128, ge=1)
    temperature: float = Field(default=0.0, ge=0)  # greedy, as Kev
    system_prompt: str = "You are Laya, a fast decider. Answer with one short JSON decision object only."
    reserved_slots: int = Field(default=4, ge=0)  # a fast decider starts at the next step, even under Kev load


class RoleProfile(AdapterProfile):
    """The defaults of every role loaded at run time under a new name (docs/architecture.md §10): its adapter is the
    one the load named; its jobs generate with these unless they set their own."""

    model_config = ConfigDict(title="Roles loaded at run time")

    # Kept for the profile's type, never set: refused rather than ignored (`_not_settable`)
    path: str = Field(default="", exclude=True)
    max_new_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=0.0, ge=0)
    system_prompt: str = ""  # the adapter was trained for its task: no system message unless the job brings one
    reserved_slots: int = Field(default=0, exclude=True)

    @field_validator("path", "reserved_slots")
    @classmethod
    def _not_settable(cls, value: object, info: ValidationInfo) -> object:
        if value and info.field_name == "path":
            raise ValueError("a role loaded at run time serves the adapter its load names (POST "
                             "/v1/load_lora_adapter, `kevlaya models load`): it has no configured path")
        if value:  # slots are reserved at a worker's start, before any role is loaded at run time
            raise ValueError("a role loaded at run time has no reserved slots")
        return value


class ApiSettings(BaseModel):
    """Where the API listens, its bootstrap key and its processes."""

    model_config = ConfigDict(title="API")

    host: str = Field(default="127.0.0.1", description="the address the API listens on")
    port: int = Field(default=8000, description="the port the API listens on")
    key: SecretStr | None = Field(
        default=None, description="the bootstrap admin key, at least 32 characters with at least 10 different ones "
        "(`kevlaya keys generate` makes one); the API refuses to start with a weaker one. It is a key like any "
        "other (`kevlaya keys revoke` revokes it) without a rate limit; a new value revokes the old one, at the "
        "API's start and at its first use, and so does unsetting it at the API's start. A value once revoked "
        "stays revoked")
    workers: int = Field(default=1, ge=1, description="API processes (uvicorn workers) on the one port; each "
                         "loads the tokenizer and keeps its own database connections")
    writer: Literal["process", "thread"] = Field(
        default="process", description="where each API process stores its submits: `process`, a child process with "
        "its own interpreter lock (faster under load); `thread`, a thread of the API process (one process less)")

    _empty_is_unset = field_validator("key", mode="before")(_empty_is_unset)


class FlowerSettings(BaseModel):
    """Flower, Celery's dashboard: where it listens and where it keeps its task history."""

    model_config = ConfigDict(title="Flower")

    host: str = Field(default="127.0.0.1", description="the address Flower listens on; beyond localhost it "
                      "needs `KEVLAYA_FLOWER__BASIC_AUTH`")
    port: int = Field(default=5555, description="the port Flower listens on")
    basic_auth: SecretStr | None = Field(
        default=None, description="`user:password` for Flower's basic auth; required when Flower listens beyond "
        "localhost")
    db: str | None = Field(default=None, description="Flower keeps its task history in this file "
                           "(`--persistent=True --db=…`), so it survives a restart of Flower; compose sets "
                           "`/data/flower.db` on a volume")

    _empty_is_unset = field_validator("basic_auth", "db", mode="before")(_empty_is_unset)


class RedisSettings(BaseModel):
    """The Redis every API process and worker shares."""

    model_config = ConfigDict(title="Redis")

    url: str = Field(default="redis://127.0.0.1:6379/0", description="Redis: the Celery broker, the workers' "
                     "heartbeats, finished-job notices and live job streams (run it with "
                     "`maxmemory-policy noeviction`). Beyond a loopback host it needs a password "
                     "(`redis://:password@host:6379/0`): the API and the worker refuse to start without one. "
                     "`kevlaya run` starts its own Redis with a generated password (kept in "
                     "`.kevlaya/redis_password`) when none answers at a loopback URL without one")
    allow_no_password: bool = Field(
        default=False, description="let the API and the worker use a Redis beyond a loopback host without a "
        "password (on a network where nobody else can reach it); whoever reaches such a Redis reads every "
        "job's live output and can write into it")


class ConnectionsSettings(BaseModel):
    """What one API process lets clients hold open (RELIABILITY.md, Security)."""

    model_config = ConfigDict(title="Connections")

    head_timeout_s: float = Field(
        default=10, gt=0, description="a connection is closed when its request line and headers have not all "
        "arrived this long after it opened, or after the end of its previous response (a 408 first, when part of a "
        "head came): idle sockets and heads trickled a line at a time hold nothing for longer")
    body_timeout_s: float = Field(
        default=10, gt=0, description="a request body is given this long from the end of its head; after it, the "
        "body must have come at `KEVLAYA_CONNECTIONS__BODY_MIN_BYTES_PER_S` on average, else the request gets 408 and "
        "its connection is closed (a body trickled a byte at a time holds nothing for longer; time in which the server "
        "itself does not read is not counted)")
    body_min_bytes_per_s: float = Field(
        default=1024, gt=0, description="the slowest average rate, in bytes a second, at which a request body keeps "
        "coming once `KEVLAYA_CONNECTIONS__BODY_TIMEOUT_S` has passed (an upload of 200 MiB may then take up to 57 "
        "hours; a reverse proxy's body timeout can be tighter)")
    idle_timeout_s: float = Field(
        default=5, gt=0, description="a kept-alive connection on which no new request starts within this is "
        "closed (uvicorn's keep-alive timeout; `KEVLAYA_CONNECTIONS__HEAD_TIMEOUT_S` still bounds the whole wait for a "
        "head)")
    max: int | None = Field(
        default=None, ge=1, description="open connections one API process holds at most; unset: its file-descriptor "
        "soft limit (`ulimit -n`) less the listen backlog and 256 descriptors for its own database, Redis and files, "
        "and never more than that. At the cap a new connection closes the one that has waited longest for a request "
        "head; with none waiting it is refused (503)")
    max_per_address: int | None = Field(
        default=None, ge=1, description="open connections one client address holds at most (its own connection "
        "waiting longest for a head is closed first); unset: half of the process's cap. Behind a reverse proxy every "
        "connection comes from the proxy's address")
    streams_per_key: int = Field(
        default=256, ge=1, description="event streams (`GET /v1/jobs/{id}/events`, streamed chat completions) one API "
        "key may hold open at once in one API process; one more gets 429 `too_many_streams`")
    long_polls_per_key: int = Field(
        default=256, ge=1, description="long-polls (`GET /v1/jobs/{id}/wait`, chat completions without `stream`) one "
        "API key may hold waiting at once in one API process; one more gets 429 `too_many_long_polls`")

    _empty_is_unset = field_validator("max", "max_per_address", mode="before")(_empty_is_unset)


class KeysSettings(BaseModel):
    """API keys' limits (RELIABILITY.md, Security)."""

    model_config = ConfigDict(title="Keys")

    default_rate_limit: int = Field(
        default=600, ge=0, description="the rate limit of a key made by `kevlaya keys create` without `--rate-limit`: "
        "jobs a minute in a moving window, counted per job (`POST /v1/jobs/batch` of 256 costs 256; Batch API "
        "lines are not counted); past it, 429 `rate_limited` with `Retry-After`. `0`: unlimited. Set when the key "
        "is made; the bootstrap key has none")
    auth_failures_per_address: int = Field(
        default=20, ge=1, description="failed authentications (a wrong or revoked key) one client address may make "
        "within `KEVLAYA_KEYS__AUTH_FAILURE_WINDOW_S`; past them it gets 429 `too_many_auth_failures` with "
        "`Retry-After`, whatever key it sends, until its oldest failure leaves the window. Counted in Redis across API "
        "processes (with Redis away, not counted). Behind a reverse proxy every request comes from the proxy's address "
        "unless it sends `X-Forwarded-For` from 127.0.0.1")
    auth_failure_window_s: int = Field(
        default=60, ge=1, description="the moving window, in seconds, in which "
        "`KEVLAYA_KEYS__AUTH_FAILURES_PER_ADDRESS` failures are counted")


class DatabaseSettings(BaseModel):
    """The job ledger's database and each process's connections to it."""

    model_config = ConfigDict(title="Database")

    url: str = Field(default="sqlite:///./kevlaya.db", description="SQLAlchemy URL; PostgreSQL: "
                     "`postgresql+psycopg://user:pw@host/db`")
    pool_size: int = Field(default=40, ge=1, description="database connections kept per process (the API runs "
                           "up to 40 requests at once in threads)")
    pool_timeout_s: float = Field(
        default=3, gt=0, description="how long a request or thread waits for a free database connection of its "
        "process when every one is in use (slow requests holding them all); then the API answers 503 "
        "`database_unavailable` with `Retry-After`, before a client's own timeout would cut it off")
    sqlite_synchronous: Literal["FULL", "NORMAL"] = Field(
        default="FULL", description="SQLite's durability: `FULL`, an accepted job survives power loss; `NORMAL` "
        "(WAL), it survives a crash of the process, not of the machine, and a commit saves an fsync")


class ModelSettings(BaseModel):
    """The base model the worker serves and how it is loaded."""

    model_config = ConfigDict(title="Model")

    base: str = Field(
        default=DEFAULT_BASE, description="the base model: a local Hugging Face directory, a "
        "`.gguf` file (read once into `KEVLAYA_MODEL__CACHE_DIR`), or `pkg:<package>/<file>` for a file inside an "
        "installed Python package")
    cache_dir: Path = Field(default=Path(".kevlaya/models"), description="where a GGUF base's dequantized "
                            "copy is kept, one directory per file digest")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="`auto`: `cuda` when available, "
                                                   "else `cpu`")
    quantization: Literal["auto", "nf4", "none"] = Field(
        default="auto",
        description="`auto`: on CUDA an NF4 base (double quant, fp16 compute) for a base of 1 B parameters or more "
        "and fp16 below that (NF4 costs a small model much of its accuracy), full precision on the CPU; `nf4` "
        "forces NF4 (on the CPU too, with a bitsandbytes that has a CPU backend); `none` forces full precision: "
        "fp16 on CUDA, fp32 on the CPU",
    )
    verify_manifests: bool = Field(default=True, description="refuse model directories whose `MANIFEST.sha256` "
                                   "does not match")
    adapter_root: Path = Field(
        default=Path("models"), description="the directory adapters loaded at run time must lie under "
        "(`POST /v1/load_lora_adapter`, `kevlaya models load`); a path that resolves outside it, through `..` or a "
        "symbolic link, is refused")
    adapter_max_rank: int = Field(
        default=0, ge=0, description="the largest LoRA rank an adapter loaded at run time may have: each role's "
        "rank block in the worker's per-row LoRA is sized at start to this or to its configured adapter's rank, "
        "whichever is larger, so any adapter up to it is copied in place; 0: the configured adapter's rank (a "
        "wider block costs every step of the role the work of its zero columns)")
    spare_roles: int = Field(
        default=1, ge=0, le=8, description="how many roles a worker can take at run time under new names (`POST "
        "/v1/load_lora_adapter` with a `lora_name` other than kev or laya): each is a rank block of the per-row LoRA "
        "sized as Kev's and Laya's, kept at start and costing every step its columns; an unloaded new role frees "
        "its block")
    adapter_poll_s: float = Field(
        default=1.0, gt=0, description="how often a worker that is serving jobs reads the adapters it should serve "
        "(an idle worker is woken by the load's wake-up message)")


class CascadeSettings(BaseModel):
    """How an `auto` job chooses between the roles."""

    model_config = ConfigDict(title="Cascade")

    threshold: float = Field(default=0.94, ge=0, le=1, description="an `auto` job escalates to Kev when "
                             "Laya's confidence is below this (with Laya's calibration: how likely its "
                             "answer is to be right)")


class EngineSettings(BaseModel):
    """The worker's decode loop (docs/architecture.md §4, §14)."""

    model_config = ConfigDict(title="Engine")

    max_batch: int = Field(default=16, ge=1, description="rows decoded at once, besides the reserved slots (fewer "
                           "when the VRAM budget holds fewer)")
    max_wait_ms: int = Field(
        default=2000, ge=0, description="fairness bound: an adapter whose oldest job has waited longer takes the "
        "next free slots first, and its claimed jobs are neither reordered nor paced")
    key_spare_slots: int = Field(
        default=1, ge=0, description="slots a worker keeps free for an API key that holds none, so its first job "
        "starts at the next step instead of waiting for another key's row to finish; a key holding none may always "
        "take one (docs/architecture.md §3)")
    window_tokens: int = Field(
        default=1024, ge=16, description="the most tokens (prompt + new) one job may hold; each slot reserves this "
        "much key/value cache, and the API refuses a longer job (422)")
    prefill_tokens: int = Field(
        default=2048, ge=1, description="prompt tokens prefilled between two decode steps at most, counted padded "
        "(jobs × longest prompt; one job always goes), so a burst of new jobs does not freeze the rows already "
        "decoding; the worker measures a prefill of this size at start when it sizes the slots")
    prefill_chunk_tokens: int = Field(
        default=2048, ge=16, description="the padded prompt tokens (jobs × columns) one forward pass of a prefill "
        "takes at most: a longer prompt block runs in chunks of columns, each attending to what the chunks before "
        "it cached, so a prefill's activation memory is bounded by the chunk rather than by the prompts; answers are "
        "the same, to rounding. Without CUDA graphs each pass is an eager forward pass, so the default (the prefill "
        "budget's) leaves a usual prefill whole; with them, prefills run as captured passes of 128 columns and this "
        "bounds their rows. Lower it where memory is short: a 7B model on a 6 GB card gets a fourth 1,024-token "
        "slot with 512 and `KEVLAYA_ENGINE__KV_DTYPE=fp8`")
    prefill_between_steps: bool = Field(
        default=True, description="while rows decode, a prefill of jobs of roles without reserved slots (Kev's, "
        "file-batch lines) runs one forward pass (one chunk, see KEVLAYA_ENGINE__PREFILL_CHUNK_TOKENS) between two "
        "decode steps instead of all at once, and a Laya job claimed meanwhile is prefilled before its next pass: "
        "rows decoding and Laya jobs wait for one pass, not the whole prefill. `false`: every prefill runs whole")
    batch_prefill_tokens: int = Field(
        default=128, ge=1, description="while interactive jobs come (one claimed in the last 10 s), the padded prompt "
        "tokens one prefill of file-batch lines takes at most (one line always goes); such a prefill never holds "
        "interactive jobs, so an interactive job that arrives while a batch drains waits for one short prefill at "
        "most. With no interactive job, batch lines prefill as KEVLAYA_ENGINE__PREFILL_TOKENS allows")
    cuda_graphs: bool = Field(
        default=True, description="on CUDA: capture the decode step as CUDA graphs (one per batch-size bucket) and "
        "replay them; ignored on the CPU")
    kv_dtype: Literal["auto", "fp8"] = Field(
        default="auto", description="how the key/value cache stores keys and values: `auto`, in the compute dtype "
        "(fp16 on CUDA, fp32 on the CPU); `fp8`, as `float8_e4m3fn`, one byte an element, so twice as many slots "
        "as with fp16 fit in what the VRAM budget leaves for the cache. Attention still runs in the compute dtype: "
        "each layer's cached keys and values are cast back up when read, at a small cost in accuracy (and, on the "
        "CPU, in speed)")
    workspace_gb: float = Field(
        default=0.5, ge=0, description="on CUDA: the first estimate of the memory kept free for activations beside "
        "the weights and the key/value cache, when the slots are sized: (budget − resident − workspace) / "
        "(key/value bytes per token × window), at most `KEVLAYA_ENGINE__MAX_BATCH` plus the reserved slots; the worker "
        "then measures the real workspace (graphs captured, the largest prefill run) and takes slots away until it fits "
        "the budget")
    prefill_share: float = Field(
        default=0.1, gt=0, le=1, description="while a row of a role with reserved slots (Laya) decodes, the "
        "prefills of other roles' jobs (Kev's) take at most this share of the time, so a wave of them stretches a "
        "Laya answer by at most 1 / (1 − share); their jobs wait in their slots meanwhile (a job held past "
        "`KEVLAYA_ENGINE__MAX_WAIT_MS` is not held back); `1` = no pacing")
    switch_interval_ms: float = Field(
        default=0.5, gt=0, le=100, description="the worker's thread switch interval (`sys.setswitchinterval`): how "
        "long the decode loop waits at most for the interpreter lock while the worker's other threads (the result "
        "writer, lease renewals) hold it; Python's default of 5 ms would let a busy writer stretch every lock "
        "hand-back of a decode step to 5 ms")
    vram_budget_gb: float = Field(
        default=5.5, gt=0, description="GiB PyTorch may allocate on the card being served (the default is what a "
        "6 GB card leaves after its CUDA context); on a bigger GPU the worker caps itself to it; "
        "the CPU path ignores it")
    ignore_eos: bool = Field(
        default=False, description="benchmarks only: every job generates exactly its `max_new_tokens` (end of "
        "sequence ignored), so serving schemes compared on random weights produce the same number of tokens")


class ReliabilitySettings(BaseModel):
    """Leases, retries and the worker's lifecycle (RELIABILITY.md)."""

    model_config = ConfigDict(title="Reliability")

    lease_seconds: float = Field(default=60, gt=0, description="a running job returns to the queue this long after "
                                 "its worker stops renewing its lease")
    max_attempts: int = Field(default=3, ge=1, description="a job whose worker dies this many times fails "
                              "(`internal`)")
    worker_recycle_after_tasks: int | None = Field(
        default=None, ge=1, description="restart the worker child (and reload the model) after this many tasks; "
        "unset: never")
    model_load_timeout_s: float = Field(
        default=600, gt=0, description="how long a new worker child may take to load the model before Celery kills "
        "it (`worker_proc_alive_timeout`; Celery's own default of 4 s kills every child of a slow-loading model)")
    job_time_limit_s: int = Field(default=900, ge=10, description="Celery's hard limit for one worker task (a drain "
                                  "of batches); the Redis visibility timeout is set above it")
    drain_seconds: float = Field(default=60, gt=0, description="one wake-up (a worker task) claims jobs for at most "
                                 "this long, then finishes what it holds")
    sweep_interval_s: float = Field(
        default=10, gt=0, description="how often the worker repairs the job ledger (expired leases re-queued, "
        "`auto` jobs left waiting on a finished stage settled, running jobs without a lease re-queued) and "
        "re-publishes lost wake-ups")
    heartbeat_ttl_s: int = Field(
        default=30, ge=2, description="a worker's heartbeat lives this long in Redis; it beats every third of it (or "
        "every sweep, if sooner), and `/readyz` needs a live one")
    publish_retries: int = Field(
        default=2, ge=0, description="retries of one wake-up publish to Redis before it is given up (the job stays "
        "queued and the sweeper publishes for it later)")

    @property
    def visibility_timeout_s(self) -> int:
        # Redis re-delivers an unacked message after this; it must outlast the longest task.
        return self.job_time_limit_s * 2 + 60


class LimitsSettings(BaseModel):
    """What one request may ask for."""

    model_config = ConfigDict(title="Request limits")

    prompt_chars: int = Field(default=16_000, ge=1, description="the longest prompt, in characters (422 beyond); "
                              "prompt tokens + `max_new_tokens` are also checked against the model's context")
    max_new_tokens: int = Field(default=1024, ge=1, description="the largest `max_new_tokens` a job may ask "
                                "for (422 beyond)")
    batch_submit: int = Field(default=256, ge=1, description="the most jobs in one `POST /v1/jobs/batch` (422 "
                              "beyond)")
    body_bytes: int = Field(default=1_048_576, ge=1024, description="the largest request body (413 beyond) and "
                            "the largest line of a batch input file; uploads have `KEVLAYA_BATCH__FILES_MAX_BYTES`")
    header_bytes: int = Field(
        default=65_536, ge=4096, description="request line plus headers; a larger request is refused by the server"
    )
    wait_timeout_s: float = Field(default=60, gt=0, description="the longest `timeout` a `/wait` long-poll "
                                  "accepts")
    wait_recheck_s: float = Field(
        default=5, gt=0, description="long-polls (`/wait`, chat) wake up on a Redis \"job finished\" notice and hold "
        "no database connection; this often they re-read the job anyway, in case a notice was lost"
    )
    chat_timeout_s: float = Field(default=120, gt=0, description="how long `/v1/chat/completions` waits for its job "
                                  "(then 504; the job goes on)")


class StreamsSettings(BaseModel):
    """`GET /v1/jobs/{id}/events` and streamed chat completions."""

    model_config = ConfigDict(title="Live job streams")

    max_events: int = Field(
        default=4096, ge=16, description="entries kept in one job's Redis stream of live events (about one per "
        "decode step it wrote text in); a client further behind is told to `resync`")
    keep_s: int = Field(default=600, ge=1, description="a job's stream of live events is kept this long "
                        "after it ends (the stored row stays the truth)")
    interval_ms: float = Field(
        default=25, ge=0, le=1000, description="a running job's new text goes to its stream at most this often (one "
        "entry for every step since the last): the worker's Python thread that writes streams then competes less "
        "with its decode loop; status changes and a finished job's text are written at once")
    heartbeat_s: float = Field(
        default=15, gt=0, description="an event stream with nothing new sends a comment this often, so proxies keep "
        "it open; a client whose job's \"finished\" notice was lost finds it then")


class BatchSettings(BaseModel):
    """`/v1/files` and `/v1/batches` (docs/architecture.md §15)."""

    model_config = ConfigDict(title="Batch API")

    files_dir: Path = Field(default=Path(".kevlaya/files"), description="where the API keeps uploaded batch files "
                            "and the batches' output and error files, each under the service's own id (in compose, "
                            "a volume of the API)")
    files_max_bytes: int = Field(default=200 * 1024 * 1024, ge=1024, description="the largest batch input file one "
                                 "upload may store, in bytes (OpenAI's limit); past it, 413 and nothing kept")
    files_max_lines: int = Field(default=50_000, ge=1, description="the most lines (requests) one batch input file "
                                 "may hold (OpenAI's limit); past it, 413 and nothing kept")
    check_interval_s: float = Field(default=1.0, gt=0, description="how often each API process's batch keeper "
                                    "looks for batches to validate, expire, cancel or write out")
    lease_s: float = Field(default=60, gt=0, description="a batch being validated or written out by an API "
                           "process that stopped is taken over by another after this long")


class QuotasSettings(BaseModel):
    """Per API key; `kevlaya quotas set` gives one key its own limits (docs/architecture.md §16)."""

    model_config = ConfigDict(title="Quotas and retention")

    queued_jobs_per_key: int = Field(
        default=10_000, ge=1, description="interactive jobs (`/v1/jobs`, `/v1/jobs/batch`, chat completions) one API "
        "key may have queued at once; a submit that would pass it stores nothing and gets 429 `queued_jobs_limit` "
        "with `Retry-After` (batch lines are bounded by their files)")
    stored_bytes_per_key: int = Field(
        default=4 * 1024 ** 3, ge=1024, description="bytes one API key may keep stored: its jobs' requests "
        "(input, params, metadata) and results, and its files (uploads, batch output and error files). A submit or "
        "upload that would pass it stores nothing and gets 413 `storage_quota_exceeded` (an upload as soon as its "
        "bytes pass it); answers of jobs already accepted are always stored, and counted")
    retention_s: float = Field(
        default=30 * 86400, ge=0, description="finished jobs, finished batches (with their lines and output files) "
        "and files are deleted this long after they finished (files: after they were stored), by each API process's "
        "batch keeper, which frees their bytes; `0` keeps everything")


class MonitoringSettings(BaseModel):
    """The worker's metrics and the log lines (README: Monitoring)."""

    model_config = ConfigDict(title="Monitoring")

    metrics_host: str = Field(default="127.0.0.1", description="the address of the worker's own Prometheus "
                              "`/metrics`, served by the worker child once its model is loaded")
    metrics_port: int = Field(default=9109, ge=0, le=65535,
                              description="the port of the worker's `/metrics`; `0` disables it")
    log_format: Literal["text", "json"] = Field(
        default="text", description="log lines of the worker and of the API's own loggers (`kevlaya.*`; uvicorn's "
        "stay its own): `text` (key=value fields) or `json` (one object per line)")


class Settings(BaseSettings):
    """One field per group (a model, read from `KEVLAYA_<GROUP>__<NAME>`), in the order of the Configuration
    tables."""

    model_config = SettingsConfigDict(
        env_prefix="KEVLAYA_", env_file=".env", env_nested_delimiter="__", extra="ignore"
    )

    api: ApiSettings = Field(default_factory=ApiSettings)
    flower: FlowerSettings = Field(default_factory=FlowerSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    connections: ConnectionsSettings = Field(default_factory=ConnectionsSettings)
    keys: KeysSettings = Field(default_factory=KeysSettings)
    database: DatabaseSettings = Field(default_factory=DatabaseSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    # The roles. Nested variables override single fields: KEVLAYA_KEV__PATH, KEVLAYA_LAYA__MAX_NEW_TOKENS, ...
    kev: KevProfile = Field(default=KevProfile(), description="the profile of Kev, the deliberate analyst: its "
                            "adapter and its jobs' defaults")
    laya: LayaProfile = Field(default=LayaProfile(), description="the profile of Laya, the fast decider: its "
                              "adapter and its jobs' defaults")
    roles: RoleProfile = Field(default=RoleProfile(), description="the jobs' defaults of roles loaded at run time "
                               "under new names")
    cascade: CascadeSettings = Field(default_factory=CascadeSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    reliability: ReliabilitySettings = Field(default_factory=ReliabilitySettings)
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    streams: StreamsSettings = Field(default_factory=StreamsSettings)
    batch: BatchSettings = Field(default_factory=BatchSettings)
    quotas: QuotasSettings = Field(default_factory=QuotasSettings)
    monitoring: MonitoringSettings = Field(default_factory=MonitoringSettings)

    def adapter_profile(self, adapter: str) -> AdapterProfile:
        """The role's profile: Kev's, Laya's, or that of every role loaded at run time."""
        return self.kev if adapter == "kev" else self.laya if adapter == "laya" else self.roles

    def updated(self, **groups: dict[str, Any]) -> Settings:
        """A copy with some fields of some groups replaced (not validated, as `model_copy`):
        `settings.updated(engine={"max_batch": 4})`."""
        return self.model_copy(update={group: getattr(self, group).model_copy(update=fields)
                                       for group, fields in groups.items()})

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The flat names come after the environment and .env: a new name set in either wins.
        return (init_settings, env_settings, dotenv_settings, FlatNames(settings_cls, env_settings, dotenv_settings),
                file_secret_settings)


# The flat variables of the release before the groups, without `KEVLAYA_`, and the grouped field each sets.
# Deprecated: read for one release, with a warning naming the new variable, then dropped.
FLAT_NAMES: dict[str, str] = {
    "api_host": "api.host", "api_port": "api.port", "api_key": "api.key", "api_workers": "api.workers",
    "api_writer": "api.writer",
    "flower_host": "flower.host", "flower_port": "flower.port", "flower_basic_auth": "flower.basic_auth",
    "flower_db": "flower.db",
    "redis_url": "redis.url", "redis_allow_no_password": "redis.allow_no_password",
    "api_head_timeout_s": "connections.head_timeout_s", "api_body_timeout_s": "connections.body_timeout_s",
    "api_body_min_bytes_per_s": "connections.body_min_bytes_per_s",
    "api_idle_timeout_s": "connections.idle_timeout_s", "api_max_connections": "connections.max",
    "api_max_connections_per_address": "connections.max_per_address",
    "streams_per_key": "connections.streams_per_key", "long_polls_per_key": "connections.long_polls_per_key",
    "new_key_rate_limit": "keys.default_rate_limit", "auth_failures_per_address": "keys.auth_failures_per_address",
    "auth_failure_window_s": "keys.auth_failure_window_s",
    "database_url": "database.url", "db_pool_size": "database.pool_size",
    "db_pool_timeout_s": "database.pool_timeout_s", "sqlite_synchronous": "database.sqlite_synchronous",
    "base_model": "model.base", "model_cache_dir": "model.cache_dir", "device": "model.device",
    "quantization": "model.quantization", "verify_manifests": "model.verify_manifests",
    "cascade_threshold": "cascade.threshold",
    "max_batch": "engine.max_batch", "max_wait_ms": "engine.max_wait_ms", "key_spare_slots": "engine.key_spare_slots",
    "engine_window_tokens": "engine.window_tokens", "engine_prefill_tokens": "engine.prefill_tokens",
    "engine_prefill_chunk_tokens": "engine.prefill_chunk_tokens",
    "engine_prefill_between_steps": "engine.prefill_between_steps",
    "engine_batch_prefill_tokens": "engine.batch_prefill_tokens", "engine_cuda_graphs": "engine.cuda_graphs",
    "engine_kv_dtype": "engine.kv_dtype", "engine_workspace_gb": "engine.workspace_gb",
    "engine_prefill_share": "engine.prefill_share", "engine_switch_interval_ms": "engine.switch_interval_ms",
    "vram_budget_gb": "engine.vram_budget_gb", "ignore_eos": "engine.ignore_eos",
    "lease_seconds": "reliability.lease_seconds", "max_attempts": "reliability.max_attempts",
    "worker_recycle_after_tasks": "reliability.worker_recycle_after_tasks",
    "model_load_timeout_s": "reliability.model_load_timeout_s", "job_time_limit_s": "reliability.job_time_limit_s",
    "drain_seconds": "reliability.drain_seconds", "sweep_interval_s": "reliability.sweep_interval_s",
    "heartbeat_ttl_s": "reliability.heartbeat_ttl_s", "publish_retries": "reliability.publish_retries",
    "max_prompt_chars": "limits.prompt_chars", "max_new_tokens_limit": "limits.max_new_tokens",
    "max_batch_submit": "limits.batch_submit", "max_body_bytes": "limits.body_bytes",
    "max_header_bytes": "limits.header_bytes", "max_wait_timeout_s": "limits.wait_timeout_s",
    "wait_recheck_s": "limits.wait_recheck_s", "chat_timeout_s": "limits.chat_timeout_s",
    "stream_max_events": "streams.max_events", "stream_keep_s": "streams.keep_s",
    "stream_interval_ms": "streams.interval_ms", "stream_heartbeat_s": "streams.heartbeat_s",
    "files_dir": "batch.files_dir", "files_max_bytes": "batch.files_max_bytes",
    "files_max_lines": "batch.files_max_lines", "batch_check_interval_s": "batch.check_interval_s",
    "batch_lease_s": "batch.lease_s",
    "queued_jobs_per_key": "quotas.queued_jobs_per_key", "stored_bytes_per_key": "quotas.stored_bytes_per_key",
    "retention_s": "quotas.retention_s",
    "worker_metrics_host": "monitoring.metrics_host", "worker_metrics_port": "monitoring.metrics_port",
    "log_format": "monitoring.log_format",
}


def grouped_variable(field: str) -> str:
    """`api.port` → `KEVLAYA_API__PORT`."""
    return "KEVLAYA_" + "__".join(part.upper() for part in field.split("."))


class FlatNames(PydanticBaseSettingsSource):
    """The flat variables (`KEVLAYA_API_PORT`) from the environment and from `.env`, as their grouped fields
    (`api.port`), each with a `FutureWarning` naming its new variable. One whose new variable is set too (in either)
    is ignored, with a warning saying so."""

    def __init__(self, settings_cls: type[BaseSettings], env: PydanticBaseSettingsSource,
                 dotenv: PydanticBaseSettingsSource) -> None:
        super().__init__(settings_cls)
        # Both hold their variables by lowercased name (the settings are not case-sensitive).
        self.sources = [(source, where) for source, where in ((dotenv, " (in .env)"), (env, ""))
                        if isinstance(source, (EnvSettingsSource, DotEnvSettingsSource))]

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # noqa: ARG002
        return None, field_name, False  # unused: __call__ reads the flat names itself

    def __call__(self) -> dict[str, Any]:
        found: dict[str, dict[str, Any]] = {}
        for source, where in self.sources:  # .env first, the environment over it, as for the new names
            for name, value in source.env_vars.items():
                key = name.lower()
                field = FLAT_NAMES.get(key[len("kevlaya_"):]) if key.startswith("kevlaya_") else None
                if field is None:
                    continue
                old, new = name.upper(), grouped_variable(field)
                if any(new.lower() in {n.lower() for n in other.env_vars} for other, _ in self.sources):
                    warnings.warn(f"{old}{where} is deprecated and ignored: {new} is set", FutureWarning)
                    continue
                warnings.warn(f"{old}{where} is deprecated; use {new}", FutureWarning)
                group, name_in_group = field.split(".")
                found.setdefault(group, {})[name_in_group] = value
        return found


@lru_cache
def get_settings() -> Settings:
    return Settings()

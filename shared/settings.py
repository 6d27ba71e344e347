"""The one settings object. Every value comes from a `KEVLAYA_*` variable or `.env`; defaults run locally."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.schemas import check_temperature

Adapter = Literal["kev", "laya"]
ADAPTERS: tuple[Adapter, ...] = ("kev", "laya")

DEFAULT_MODEL_DIR = Path("models/demo")


class AdapterProfile(BaseModel):
    """Per-role defaults: where the adapter lives and how it generates unless a job says otherwise."""

    path: str
    max_new_tokens: int = Field(ge=1)
    temperature: float = Field(ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    system_prompt: str
    reserved_slots: int = Field(
        default=0, ge=0, description="slots kept free for this role's jobs (at most a quarter "
        "of the slots), so another role's backlog never makes it wait for a row to finish")
    analysis: bool = Field(
        default=False, description="a decision job's answer may start with free-text analysis lines before its "
        "decision object (Kev); otherwise it is the decision object alone (Laya)")

    # A default temperature must be runnable too: (0, 0.01) makes sampling overflow.
    _runnable_temperature = field_validator("temperature")(check_temperature)


class KevProfile(AdapterProfile):
    path: str = str(DEFAULT_MODEL_DIR / "kev")
    max_new_tokens: int = Field(default=512, ge=1)
    temperature: float = Field(default=0.3, ge=0)
    analysis: bool = True
    system_prompt: str = (
        "You are Kev, a deliberate analyst. Check every option against the constraints, "
        "eliminate, compare, then answer with one JSON decision object."
    )


class LayaProfile(AdapterProfile):
    path: str = str(DEFAULT_MODEL_DIR / "laya")
    max_new_tokens: int = Field(default=64, ge=1)
    temperature: float = Field(default=0.1, ge=0)
    system_prompt: str = "You are Laya, a fast decider. Answer with one short JSON decision object only."
    reserved_slots: int = Field(default=4, ge=0)  # a fast decider starts at the next step, even under Kev load


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KEVLAYA_", env_file=".env", env_nested_delimiter="__", extra="ignore"
    )

    # Endpoints
    api_host: str = "127.0.0.1"
    api_port: int = 8000
    flower_host: str = "127.0.0.1"
    flower_port: int = 5555
    flower_basic_auth: SecretStr | None = Field(
        default=None, description="user:password for Flower; required when Flower listens beyond localhost"
    )
    redis_url: str = "redis://127.0.0.1:6379/0"
    database_url: str = "sqlite:///./kevlaya.db"
    api_key: SecretStr | None = Field(default=None, description="bootstrap admin key")
    api_workers: int = Field(default=1, ge=1, description="API processes (uvicorn workers) on the one port")
    api_writer: Literal["process", "thread"] = Field(
        default="process", description="where each API process stores its submits: process, a child process with "
        "its own interpreter lock (faster under load); thread, a thread of the API process (one process less)")
    db_pool_size: int = Field(default=40, ge=1, description="database connections kept per process")
    sqlite_synchronous: Literal["FULL", "NORMAL"] = Field(
        default="FULL", description="FULL: a commit survives power loss; NORMAL (WAL): survives a crash of the "
        "process, not of the machine, and saves an fsync per commit")

    # Models
    base_model: str = str(DEFAULT_MODEL_DIR / "base")
    # Nested variables override single fields: KEVLAYA_KEV__PATH, KEVLAYA_LAYA__MAX_NEW_TOKENS, ...
    kev: KevProfile = KevProfile()
    laya: LayaProfile = LayaProfile()
    device: Literal["auto", "cpu", "cuda"] = "auto"
    quantization: Literal["auto", "nf4", "none"] = Field(
        default="auto",
        description="auto: NF4 (double quant) on CUDA, full precision on the CPU; nf4 also works on the CPU "
        "with a bitsandbytes that has a CPU backend; none: fp16 on CUDA, fp32 on the CPU",
    )
    verify_manifests: bool = True

    # Engine (docs/architecture.md §4, §14)
    max_batch: int = Field(default=16, ge=1, description="rows decoded at once, besides the reserved slots")
    max_wait_ms: int = Field(
        default=2000, ge=0, description="fairness bound: an adapter whose oldest job has waited longer takes the "
        "next free slots first, and its claimed jobs are neither reordered nor paced")
    engine_window_tokens: int = Field(
        default=1024, ge=16, description="the most tokens (prompt + new) one job may hold; each "
        "slot reserves this much key/value cache")
    engine_prefill_tokens: int = Field(
        default=2048, ge=1, description="prompt tokens prefilled between two decode steps at "
        "most, counted padded (jobs × longest prompt; one job always goes), so a burst of new jobs does not freeze "
        "the rows already decoding; the worker measures a prefill of this size at start when it sizes the slots")
    engine_cuda_graphs: bool = Field(
        default=True, description="on CUDA: capture the decode step as CUDA graphs (one per "
        "batch-size bucket) and replay them; ignored on the CPU")
    engine_workspace_gb: float = Field(
        default=0.5, ge=0, description="on CUDA: first estimate of the memory kept free for "
        "activations beside the weights and the key/value cache; the worker then measures the real workspace "
        "(graphs captured, the largest prefill run) and takes slots away until it fits the budget")
    engine_prefill_share: float = Field(
        default=0.1, gt=0, le=1, description="while a row of a role with reserved slots (Laya) "
        "decodes, the prefills of other roles' jobs take at most this share of the time, so a wave of Kev prompts "
        "stretches a Laya answer by at most 1 / (1 - share); their jobs wait in their slots meanwhile (a job held "
        "past KEVLAYA_MAX_WAIT_MS is not held back). 1 = no pacing")
    engine_switch_interval_ms: float = Field(
        default=0.5, gt=0, le=100, description="how long the decode loop waits at most for the "
        "interpreter lock while the worker's other threads (the result writer, lease renewals) hold it "
        "(sys.setswitchinterval). Python's 5 ms default lets a busy writer stretch every lock hand-back of a "
        "decode step to 5 ms")
    cascade_threshold: float = Field(default=0.85, ge=0, le=1)

    # Reliability
    lease_seconds: float = Field(default=60, gt=0, description="a running job is re-queued this long after its worker stops renewing it")
    max_attempts: int = Field(default=3, ge=1, description="a job whose worker dies this many times fails")
    worker_recycle_after_tasks: int | None = Field(
        default=None, ge=1, description="restart the worker child (and reload the model) after this many tasks"
    )
    model_load_timeout_s: float = Field(
        default=600, gt=0, description="how long a new worker child may take to load the model before Celery kills it"
    )
    job_time_limit_s: int = Field(default=900, ge=10, description="hard limit for one worker task (a drain of batches)")
    drain_seconds: float = Field(default=60, gt=0, description="a task stops claiming new batches after this long")
    sweep_interval_s: float = Field(default=10, gt=0)
    heartbeat_ttl_s: int = Field(default=30, ge=2)
    publish_retries: int = Field(default=2, ge=0)

    # Request limits
    max_prompt_chars: int = Field(default=16_000, ge=1)
    max_new_tokens_limit: int = Field(default=1024, ge=1)
    max_batch_submit: int = Field(default=256, ge=1)
    max_body_bytes: int = Field(default=1_048_576, ge=1024)
    max_header_bytes: int = Field(
        default=65_536, ge=4096, description="request line plus headers; a larger request is refused by the server"
    )
    max_wait_timeout_s: float = Field(default=60, gt=0)
    wait_recheck_s: float = Field(
        default=5, gt=0, description="long-polls wake up on a Redis notice; this often they re-read the job anyway"
    )
    chat_timeout_s: float = Field(default=120, gt=0, description="how long /v1/chat/completions waits for its job")

    # Live job streams (GET /v1/jobs/{id}/events, streamed chat completions)
    stream_max_events: int = Field(
        default=4096, ge=16, description="entries kept in one job's Redis stream (about one per decode step it "
        "wrote text in); a reader further behind is told to resynchronise")
    stream_keep_s: int = Field(default=600, ge=1, description="a job's stream is kept this long after it ends")
    stream_heartbeat_s: float = Field(
        default=15, gt=0, description="an event stream with nothing to say sends a comment this often, so proxies "
        "keep it open")

    # The Batch API (/v1/files, /v1/batches; docs/architecture.md §15)
    files_dir: Path = Field(default=Path(".kevlaya/files"), description="where the API stores uploaded files and "
                            "the batches' output and error files (under the service's own ids)")
    files_max_bytes: int = Field(default=200 * 1024 * 1024, ge=1024, description="the largest file one upload may "
                                 "store (OpenAI's limit: 200 MB)")
    files_max_lines: int = Field(default=50_000, ge=1, description="the most lines (requests) one batch input "
                                 "file may hold (OpenAI's limit: 50,000)")
    files_per_key_bytes: int = Field(default=2 * 1024 ** 3, ge=1024, description="the bytes of files one API key "
                                     "may keep at once; an upload past it is refused (413)")
    batch_check_interval_s: float = Field(default=1.0, gt=0, description="how often the API's batch keeper looks "
                                          "for batches to validate, expire, cancel or finish")
    batch_lease_s: float = Field(default=60, gt=0, description="a batch being validated or written out by an API "
                                 "process that stopped is taken over by another after this long")

    # VRAM (the GPU runtime uses it; the CPU path ignores it)
    vram_budget_gb: float = Field(
        default=5.5, gt=0, description="GiB PyTorch may allocate: a 6 GB card's memory after its CUDA context; on a "
        "bigger GPU the worker caps itself to it")

    # Observability (README: Monitoring)
    worker_metrics_host: str = Field(default="127.0.0.1", description="address of the worker's /metrics server")
    worker_metrics_port: int = Field(default=9109, ge=0, le=65535,
                                     description="the worker's Prometheus port; 0 disables it")
    log_format: Literal["text", "json"] = Field(
        default="text", description="log lines of the worker and of the API's own loggers: text or JSON")
    flower_db: str | None = Field(default=None, description="Flower keeps its task history in this file")

    # Benchmarks only: every job generates exactly its max_new_tokens (end-of-sequence is ignored), so two
    # serving schemes compared on random weights produce the same number of tokens.
    ignore_eos: bool = False

    @field_validator("api_key", "flower_basic_auth", "flower_db", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return None if value == "" else value

    def adapter_profile(self, adapter: Adapter) -> AdapterProfile:
        return self.kev if adapter == "kev" else self.laya

    @property
    def visibility_timeout_s(self) -> int:
        # Redis re-delivers an unacked message after this; it must outlast the longest task.
        return self.job_time_limit_s * 2 + 60


@lru_cache
def get_settings() -> Settings:
    return Settings()

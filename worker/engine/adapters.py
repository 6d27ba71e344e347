"""Following the adapters an admin asked for (docs/architecture.md §10): the desired state of each role is a row of
`adapter_assignments` (shared/adapter_assignments.py), read at the engine's start and every
KEVLAYA_MODEL__ADAPTER_POLL_S while it drains. A changed role is held: the engine claims none of its jobs, its rows
claimed before finish on the version they started with, and once none is left (the safe point) the new version is
copied into the decoder's per-row LoRA in place (RowLoRA.replace) and recorded. An unloaded role stays held; its
queued jobs wait. A version that cannot be served (its files changed since the check, another base, NaN weights)
keeps the role held, with the reason in the heartbeat: nothing but the version asked for ever answers. A role
loaded under a new name takes a spare block of the per-row LoRA (KEVLAYA_MODEL__SPARE_ROLES) and serves from it;
unloaded, it gives the block back."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from shared.adapter_assignments import Desired, desired
from shared.adapter_identity import AdapterIdentity
from shared.adapter_versions import record_loaded
from shared.base_source import base_directory
from shared.calibration import Calibration, adapter_calibration, read_calibration
from shared.db import session_scope, write_scope
from shared.settings import ADAPTERS, Settings
from worker.metrics import METRICS

if TYPE_CHECKING:  # torch is imported only in the worker child
    from worker.decoder.kernels.row_lora import RowLoRA
    from worker.model.loading import LoadedModel

log = logging.getLogger("kevlaya.worker")


@dataclass
class AdapterSwitcher:
    """What each role serves and what it should serve. Used by the engine's loop thread; the sweep thread only
    reads `generations` (whether to wake an idle engine)."""

    loaded: LoadedModel
    settings: Settings
    generations: dict[str, int] = field(default_factory=dict)  # of the desired state each role follows
    calibrations: dict[str, Calibration] = field(default_factory=dict)  # of the version each role serves
    pending: dict[str, Desired] = field(default_factory=dict)  # changes not applied yet
    unloaded: set[str] = field(default_factory=set)
    blocked: dict[str, str] = field(default_factory=dict)  # role -> why the version asked for is not served
    unrecorded: list[AdapterIdentity] = field(default_factory=list)  # versions not in `adapter_versions` yet
    next_poll: float = 0.0

    def __post_init__(self) -> None:
        self.calibrations = {name: adapter_calibration(self.settings.adapter_profile(name).path)  # read at load
                             for name in self.loaded.versions}

    def held(self) -> set[str]:
        """Roles whose jobs are not claimed now."""
        return set(self.pending) | self.unloaded | set(self.blocked)

    def versions(self) -> dict[str, str]:
        """Each served role's version, as a claim group records it for its jobs."""
        return {name: identity.sha256 for name, identity in self.loaded.versions.items()}

    def poll(self, force: bool = False) -> None:
        """Read the desired state (at most every KEVLAYA_MODEL__ADAPTER_POLL_S unless `force`); a role whose
        generation changed becomes pending."""
        now = time.monotonic()
        if not force and now < self.next_poll:
            return
        self.next_poll = now + self.settings.model.adapter_poll_s
        with session_scope() as session:
            wanted = desired(session)
        for role, state in wanted.items():
            if state.generation != self.generations.get(role, 0) and role not in self.pending:
                log.info("adapter %s: %s asked for; its jobs are held until its rows in flight finish", role,
                         "an unload" if state.unloaded else f"version {state.sha256} from {state.path}")
                self.pending[role] = state
            elif role in self.pending:
                self.pending[role] = state  # asked again meanwhile: the last request wins
        if self.unrecorded:
            self._record()

    def switch(self, role: str, lora: RowLoRA) -> None:
        """Apply the pending change of `role`: its rows must all be done (the engine's safe point)."""
        from worker.model.adapter_weights import read_adapter

        state = self.pending.pop(role)
        self.generations[role] = state.generation
        if state.unloaded:
            self.unloaded.add(role)
            self.blocked.pop(role, None)
            if role not in ADAPTERS and role in lora.adapters:  # a new role frees its spare block
                lora.release(role)
                self.loaded.adapters.discard(role)
                self.loaded.versions.pop(role, None)
                self.calibrations.pop(role, None)
            log.info("adapter %s unloaded: it takes no jobs until it is loaded again", role)
            return
        path = state.path or self.settings.adapter_profile(role).path
        started = time.perf_counter()
        served = self.loaded.versions.get(role)
        took = False
        try:
            if role not in lora.adapters:
                if role in ADAPTERS:
                    raise ValueError(f"this worker started without {role}, so its per-row LoRA has no block for it")
                lora.take(role)  # a new role: a spare block, zeros until its weights are copied in
                took = True
            if served is None or served.sha256 != state.sha256 or role in self.blocked:
                base = base_directory(self.settings.model.base, self.settings.model.cache_dir)
                new = read_adapter(role, path, str(base), self.settings.model.base,
                                   self.settings.model.verify_manifests)
                if state.sha256 and new.identity.sha256 != state.sha256:
                    raise ValueError(f"its version is {new.identity.sha256} now, not {state.sha256} as when it was "
                                     "checked: it changed since")
                if self.loaded.device == "cuda":
                    import torch

                    torch.cuda.synchronize()  # a step launched ahead may still read the old block
                lora.replace(role, new.weights, new.scaling)
                served, calibration = new.identity, new.calibration
            else:  # the same weights: their calibration may have been fitted again
                calibration = read_calibration(Path(path))
        except Exception as exc:
            if took:
                lora.release(role)
            self.blocked[role] = f"adapter {role} ({path}) cannot be served: {exc}"
            log.error("%s; its jobs wait until another version is loaded", self.blocked[role])
            return
        self.blocked.pop(role, None)
        self.unloaded.discard(role)
        self.loaded.versions[role], self.calibrations[role] = served, calibration
        self.loaded.adapters.add(role)
        METRICS.adapters_loaded([served])
        self.unrecorded.append(served)
        self._record()
        log.info("adapter %s now serves version %s from %s (switched in %.2fs)", role, served.sha256, path,
                 time.perf_counter() - started)

    def _record(self) -> None:
        try:
            with write_scope() as session:
                record_loaded(session, list(self.unrecorded))
        except Exception as exc:  # the database may be away: tried again at the next poll
            log.warning("adapter versions not recorded yet: %s", exc)
            return
        self.unrecorded.clear()

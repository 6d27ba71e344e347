"""The garbage collector's settings for a process that serves load (the API and its job writer)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def settled_collector() -> Iterator[None]:
    """What is loaded by now (modules, the tokenizer, the app) lives as long as the process: moved out of the
    collector's sight, a full collection no longer walks it. Those walks were most of the slowest answers' time
    under load (RELIABILITY.md, Load). Garbage is collected first, so none of it is kept for good. And a
    young-generation pass every 20,000 allocations, not every 700: a submit allocates a few hundred objects, and
    at a thousand submits a second the default ran a pass per request or two. Undone on exit, so an app started
    again in this process (tests) does not keep this one's objects for good."""
    gc.collect()
    gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(20_000, 50, 100)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()

"""Runs a `kevlaya` command on a wall clock set some seconds off: `python tests/skewed_clock.py SECONDS worker`.

time-machine moves Python's clocks (`time.time`, `datetime.now`...) in this process and the children it forks
(a worker's pool child); the monotonic clock and the database's clock stay true, as on a host whose clock is off."""

from __future__ import annotations

import sys
from datetime import datetime, timedelta, timezone

import time_machine

if __name__ == "__main__":
    offset_s, command = float(sys.argv[1]), sys.argv[2:]
    time_machine.travel(datetime.now(timezone.utc) + timedelta(seconds=offset_s), tick=True).start()
    from cli.main import main

    sys.argv = ["kevlaya", *command]
    sys.exit(main())

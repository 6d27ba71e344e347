"""The job ledger: claims and leases (`claims.py`, `leases.py`), from a stored job to its request and from a
result to its stored outcome (`settle.py`, `outcomes.py`), and the `auto` escalation (`cascade.py`). The state
changes themselves are `shared.lifecycle`'s."""

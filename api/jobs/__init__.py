"""Jobs: submitting them (intake, prompt budget, submission, the job writer and its process, wake-ups), reading them
back (lookup, presenters, cursors, long-polls, the event stream), deleting them, and `/v1/jobs` (routes.py)."""

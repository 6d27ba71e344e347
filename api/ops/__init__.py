"""Running the service: liveness and readiness (health.py), the API's Prometheus metrics and `/metrics` (metrics.py),
the statistics of `/v1/stats` (stats.py) and the status page that shows them (status_page.py, static/)."""

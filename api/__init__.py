"""The REST API. It never imports torch: the worker is the only process that touches a model."""

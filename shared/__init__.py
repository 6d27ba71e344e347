"""Code both the API and the worker import: settings, models, DB session, job schemas, queue publishing."""

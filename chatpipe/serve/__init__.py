"""Talking to a model: web UI and JSON API, OpenAI-compatible API, terminal chat, MLflow pyfunc."""

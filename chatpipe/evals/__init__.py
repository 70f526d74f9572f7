"""Evaluations: CORE, ChatCORE, chat checks and metrics (model-written code runs in :mod:`chatpipe.sandbox`)."""

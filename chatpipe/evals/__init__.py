"""Evaluations: CORE, ChatCORE, chat checks, metrics and the code sandbox."""

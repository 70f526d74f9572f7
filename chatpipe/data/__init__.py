"""Pretraining text, tokenized shards and row loaders, chat packing and tasks."""

"""KV-cached generation with calculator tool use."""

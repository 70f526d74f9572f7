"""The GPT, its training attention, FP8 layers, loading and nanochat import."""

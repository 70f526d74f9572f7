"""chatpipe: train a small ChatGPT-like model from scratch; the library the stages are built from."""

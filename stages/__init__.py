"""One torchrun-runnable entry point per pipeline stage (python -m stages.<name>)."""

"""Prefect flows that chain the stages: the pipeline and its scheduled deployment."""

"""The final model as a transformers directory."""

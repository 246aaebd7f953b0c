"""Layers of the Qwen3.5 family, one concept per file; ops come from the selected backend."""

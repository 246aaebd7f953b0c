"""Model architectures (qwen3_5, qwen3_5_mtp) and checkpoint loading (loader)."""

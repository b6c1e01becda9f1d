"""The networks: Qwen3 target, DFlash drafter, their configs, layers and KV caches."""

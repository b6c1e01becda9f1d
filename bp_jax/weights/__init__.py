"""Checkpoints on disk: safetensors, Hugging Face name mapping, conversion, loading."""

"""Text: tokenizers (offline Qwen3, byte-level BPE) and prompt sources."""

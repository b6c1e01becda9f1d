"""BlockPilot: the block-size MLP, its prefill features, and label sets."""

"""bp_jax: BlockPilot-style adaptive speculative decoding with DFlash drafters, in JAX/Flax NNX."""
__version__ = "0.1.0"

"""decode.py's job, at the edge of the library: the config file is read here and nowhere below.

`run` loads the checkpoints and decodes a prompt set; `block_choice` turns the config into each
request's block size; `compare` runs other methods on the same prompts; `records` writes and
summarises what was measured. The engine below (`bp_jax.decoding`) takes typed arguments and
never sees a config.
"""

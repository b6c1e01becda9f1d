"""Device meshes and sharding: the `--config.mesh` flag (`mesh.py`) and the one logical-axis
rule table that places parameters, batches and KV caches on it (`rules.py`)."""

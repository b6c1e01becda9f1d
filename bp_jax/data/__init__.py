"""Datasets as TFDS ArrayRecord builders (no TensorFlow needed) and training batches.

  * prompt sets (`id`, `text`): `write_prompts`, `read_prompts`;
  * token sequences (`id`, `tokens`, `prompt_len`): `write_sequences`;
  * `open_dataset(data_dir, name)` reads any of them back as a random-access sequence of dicts;
  * `batches(...)` shuffles/pads an epoch; `packed_lm_chunks(...)` packs a token stream.
"""

from bp_jax.data.batching import (batches, chunk_records, epoch_order, packed_lm_chunks,
                                  pad_batch)
from bp_jax.data.prompt_sets import PromptSetBuilder, read_prompts, select_prompts, write_prompts
from bp_jax.data.sequences import TokenSequenceBuilder, write_sequences
from bp_jax.data.tfds_io import (SPLIT, Dataset, dataset_exists, open_dataset, quiet_tfds,
                                 remove_dataset)

__all__ = [
    "SPLIT", "Dataset", "PromptSetBuilder", "TokenSequenceBuilder", "batches", "chunk_records",
    "dataset_exists", "epoch_order", "open_dataset", "packed_lm_chunks", "pad_batch",
    "quiet_tfds", "read_prompts", "remove_dataset", "select_prompts", "write_prompts",
    "write_sequences",
]

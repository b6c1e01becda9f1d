"""Generic Qwen3 decoding config: every field is a `--config.<name>` flag of decode.py.

  python decode.py --config configs/qwen3.py --config.target ckpt/qwen3-4b \
      --config.prompts prompts.jsonl --config.output out/qwen3.jsonl
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # Checkpoints (converted by convert_weights.py or written by train.py).
  c.target = ""              # converted target checkpoint folder
  c.drafter = ""             # converted DFlash drafter folder (mode=spec)
  c.policy = ""              # block-size policy checkpoint (block_policy=learned)
  c.tokenizer = ""           # tokenizer folder; empty = the target checkpoint's own files
  c.dtype = "auto"           # auto (as stored) | float32 | bfloat16 | float16
  # Prompts and outputs.
  c.prompts = "configs/prompts/example.jsonl"  # JSONL of {"prompt": ...}, 'humaneval', 'pysrc:<dir>'
  c.num_prompts = 0          # 0 = all
  c.chat = False             # apply the tokenizer's chat template
  c.output = "out/decode.jsonl"  # JSONL records; the summary goes to <output>.summary.json
  c.show = 2                 # completions printed to the terminal
  # Decoding.
  c.mode = "ar"              # ar | spec
  c.temperature = 0.0        # 0 = greedy
  c.seed = 0
  c.max_new_tokens = 128
  c.max_len = 1024           # cache slots per request: prompt + max_new_tokens + block_size - 1
  c.length_buckets = ""      # comma-separated prompt-length buckets; empty = powers of two
  c.block_size = 16          # block size for block_policy=fixed (mode=spec)
  c.block_sizes = ""         # comma-separated buckets; empty = drafter's training size +-4
  c.block_policy = "fixed"   # fixed
  c.precompile = False       # compile every bucket up front and report each compile time
  c.report = ""              # folder for PNG plots (acceptance-length histogram)
  return c

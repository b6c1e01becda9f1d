"""Speculative decoding with a DFlash drafter (e.g. Qwen3-4B + Qwen3-4B-DFlash-b16).

  python decode.py --config configs/qwen3_dflash.py --config.target ckpt/qwen3-4b \
      --config.drafter ckpt/dflash-4b --config.prompts humaneval --config.num_prompts 20
"""

from configs import qwen3


def get_config():
  c = qwen3.get_config()
  c.mode = "spec"
  c.block_size = 16
  c.max_len = 4096
  return c

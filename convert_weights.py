"""Converts Hugging Face Qwen3 / z-lab DFlash checkpoints to bp_jax checkpoints, and back.

  python convert_weights.py --hf_dir ~/hf/Qwen3-4B --out_dir ckpt/qwen3-4b --dtype bfloat16
  python convert_weights.py --hf_dir ~/hf/Qwen3-4B-DFlash-b16 --out_dir ckpt/dflash-4b \
      --target_dir ckpt/qwen3-4b
  python convert_weights.py --to_hf --ckpt_dir ckpt/dflash-4b --out_dir hf/dflash-4b
"""

from absl import app, flags, logging

from bp_jax import cli
from bp_jax.errors import BadInputError


flags.DEFINE_string("hf_dir", None, "Local Hugging Face checkpoint folder (config.json + "
                    "model.safetensors or a sharded model.safetensors.index.json).")
flags.DEFINE_string("out_dir", None, "Output folder (bp_jax checkpoint; with --to_hf, a "
                    "Hugging Face folder).")
flags.DEFINE_string("dtype", "auto", "Parameter dtype: auto (as stored), float32, bfloat16, "
                    "float16.")
flags.DEFINE_bool("overwrite", False, "Replace a non-empty --out_dir.")
flags.DEFINE_string("tokenizer", "", "Tokenizer to store with the checkpoint: empty = the "
                    "tokenizer files of --hf_dir, 'qwen3-offline' = the offline Qwen3 tokenizer, "
                    "or a folder with tokenizer files.")
flags.DEFINE_string("target_dir", None, "When converting a DFlash drafter: a converted target "
                    "checkpoint to check it against.")
flags.DEFINE_bool("to_hf", False, "Export --ckpt_dir (bp_jax) to the Hugging Face / z-lab "
                  "layout in --out_dir.")
flags.DEFINE_string("ckpt_dir", None, "bp_jax checkpoint to export (with --to_hf).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # no absl INFO lines (backend probing, orbax)
  F = flags.FLAGS
  from bp_jax.weights import convert
  # a BadInputError: one line (`cli.run`)
  if not F.out_dir:
    raise BadInputError("--out_dir is required")
  if F.to_hf:
    if not F.ckpt_dir:
      raise BadInputError("--to_hf needs --ckpt_dir (the bp_jax checkpoint to export)")
    for name in ("hf_dir", "tokenizer", "target_dir"):
      if getattr(F, name):
        raise BadInputError(f"--{name} applies to converting from Hugging Face, not to "
                            "--to_hf (which exports --ckpt_dir with its own tokenizer)")
    kind = convert.export_to_hf(F.ckpt_dir, F.out_dir, overwrite=F.overwrite, dtype=F.dtype)
    print(f"exported {kind} checkpoint {F.ckpt_dir} -> {F.out_dir} (Hugging Face layout)")
  else:
    if not F.hf_dir:
      raise BadInputError("--hf_dir is required (or --to_hf with --ckpt_dir)")
    if F.ckpt_dir:
      raise BadInputError("--ckpt_dir is the checkpoint --to_hf exports; to convert from "
                          "Hugging Face give --hf_dir")
    kind = convert.convert_from_hf(F.hf_dir, F.out_dir, dtype=F.dtype, overwrite=F.overwrite,
                                   tokenizer=F.tokenizer, target_dir=F.target_dir)
    print(f"converted {kind} checkpoint {F.hf_dir} -> {F.out_dir}")


if __name__ == "__main__":
  cli.run(main, __doc__)

"""Serves the engine over HTTP, OpenAI-compatible: POST /v1/completions and
/v1/chat/completions (with "stream": true or not), GET /v1/models, /health and /metrics.
Same --config files as decode.py; with no flags it serves the shipped demo on 127.0.0.1:8000.

  python serve.py
  python serve.py --config configs/qwen3_dflash.py --config.target ckpt/qwen3-4b \
      --config.drafter ckpt/dflash-4b --batch_size 16 --port 8000 --api_key "$KEY"

See docs/serving/README.md.
"""

from absl import app, flags, logging
from ml_collections import config_flags

from bp_jax import cli

cli.check_config_fields("configs/demo.py")
_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/demo.py", "Decoding config file (as decode.py's); override any field "
    "with --config.<field>=value.")
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (loopback unless told).")
flags.DEFINE_integer("port", 8000, "Port to listen on.")
flags.DEFINE_integer("batch_size", 8, "Requests decoding at once (slots of the engine's "
                     "bucket); replaces --config.batch_size.")
flags.DEFINE_string("api_key", "", "Require 'Authorization: Bearer <key>' (default: "
                    "$BP_JAX_API_KEY; empty: no key).")
flags.DEFINE_integer("max_body_bytes", 1 << 20, "Largest request body accepted (else 413).")
flags.DEFINE_string("model_name", "", "The model name clients send (default: the target "
                    "folder's name).")
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  from bp_jax.serving.server import serve
  serve(_CONFIG.value, host=FLAGS.host, port=FLAGS.port, batch_size=FLAGS.batch_size,
        api_key=FLAGS.api_key or None, max_body_bytes=FLAGS.max_body_bytes,
        model_name=FLAGS.model_name or None)  # a BadInputError: one line (`cli.run`)


if __name__ == "__main__":
  cli.run(main, __doc__, "configs/demo.py")

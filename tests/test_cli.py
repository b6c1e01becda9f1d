"""The scripts' command lines as a new user meets them: --help exits 0 and lists the flags and
config fields; a mistyped config field is one line naming the closest field."""

from __future__ import annotations

import pytest

from bp_jax.decode_job.run import prompt_tail


@pytest.mark.parametrize("script,shows", [
    ("decode.py", ["--config", "num_prompts = ", "drafter_sampling = "]),
    ("train.py", ["--config", "lm.steps = ", "stage = "]),
    ("convert_weights.py", ["--hf_dir", "--to_hf", "--dtype"]),
])
def test_help_exits_0_and_lists_flags_and_fields(run_cli, script, shows):
  res = run_cli(script, "--help")
  assert res.rc == 0, res.stderr
  for text in shows:
    assert text in res.stdout, (text, res.stdout[-2000:])


@pytest.mark.parametrize("script,arg,closest", [
    ("decode.py", "--config.num_prompt=2", "--config.num_prompts"),
    ("train.py", "--config.lm.step=2", "--config.lm.steps"),
])
def test_a_mistyped_field_is_one_line_naming_the_closest(run_cli, script, arg, closest):
  res = run_cli(script, arg)
  assert res.rc == 2
  lines = res.stderr.strip().splitlines()
  assert len(lines) == 1 and closest in lines[0] and "Traceback" not in res.stderr, res.stderr


def test_a_missing_config_file_is_named(run_cli):
  res = run_cli("decode.py", "--config=configs/no_such.py")
  assert res.rc == 2 and "configs/no_such.py" in res.stderr.strip().splitlines()[-1]


def test_a_benchmarks_bad_flag_is_one_line_not_a_traceback(run_cli):
  """Every script started by `cli.run` turns a `BadInputError` (a flag, file or the machine's
  memory-map limit at fault) into one line naming it and exit status 1."""
  res = run_cli("benchmarks/controllers.py", "--repeats=0")
  assert res.rc == 1 and "Traceback" not in res.stderr, res.stderr
  assert res.stderr.strip().splitlines()[-1] == (
      "controllers.py: error: --repeats and --max_new_tokens must be >= 1, --block_size >= 2")


def test_prompts_are_shown_whole_or_from_a_line_start():
  assert prompt_tail("def f():\n  return 1\n") == "def f():\n  return 1\n"
  text = "".join(f"line {i:02d} " + "x" * 30 + "\n" for i in range(30))
  shown = prompt_tail(text, limit=120)
  head, rest = shown.split("\n", 1)
  assert head.startswith("[... ") and "earlier prompt lines]" in head
  assert rest.startswith("line ") and text.endswith(rest) and len(rest) <= 120
  assert int(head.split()[1]) + rest.count("\n") == text.count("\n")
  one_line = "y" * 500
  assert prompt_tail(one_line) == one_line  # never cut inside a line

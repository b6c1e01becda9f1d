"""How each request's block size is chosen (decode.py's --config.block_policy):

  fixed    `--config.block_size` for every request;
  learned  the trained policy at `--config.policy` picks a bucket from each request's prefill
           (inside the prefill jit);
  oracle   each prompt's best size under `--config.label_rule`, read from a labels dataset
           (`--config.oracle_labels`, written by train.py --config.stage=labels): analysis only;
  random   uniform over the candidate sizes, seeded by (--config.seed, prompt index): the control.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from bp_jax.decoding.engine import LEARNED
from bp_jax.decoding.sampling import SamplingForm, form_of
from bp_jax.errors import BadInputError
from bp_jax.text.prompts import Prompt

BLOCK_POLICIES = ("fixed", "learned", "oracle", "random")


def parse_int_list(text: str, flag: str) -> tuple[int, ...]:
  if text is None or text == "":
    return ()
  try:
    return tuple(int(x) for x in str(text).split(",") if x.strip())
  except ValueError:
    raise BadInputError(f"{flag}={text!r}: expected comma-separated integers") from None


def default_block_sizes(train_block_size: int, radius: int = 4) -> tuple[int, ...]:
  """The drafter's training block size +- radius (at least 2)."""
  return tuple(range(max(2, train_block_size - radius), train_block_size + radius + 1))


# Candidates of the random control by default: training size +- 3 (docs/design.md §5).
POLICY_RADIUS = 3


@dataclasses.dataclass
class BlockChoice:
  """How each request's block size is chosen (see the module docstring)."""
  name: str                               # fixed | learned | oracle | random
  fixed: int = 1                          # the size of `fixed`
  sizes: tuple[int, ...] = ()             # candidates of learned / oracle / random
  seed: int = 0                           # random: seeds the draws with the request index
  oracle: dict[str, int] | None = None    # oracle: prompt hash -> best size
  policy: Any = None                      # learned: the BlockPolicy ...
  info: Any = None                        # ... and its PolicyInfo

  def block_size(self, index: int, prompt: Prompt) -> int | str:
    """The engine's `block_size` argument for request `index`."""
    from bp_jax.policy.mlp import prompt_hash, random_block_size

    if self.name == "learned":
      return LEARNED
    if self.name == "random":
      return random_block_size(self.sizes, self.seed, index)
    if self.name == "oracle":
      size = self.oracle.get(prompt_hash(prompt.text))
      if size is None:
        raise BadInputError(f"prompt {prompt.id!r} is not in the oracle labels "
                            "(--config.oracle_labels); label it first")
      return size
    return self.fixed

  def largest(self) -> int:
    return max(self.sizes) if self.sizes else self.fixed


def resolve_block_choice(cfg, drafter_block_size: int | None) -> BlockChoice:
  """The `BlockChoice` of `cfg`; a learned policy whose folder is absent falls back to fixed
  (with a message) when `--config.policy_fallback` is set."""
  name = block_policy_of(cfg)
  fixed = cfg.block_size if cfg.mode == "spec" else 1
  if name == "learned" and cfg.get("policy_fallback", False) and not os.path.isdir(cfg.policy):
    print(f"note: no trained block-size policy at {cfg.policy} (make one with train.py "
          "--config.stage=labels,policy); decoding with the fixed block size "
          f"{cfg.block_size} instead")
    name = "fixed"
  if name == "learned":
    return learned_choice(cfg, fixed)
  if name == "oracle":
    from bp_jax.data.label_sets import decode_settings, oracle_table
    settings = decode_settings(cfg.max_new_tokens, cfg.temperature, cfg.get("chat", False),
                               loop_options(cfg), sampling_options(cfg))
    table, sizes = oracle_table(cfg.oracle_labels, cfg.get("label_rule", "max_tau"), settings)
    return BlockChoice(name, fixed, sizes, cfg.seed, oracle=table)
  if name == "random":
    return BlockChoice(name, fixed, random_candidates(cfg, drafter_block_size), cfg.seed)
  return BlockChoice("fixed", fixed)


def learned_choice(cfg, fixed: int) -> BlockChoice:
  """The policy at --config.policy, loaded, as a `learned` choice."""
  from bp_jax.policy.mlp import load_policy
  policy, info = load_policy(cfg.policy)
  return BlockChoice("learned", fixed, info.block_sizes, cfg.seed, policy=policy, info=info)


def random_candidates(cfg, drafter_block_size: int | None) -> tuple[int, ...]:
  """The random control's sizes: --config.block_sizes, or the drafter's size +- POLICY_RADIUS."""
  sizes = parse_int_list(cfg.block_sizes, "--config.block_sizes")
  if not sizes and drafter_block_size is None:
    raise BadInputError("--config.block_policy=random needs --config.block_sizes or a drafter")
  return tuple(sizes or default_block_sizes(drafter_block_size, POLICY_RADIUS))


def loop_options(cfg) -> dict[str, Any]:
  """The decode loops' form set by a config, as `Engine` keyword arguments: `scan_layers`,
  `ar_step_tokens`, `ar_fallback`, `priced_cap`, `ar_fallback_accept`, `verify`, `controller`,
  `controller_costs`, `controller_draft_cost` (None for `measure`), `controller_poor_miss`,
  `controller_decline`, `controller_persist`, `controller_calibration` (the rates of the JSON
  file at that path, None for '') (configs/qwen3.py; checked, a bad value names its flag)."""
  from bp_jax.decoding import controller as control
  from bp_jax.decoding.verify import check_verify_mode
  controller = control.check_controller(str(cfg.get("controller", "backoff")))
  # `backoff` takes fallback steps, `confidence` (`priced`) backs its declined cycles (misses)
  # off up to as many
  # (what label sets record as the loop's form); `none` takes none.
  ar_step_tokens = _config_count(cfg, "ar_step_tokens", 0, "2 where the measured costs price "
                                 "a forward over two tokens below one")
  if ar_step_tokens > 2:
    raise BadInputError(f"--config.ar_step_tokens={ar_step_tokens} must be 0, 1 or 2")
  return {"scan_layers": bool(cfg.get("scan_layers", False)),
          "ar_step_tokens": ar_step_tokens,
          "ar_fallback": (int(cfg.get("ar_fallback", 0))
                          if controller in ("backoff", "confidence", "priced") else 0),
          "priced_cap": (_config_count(cfg, "controller_priced_cap", 0,
                                       "0: ar_fallback, or 64 when that is 0 too")
                         if controller == "priced" else 0),
          "ar_fallback_accept": int(cfg.get("ar_fallback_accept", 1)),
          "verify": check_verify_mode(str(cfg.get("verify", "exact"))),
          "controller": controller,
          **controller_costs(cfg),
          "controller_poor_miss": bool(cfg.get("controller_poor_miss", False)),
          "controller_decline": _config_auto_bool(cfg, "controller_decline"),
          "controller_persist": _config_bool(cfg, "controller_persist", True),
          "controller_calibration": control.load_calibration(
              str(cfg.get("controller_calibration", "") or ""))}


def _config_bool(cfg, key: str, default: bool) -> bool:
  """`--config.<key>`, checked to be true or false (a bad value names its flag)."""
  value = cfg.get(key, default)
  if not isinstance(value, bool):
    raise BadInputError(f"--config.{key}={value!r} must be true or false")
  return value


def _config_auto_bool(cfg, key: str) -> bool | None:
  """`--config.<key>`: true, false or "auto" (None: the engine decides; the default)."""
  value = cfg.get(key, "auto")
  if isinstance(value, str) and value.lower() in ("auto", "true", "false"):
    return {"auto": None, "true": True, "false": False}[value.lower()]
  if not isinstance(value, bool):
    raise BadInputError(f"--config.{key}={value!r} must be true, false or auto")
  return value


def _config_count(cfg, key: str, default: int, zero_means: str) -> int:
  """`--config.<key>`, checked to be an integer >= 0 (not a bool; a bad value names its flag
  and what 0 means)."""
  value = cfg.get(key, default)
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise BadInputError(f"--config.{key}={value!r} must be an integer >= 0 ({zero_means})")
  return value


def labelling_loop_options(cfg) -> dict[str, Any]:
  """`loop_options` in the form label sets are measured under (`controller.labelled_as`:
  `priced` as `backoff` at the same `ar_fallback`; priced's own cap is not part of it)."""
  from bp_jax.decoding.controller import labelled_as
  loop = loop_options(cfg)
  return {**loop, "controller": labelled_as(loop["controller"]), "priced_cap": 0}


MEASURE = "measure"  # --config.controller_costs / controller_draft_cost: measure where it runs


def controller_costs(cfg) -> dict[str, Any]:
  """`controller_costs` and `controller_draft_cost` of a config: both "measure" (the default:
  None, the engine measures them) or both given (checked; a bad value names its flag)."""
  from bp_jax.decoding import controller as control
  costs = cfg.get("controller_costs", MEASURE)
  draft = cfg.get("controller_draft_cost", MEASURE)
  measured = [str(v).strip() == MEASURE for v in (costs, draft)]
  if measured == [True, True]:
    return {"controller_costs": None, "controller_draft_cost": None}
  if any(measured):
    raise BadInputError(f"--config.controller_costs={costs!r} and --config.controller_draft_cost="
                        f"{draft!r}: give both or neither ({MEASURE!r}, the default, measures "
                        "both where the engine runs)")
  return {"controller_costs": control.parse_costs(costs),
          "controller_draft_cost": control.check_draft_cost(draft)}


ONLINE_COSTS = {"auto": None, "on": True, "off": False}


def online_costs(cfg) -> bool | None:
  """`LoopOptions.online_costs` of `--config.controller_online_costs` (auto: None, on, off).
  Host-side only, so not part of `loop_options` (the loops' form label sets record)."""
  value = str(cfg.get("controller_online_costs", "auto")).strip().lower()
  if value not in ONLINE_COSTS:
    raise BadInputError(f"--config.controller_online_costs={value!r} is not one of "
                        f"{list(ONLINE_COSTS)}")
  return ONLINE_COSTS[value]


def batch_options(cfg) -> dict[str, Any]:
  """How many requests decode at once, as `Engine` keyword arguments (checked):
  `batch_size` slots per block-size bucket, `sync_cycles`, the cycles between the host's
  refills of finished slots, `shrink` (--config.shrink_batches: a batch's tail runs in
  fewer slots), `join_learned` (--config.join_learned_sizes: a batch's learned requests
  decode at one size) and `move_plain_after` (--config.move_plain_after: a batch whose cycles
  keep missing moves its requests to the plain bucket; configs/qwen3.py)."""
  from bp_jax.decoding.requests import check_batching
  out = {"batch_size": cfg.get("batch_size", 1), "sync_cycles": cfg.get("sync_cycles", 16)}
  check_batching(**out)
  return {**{k: int(v) for k, v in out.items()},
          "shrink": _config_bool(cfg, "shrink_batches", True),
          "join_learned": _config_bool(cfg, "join_learned_sizes", True),
          "move_plain_after": _config_count(cfg, "move_plain_after", 3, "0 = never")}


def sampling_options(cfg) -> dict[str, Any]:
  """The truncation of the target's distribution set by a config, as `Engine.generate` keyword
  arguments: `top_k`, `top_p`, `min_p` (checked; configs/qwen3.py)."""
  from bp_jax.decoding.requests import check_sampling
  out = {"top_k": int(cfg.get("top_k", 0)), "top_p": float(cfg.get("top_p", 1.0)),
         "min_p": float(cfg.get("min_p", 0.0))}
  check_sampling(0.0, **out)
  return out


def sampling_form(temperature: float, sampling: dict[str, Any]) -> SamplingForm:
  """The `sampling.SamplingForm` a run's requests need: its temperature with `sampling_options`'
  truncation."""
  return form_of([(temperature, sampling["top_k"], sampling["top_p"])])


def block_policy_of(cfg) -> str:
  """The block policy in effect: mode=ar decodes plainly whatever --config.block_policy says."""
  return cfg.block_policy if cfg.mode == "spec" else "fixed"

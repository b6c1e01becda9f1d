"""Compares the speculative loop's verify-length controllers in one process, interleaved.

Every prompt is decoded by every method, `--repeats` times each, the methods' order alternating
from prompt to prompt (forward, then reversed); the fastest decode of each (method, prompt) is
kept. On a shared CPU only the relative figures of one run mean anything.

Methods (`--methods`, comma-separated):
  ar                plain AR decoding with the target (block size 1);
  none              every cycle verifies all b-1 drafts (the paper's loop);
  backoff           none plus the AR fallback (2, 4, ... <= --ar_fallback steps after poor cycles);
  confidence_1step  the confidence controller as first shipped: one AR step after each declined
                    cycle (confidence with ar_fallback = 1);
  confidence        declined cycles back off 2, 4, ... <= --ar_fallback AR steps;
  confidence_poor   confidence, and a cycle verifying > ar_fallback_accept drafts that accepted
                    <= ar_fallback_accept counts as declined too (controller_poor_miss);
  confidence_cal    confidence with the acceptance calibration at --calibration;
  confidence_cal_poor  both;
  priced            backoff with the cost-priced miss rule (`--config.controller=priced`): a
                    cycle is a miss when it committed fewer tokens than it cost AR steps, at the
                    start-up costs throughout (`online_costs=False`); every request drafts
                    first (`start_backoff=False`, as priced_online and priced_long);
  priced_online     priced with its costs kept current from its own timed loop calls
                    (`online_costs=True`: the start-up costs are the prior and the floor,
                    `bp_jax.decoding.online_costs`);
  priced_default    priced_online whose requests (alone or taking a batch's slot) start deep
                    in the back-off where recent requests' drafting lost (`start_backoff=True`,
                    `bp_jax.decoding.start_backoff`; with --start_plain a request alone
                    that would start deep runs the plain AR loop, `Engine.starts_plain`)
                    and whose misses back off up to
                    --priced_cap AR steps: what the default configs decode with
                    (`--config.controller=priced`, costs measured, online costs auto,
                    configs/demo.py's `controller_priced_cap`);
  priced_long       priced whose misses back off up to --long_ar_fallback AR steps (2, 4, ...,
                    64 by default) instead of --ar_fallback: fewer probing cycles where
                    drafting keeps losing;
  priced_default_noplain
                    priced_default whose deep starts stay in the speculative loop
                    (`start_plain=False`): in a batch, the default's requests that would start
                    deep take the plain AR bucket instead (`Scheduler`);
  priced_default_every8
                    priced_default whose batch explorer runs come every 8th run of
                    --batch_size requests whatever they find (`StartBackoff.batch_explore_max`
                    = 8); the default's thin out to one in 32 while its choice holds still;
  priced_default_every4
                    priced_default whose requests decoded alone explore (draft first) every
                    4th deep start whatever they find (`StartBackoff.explore_max` = 4); the
                    default's thin out to one in 16 while its choice stays clearly deep;
  priced_default_margin1
                    priced_default whose requests decoded alone start deep below a cycle's
                    price in AR steps (`StartBackoff.margin` = 1); the default's below 0.8 x
                    it;
  priced_default_bmargin1
                    priced_default whose batch requests draft where the recent cycles commit at
                    least a cycle's price in plain-loop steps (`StartBackoff.batch_margin` = 1;
                    the default's: 1.2 x it);
  priced_default_bmargin0
                    priced_default whose batch requests all draft first once the plain loop
                    is priced (`StartBackoff.batch_margin` = 0.01): each request's own misses,
                    not the recent requests' cycles, move it to the plain bucket
                    (`BatchOptions.move_plain_after`);
  priced_default_bmargin0_move1
                    priced_default_bmargin0 whose requests move after one miss instead of 3;
  priced_default_draftfirst
                    priced_default whose batches weigh the speculative loop's own price as if
                    in plain steps until the plain loop has been timed
                    (`StartBackoff.batch_plain_first` = False); the default's batches start
                    plain then unless drafting is decisive;
  ar_full, priced_default_full
                    ar and priced_default whose batched calls always compute all --batch_size
                    slots (`BatchOptions.shrink=False`); the others run a batch's tail in
                    fewer slots once no request waits (`Scheduler`), as decode.py does;
  priced_default_nomove
                    priced_default whose batched requests stay in their speculative bucket
                    when its cycles keep missing (`BatchOptions.move_plain_after` = 0); the
                    default's move to the plain AR bucket after 3 misses in a row;
  priced_default_movemiss
                    priced_default whose batched requests move to the plain bucket only after
                    missed cycles (`StartBackoff.batch_move` = False); the default's also move
                    once their own cycles so far say plain under the batch's start rule
                    (`Engine.cycles_lose`), where they draft at a loss without missing;
  priced_default_notail
                    priced_default whose batch's tail (no request waiting) stays in its
                    speculative bucket (`StartBackoff.tail_move` = False); the default's tail
                    moves, all its rows, to the plain bucket once its slowest row would end
                    sooner there (`StartBackoff.tail_loses`);
  priced_default_tailany
                    priced_default whose batch's tail moves plain whatever requests are
                    expected to arrive (`StartBackoff.tail_quiet` = inf); the default's moves
                    only while fewer than ln 2 are expected before the plain loop would end it
                    (benchmarks/arrivals.py; a static batch's requests all come first);
  priced_default_nojoin
                    priced_default whose server requests routed plain take the plain bucket
                    even where it holds none and their speculative bucket runs
                    (`StartBackoff.join_live` = False); the default's draft there instead
                    (benchmarks/arrivals.py: a second bucket runs by turns with the first);
  priced_default_fullest
                    priced_default whose server runs the fuller of two buckets holding
                    requests (`StartBackoff.drain_first` = False); the default's runs its
                    plain bucket first where the start rule routes new requests to draft (it
                    only drains);
  priced_default_streak
                    priced_default whose server moves a row plain once its cycles missed
                    `move_plain_after` times in a row (`StartBackoff.misses_judged` = False);
                    the default's also need the row's own cycles so far to say plain;
  priced_default_explorebusy
                    priced_default whose server's plain explorers open the plain bucket
                    whatever requests are expected to arrive (`StartBackoff.explore_lulls` =
                    False); the default's draft instead unless fewer than ln 2 are expected
                    before the explorer would end (a lull);
  priced_default_nofwd
                    priced_default whose batches weigh the speculative loop's own price, plain
                    unless drafting is decisive, until the plain loop has been timed
                    (`StartBackoff.forward_prior` = False); the default's price a cycle in the
                    start-up one-token forward at the batch size meanwhile, at the rule's own
                    margin;
  priced_default_serverstreaks
                    priced_default whose server moves rows plain on streaks of missed cycles
                    (`StartBackoff.server_streaks` = True); the default's server moves only a
                    tail's and an explorer run's rows (static batches move on streaks either
                    way);
  priced_default_explorers
                    priced_default whose batches time the plain loop by plain explorer runs
                    (runs of requests decoding plain where the rule says draft;
                    `StartBackoff.plain_probes` = False); the default's by probes, short plain
                    calls on copies of the drafting rows whose tokens are dropped;
  priced_default_noearlyprobe
                    priced_default whose batches probe their plain loop only where a plain
                    explorer run would begin (`StartBackoff.probe_untimed` = False); the
                    default's, where that loop is precompiled, also after the first full-size
                    speculative call while it is untimed (the start-up forward prices it
                    until then);
  priced_default_nodecline
                    priced_default whose cycles always verify their drafts
                    (`controller_decline=False`); the default's decline a cycle's drafts after
                    the drafter pass where they are not expected to pay for their verify
                    (`bp_jax.decoding.decline`), where the run's costs leave the decline on
                    (a declined cycle saving at least half an AR step,
                    `options.declines_by_costs`: on this CPU, not on an H100 below batch 16;
                    the priced methods above alike);
  priced_default_decline
                    priced_default whose decline is on whatever the costs
                    (`controller_decline=True`): what the default ran before it was left to
                    the costs;
  priced_default_nogate
                    priced_default whose every miss backs the rows off
                    (`controller_persist=False`); the default's misses back off only while the
                    cycles right after misses commit clearly less than cycles on average
                    (`bp_jax.decoding.evidence`; the priced methods above gate too);
  priced_default_nohold
                    priced_default whose prices fit every loop call at once
                    (`OnlineCosts.hold_outliers` = False); the default's hold a call off alone
                    out of the fit until a call like it confirms or refutes a change
                    (`bp_jax.decoding.online_costs`);
  learned_default   priced_default whose requests' block sizes a policy picks from their
                    prefill (--policy, the shipped demo/policy by default; `block_size =
                    LEARNED`, the policy priced by this engine's costs where it has a priced
                    head): what decode.py's demo config decodes with; --block_size is then
                    only the other methods' size;
  learned_fixed     learned_default's own engine decoding every request at --block_size:
                    the learned sizes against a fixed size inside one engine (the same
                    prices and start rule's history, as decode.py's comparison), where two
                    engines of their own part as each follows its own timed calls; its loop
                    calls, compiles and prices are reported under learned_default's engine;
  ar_twin           a second engine identical to ar, interleaved like any method: its ratio
                    to ar and that ratio's interval are what two identical programs read on
                    this machine in this run (the noise floor of every other row's interval);
                    with it the defaults' speedups over both AR engines are reported too
                    (`ar_both`: per unit their mean seconds per new token);
  priced_default_twin
                    a second engine identical to priced_default, with its own prices and
                    start rule: its ratio to priced_default is what two such engines read in
                    this run, their histories parting as each follows its own timed calls
                    (at batch 1 on a 2-core CPU two of them read 0.951-1.078x of each other,
                    docs/results/controller.md);
  ar_padded         our AR with its steps run as two-token forwards (`ar_step_tokens=2`: the
                    same tokens; faster where a one-row matrix product costs more than a
                    two-row one, as on an H200 at Qwen3-4B shapes). On an accelerator `ar`
                    measures that itself and pads where it pays (`Engine._padded`), so there
                    the two are one engine's form twice; on a CPU `ar` does not pad.
  ar_tied, none_tied
                    ar and none with a tied target's output projection contracted with the
                    embedding as stored (`Engine(head_apart=False)`): on a CPU the other
                    methods decode with it stored apart, transposed (`engine.decode_form`);
                    elsewhere the same engines as ar and none.

With --batch_size B > 1 every method decodes the prompts in groups of --group_size consecutive
prompts (default 4B; the same groups for every method, interleaved per group), each group
streamed through B slots with continuous refill (`Engine.generate_batch`: a finished request's
slot takes the next one, as a server's would); the intervals then resample the groups (a
group's requests share its loop calls and its repeat's luck), so a batch row needs many groups
for a narrow interval: a smaller --group_size gives more. --group_size B gives one static batch
per group (every request of a group starts together, the batch's slowest sets its time).
A batch's forward costs the same however many of its rows decode, so the report also counts
each method's target forwards as its batches ran them (`batch_forwards`: by verify length,
every repeat, and their cost in AR steps of the run's table), and every method's loop calls by
block size and slots (`Engine.loop_calls`: calls, seconds, ms per forward), which tell a
method's own overhead (its plain calls at AR's cost per forward, or not) from what its
drafting requests cost. With --hold_costs the default
keeps its start-up prices (no online updates): with given --controller_costs that replays
another machine's prices here, its choices and those counts following them alone (e.g. an
H100's at batch 16: `--controller_costs 1.0,1.03,1.15,1.38,1.90 --controller_draft_cost 0.35`).
With --sim_clock_ms instead, every engine's loop calls are timed by a simulated device's clock
at the given prices (benchmarks/sim_clock.py: per-call noise --sim_clock_noise, a stall of
--sim_clock_stall_s every --sim_clock_stall_every calls): the default's online prices then fit
device-shaped calls as on the device, and the table's speeds are the simulated device's
(deterministic: the same run gives the same figures on any machine). Every method's loop
calls are in the json (`call_logs`; a priced method's with the break-even after each), and each
method's first timed call against its later calls of the same forwards (`first_calls`: a cost
of the run's start shows there).

Intervals: each method's speedup over AR, and those of `PAIRS` where both methods ran (e.g.
`priced`'s over `backoff`, `priced_default`'s over `priced_default_every8`; a default's over
`ar_both`, our AR measured twice, where ar_twin ran), with a 95% paired
bootstrap interval over the requests (batch 1) or the groups (batches) of the fastest decodes
(bp_jax/eval/bootstrap), and the same from the mean of the repeats
(`intervals_mean_of_repeats`): the fastest repeat flatters
a method whose repeats take different paths (the default's start rule moves on between them).
The table's speeds count the loop calls' wall time (a request's `decode_s`); the intervals
end to end (`intervals_end_to_end`, not with a simulated clock) take each group's fastest
repeat by its whole wall time: prefills, insertions and the host's work between loop calls
included (a method's host work between calls leaves an accelerator idle). --warmup_groups N
decodes the first N groups with every method before the timed runs, untimed (a warm engine:
its programs' first uses done, its prices and recent requests learned), and the report counts
Python's garbage collections inside each method's timed loop calls (`gc_in_calls`).
--precompile compiles every engine's programs first, as a server's start-up does (a learned
engine has the most: its policy's sizes and prefill forms), so that no timed request compiles
or collects what compiling left behind.

The confidence methods and priced price their choices with the costs given (--controller_costs with
--controller_draft_cost), or else with costs measured once here on this machine (one target
forward per verify length and one drafter pass at --batch_size, `bp_jax.decoding.costs.
forward_costs`, cached),
the same costs for every method; `est_cost_per_token` uses them too.

Prompts: by default the labelling half of HumanEval under configs/demo.py's split (not the
evaluation half docs/results/controller.md uses). Example:

  python -m benchmarks.controllers --num_prompts 24 --repeats 3 --out /tmp/controllers

Model shapes (`--shape`): the demo's models on HumanEval prompts (the default, ''), or random
bf16 weights of a Qwen3 shape of benchmarks/accelerator.py (`4b`: Qwen3-4B with its z-lab
DFlash drafter's shape; `tiny` for tests) on `--num_prompts` random prompts of `--prompt_len`
tokens. Random weights have no drafter worth the name, so there every speculative method drafts
the SIMULATED acceptance profile of benchmarks/accelerator.py (mean τ `--sim_tau` at b = 16):
the target's own greedy continuation, decoded once by AR, with one wrong token where each drawn
acceptance ends (`accelerator.simulated_continuation` at --block_size, the same tokens for
every method), given as forced drafts (the drafter's full pass is still paid). The continuation
runs --block_size - 1 tokens past --max_new_tokens, so that a request's last cycles draft from
it as every other does: ending at --max_new_tokens, the drafts past it were the random
drafter's own, and a cycle with one token left committed one, a miss no real drafter makes
(the loops count a cycle's accepted drafts, not the tokens kept). Cycles that
start elsewhere than the fixed-size loop's meet the same wrong tokens, so every method sees one
fixed continuation; a forced request never takes a plain start (`Engine.starts_plain`), its
start rule still starts it deep in the speculative loop. T = 0 only. This is issue 19's
accelerator row: on a device, where a long verify costs about one AR step, the default's
choices (the verify-length histogram, its break-even) should move to long verifies. Example:

  python -m benchmarks.controllers --shape 4b --block_size 16 --num_prompts 16 \
    --methods none,priced_default,ar_twin --repeats 2 --batch_size 1 --out out/ctl_4b_b1

At T > 0 (`--temperature`, `--top_k`) prompt i is sampled with seed i by every method; under
`--verify exact` (the default) every method then gives AR's tokens for that seed, which the
`same as AR` column checks. Under `--verify rejection` the tokens depend on the path decoding
takes (which forwards verify how many drafts), so a method whose choices follow timings
(priced_online) may draw other tokens, from the same distribution, on another repeat: repeats are
then not required to agree, and the repeat kept is the one fastest per new token. Example:

  python -m benchmarks.controllers --temperature 1 --drafter demo/drafter_sampling \
    --verify rejection --methods backoff,priced,priced_online --half eval --num_prompts 40
"""

from __future__ import annotations

import collections
import os
import time
from typing import Callable, NamedTuple

import numpy as np
from absl import flags

from benchmarks import accelerator, common
from benchmarks.gc_pauses import GcPauses
from benchmarks.sim_clock import SimClock
from bp_jax import cli, compile_cache
from bp_jax.gc_freeze import freeze_after_startup
from bp_jax.decoding import controller as control
from bp_jax.decode_job.compare import check_repeats_agree
from bp_jax.decoding.call_tally import calls_line, first_call_against_peers, tally_json
from bp_jax.decoding.costs import ForwardCosts, forward_costs
from bp_jax.decoding.engine import LEARNED, Engine, decode_form
from bp_jax.decoding.generation import Generation, forward_cost_units
from bp_jax.decoding.options import BatchOptions, LoopOptions, ShapeOptions
from bp_jax.decoding.sampling import form_of
from bp_jax.eval.bootstrap import speedup_entry as bootstrap_entry
from bp_jax.errors import BadInputError

METHODS = ("ar", "none", "backoff", "confidence_1step", "confidence", "confidence_poor",
           "confidence_cal", "confidence_cal_poor", "priced", "priced_online", "priced_long",
           "priced_default", "priced_default_noplain", "priced_default_every8",
           "priced_default_every4", "priced_default_margin1", "priced_default_bmargin1",
           "priced_default_bmargin0", "priced_default_bmargin0_move1",
           "priced_default_draftfirst", "ar_full",
           "priced_default_full", "ar_twin", "priced_default_nomove", "priced_default_movemiss",
           "priced_default_notail", "priced_default_tail11", "priced_default_tailany",
           "priced_default_nojoin", "priced_default_fullest", "priced_default_streak",
           "priced_default_explorebusy", "priced_default_nofwd", "priced_default_serverstreaks",
           "priced_default_explorers", "priced_default_noearlyprobe", "priced_default_nodecline",
           "priced_default_decline", "priced_default_nogate",
           "priced_default_nohold", "priced_default_twin", "ar_padded", "ar_tied", "none_tied",
           "learned_default", "learned_fixed")
# Methods that decode in another method's engine: method -> that method (which must run too).
SHARED = {"learned_fixed": "learned_default"}

common.define_flags("target", "drafter", "dtype", "max_len", "max_new_tokens", "block_size",
                    num_prompts=24, repeats=3,
                    helps={"num_prompts": "First N prompts of that half (0 = all).",
                           "repeats": "Decodes per (method, prompt); the fastest is kept."})
flags.DEFINE_enum("half", "label", ["label", "eval"], "HumanEval half of configs/demo.py's "
                  "split.")
flags.DEFINE_integer("warmup_groups", 0, "Groups of prompts every method decodes once, untimed, "
                     "before the timed ones (the first groups; 0: none): a warm engine's first "
                     "uses and online prices, and no tally of these calls")
flags.DEFINE_bool("precompile", False, "before the timed runs every engine compiles the programs "
                  "its requests may take (`Engine.precompile`: its sizes and the plain loop, a "
                  "learned engine's policy prefills, at the run's request lengths and sampling "
                  "form; batches: every attention window, each loop run once), as a server's "
                  "start-up does, timed per method (`precompile_s`); then start-up's objects "
                  "are kept out of garbage collections. Not with --shape (its forced drafts "
                  "run loops of their own)")
flags.DEFINE_integer("ar_fallback", 16, "most AR steps in a row of backoff and confidence*")
flags.DEFINE_integer("long_ar_fallback", 64, "most AR steps in a row of priced_long")
flags.DEFINE_integer("priced_cap", 64, "most AR steps in a row of priced_default (configs/"
                     "demo.py's controller_priced_cap; 0: --ar_fallback)")
flags.DEFINE_bool("start_plain", True, "priced_default: a request alone that would start deep "
                  "decodes in the plain AR loop (configs/qwen3.py's controller_start_plain)")
flags.DEFINE_integer("ar_fallback_accept", 1, "a cycle accepting <= this many drafts is poor")
flags.DEFINE_string("methods", ",".join(METHODS[:6]), f"comma-separated, of {list(METHODS)}")
flags.DEFINE_string("calibration", "", "confidence_cal*: calibration JSON "
                    "(python -m benchmarks.controller_calibration --out)")
flags.DEFINE_string("policy", "demo/policy", "learned_default: the block-size policy "
                    "checkpoint (train.py's policy stage; its classes are the sizes it picks)")
flags.DEFINE_integer("batch_size", 1, "requests decoded at once (> 1: groups of --group_size "
                     "prompts streamed through generate_batch)")
flags.DEFINE_integer("group_size", 0, "with --batch_size > 1: prompts per interleaved group, "
                     "streamed through the batch's slots with continuous refill (0 = 4 x "
                     "--batch_size; --batch_size itself = one static batch per group)")
flags.DEFINE_integer("bootstrap_reps", 2000, "bootstrap resamples of the intervals")
flags.DEFINE_string("out", "", "folder for controllers.json (empty: print only)")
flags.DEFINE_string("controller_costs", "", "confidence*: relative costs of target forwards over "
                    "1, 2, 4, ... tokens ('' = measured here; give --controller_draft_cost too)")
flags.DEFINE_float("controller_draft_cost", -1.0, "confidence*: one drafter pass in AR steps "
                   "(< 0 = measured here)")
flags.DEFINE_float("temperature", 0.0, "sampling temperature (0 = greedy); at T > 0 prompt i is "
                   "decoded with seed i by every method, so under --verify=exact every method "
                   "gives AR's tokens (use --drafter demo/drafter_sampling)")
flags.DEFINE_integer("top_k", 0, "top-k of the sampling at T > 0 (0 = the whole vocabulary)")
flags.DEFINE_enum("verify", "exact", ["exact", "rejection"], "verify rule of the speculative "
                  "methods: exact keeps the target's own draw (AR's tokens for a seed), "
                  "rejection samples the target's distribution with other tokens")
flags.DEFINE_enum("shape", "", ["", *accelerator.SHAPES], "'' = the demo's models on HumanEval "
                  "prompts; else random bf16 weights of that shape (benchmarks/accelerator.py) "
                  "on random prompts, every speculative method drafting the SIMULATED "
                  "acceptance profile (--sim_tau)")
flags.DEFINE_integer("prompt_len", 128, "--shape: tokens per random prompt")
flags.DEFINE_float("sim_tau", 6.5, "--shape: mean τ at b = 16 of the SIMULATED acceptance "
                   "profile (benchmarks/accelerator.py)")
flags.DEFINE_bool("profile", False, "after the timed runs, decode the first group once more "
                  "per method under jax.profiler and print its device kernels and "
                  "device-to-host copies per batch target forward (a GPU's stream lines: "
                  "each copy of a loop predicate is a wait of the host for the device; a CPU "
                  "has none to count)")
flags.DEFINE_string("idle_gaps", "", "after the timed runs, our AR decodes the first group "
                    "twice after each of these idle seconds (comma-separated, e.g. 0,0.2,1,3; "
                    "empty: not run): its first loop call's seconds per gap, a cost of a device "
                    "left idle (clocks that fall while it waits) if they grow with the gap")
flags.DEFINE_bool("hold_costs", False, "the default and its variants keep the start-up costs "
                  "(given or measured) instead of updating them from their loop calls: their "
                  "choices then follow those prices alone (with --controller_costs: a replay at "
                  "another machine's prices, counted in `batch_forwards`)")
flags.DEFINE_float("sim_clock_ms", 0.0, "with --controller_costs: every engine's loop calls are "
                   "timed by a simulated device's clock (benchmarks/sim_clock.py) charging "
                   "that table's prices with an AR step of this many ms, so that the online "
                   "prices fit device-shaped calls and the speeds are the simulated device's "
                   "(0: the real clock); batches then keep all their slots, as rows cost "
                   "nothing there")
flags.DEFINE_float("sim_clock_noise", 0.03, "--sim_clock_ms: lognormal sigma of each call's time")
flags.DEFINE_float("sim_clock_stall_s", 0.0, "--sim_clock_ms: seconds added to every "
                   "--sim_clock_stall_every-th loop call of each engine")
flags.DEFINE_integer("sim_clock_stall_every", 0, "--sim_clock_ms: see --sim_clock_stall_s "
                     "(0: no stalls)")
flags.DEFINE_string("cost_cache", "default", "folder caching measured costs ('default' = "
                    "~/.cache/bp_jax/costs, '' = measure every run)")
FLAGS = flags.FLAGS


def parse_methods(text: str) -> list[str]:
  methods = [m.strip() for m in text.split(",") if m.strip()]
  bad = [m for m in methods if m not in METHODS]
  if bad or not methods:
    raise BadInputError(f"--methods={text!r}: give comma-separated methods of {list(METHODS)}")
  return list(dict.fromkeys(["ar"] + methods))  # AR is the reference


# Variants of priced_default that differ only in a `StartBackoff` field, set in `main`: (the
# field, the name of another field whose value it takes, or a value).
START_RULES = {"priced_default_every8": ("batch_explore_max", "batch_explore_every"),
               "priced_default_every4": ("explore_max", "explore_every"),
               "priced_default_margin1": ("margin", 1.0),
               "priced_default_bmargin1": ("batch_margin", 1.0),
               "priced_default_bmargin0": ("batch_margin", 0.01),
               "priced_default_bmargin0_move1": ("batch_margin", 0.01),
               "priced_default_draftfirst": ("batch_plain_first", False),
               "priced_default_movemiss": ("batch_move", False),
               "priced_default_notail": ("tail_move", False),
               "priced_default_tail11": ("tail_margin", 1.1),
               "priced_default_tailany": ("tail_quiet", float("inf")),
               "priced_default_nojoin": ("join_live", False),
               "priced_default_fullest": ("drain_first", False),
               "priced_default_streak": ("misses_judged", False),
               "priced_default_explorebusy": ("explore_lulls", False),
               "priced_default_nofwd": ("forward_prior", False),
               "priced_default_serverstreaks": ("server_streaks", True),
               "priced_default_explorers": ("plain_probes", False),
               "priced_default_noearlyprobe": ("probe_untimed", False)}


def loop_method(method: str) -> str:
  """The method whose loop form `method` decodes with (a `_full` method: its base's;
  `START_RULES`' variants: priced_default's, their start rules set in `main`)."""
  if method in START_RULES or method in ("priced_default_nomove", "priced_default_nohold",
                                          "priced_default_twin", "learned_default",
                                          "learned_fixed"):
    return "priced_default"
  if method in ("ar_twin", "ar_padded", "ar_tied"):
    return "ar"
  if method == "none_tied":
    return "none"
  return method[:-len("_full")] if method.endswith("_full") else method


def engine_options(method: str, costs: dict, default_costs: dict) -> dict:
  """The `LoopOptions` fields of a method (its loop form, with --verify for the speculative
  ones); `costs`: the confidence methods' `controller_costs` and `controller_draft_cost`;
  `default_costs`: the default's (priced_default and its variants): the given costs, or none,
  so that its engine takes the run's measurement (`Engine(measured_costs=...)`) as a user's
  takes its own, and decides from it what a user's does (whether a batch's tail shrinks,
  `Engine.shrink`)."""
  if method == "ar_padded":  # AR steps as two-token forwards (`LoopOptions.ar_step_tokens`)
    return dict(controller="none", ar_step_tokens=2)
  method = loop_method(method)
  fb = dict(ar_fallback_accept=FLAGS.ar_fallback_accept, **costs)
  cal = dict(controller="confidence", ar_fallback=FLAGS.ar_fallback,
             controller_calibration=control.load_calibration(FLAGS.calibration, "--calibration"),
             **fb) if "_cal" in method else {}
  plain = dict(ar_fallback_accept=FLAGS.ar_fallback_accept)
  default = dict(controller="priced", ar_fallback=FLAGS.ar_fallback, priced_cap=FLAGS.priced_cap,
                 online_costs=not FLAGS.hold_costs, start_backoff=True,
                 start_plain=FLAGS.start_plain,
                 ar_fallback_accept=FLAGS.ar_fallback_accept, **default_costs)
  verify = {} if method == "ar" else {"verify": FLAGS.verify}
  return {**verify, **{"ar": dict(controller="none"), "none": dict(controller="none"),
          "backoff": dict(controller="backoff", ar_fallback=FLAGS.ar_fallback, **plain),
          "confidence_1step": dict(controller="confidence", ar_fallback=1, **fb),
          "confidence": dict(controller="confidence", ar_fallback=FLAGS.ar_fallback, **fb),
          "confidence_poor": dict(controller="confidence", ar_fallback=FLAGS.ar_fallback,
                                  controller_poor_miss=True, **fb),
          "confidence_cal": cal, "confidence_cal_poor": dict(cal, controller_poor_miss=True),
          "priced": dict(controller="priced", ar_fallback=FLAGS.ar_fallback, online_costs=False,
                         start_backoff=False, **fb),
          "priced_online": dict(controller="priced", ar_fallback=FLAGS.ar_fallback,
                                online_costs=True, start_backoff=False, **fb),
          "priced_long": dict(controller="priced", ar_fallback=FLAGS.long_ar_fallback,
                              online_costs=False, start_backoff=False, **fb),
          "priced_default": default,
          "priced_default_noplain": dict(default, start_plain=False),
          "priced_default_nodecline": dict(default, controller_decline=False),
          "priced_default_decline": dict(default, controller_decline=True),
          "priced_default_nogate": dict(default, controller_persist=False),
          }[method]}


def learned_policy(methods: list[str]) -> tuple:
  """(the --policy checkpoint's policy, its block sizes) where learned_default runs, else (None,
  ()). Its requests pick sizes from the drafter's own drafts, so not with --shape (forced
  drafts need a fixed size)."""
  if "learned_default" not in methods:
    return None, ()
  if FLAGS.shape:
    raise BadInputError("--methods: learned_default decodes with the drafter's own drafts; "
                        "not with --shape (simulated drafts need a fixed --block_size)")
  from bp_jax.policy.mlp import load_policy
  policy, info = load_policy(FLAGS.policy)
  return policy, tuple(int(b) for b in info.block_sizes)


def move_plain_after(method: str) -> int:
  """The misses in a row after which a method's batched requests move to the plain bucket
  (`BatchOptions.move_plain_after`): none for `_nomove`, one for `_move1`, else the default's."""
  if method.endswith("_nomove"):
    return 0
  return 1 if method.endswith("_move1") else BatchOptions.move_plain_after


def method_order(methods: list[str], index: int) -> list[str]:
  """The methods in the order prompt `index` runs them: forward on even prompts, reversed on
  odd ones."""
  return methods if index % 2 == 0 else methods[::-1]


def method_figures(gens: list[Generation], ar_gens: list[Generation], costs: dict) -> dict:
  """Throughput and acceptance figures of one method's fastest decodes (`costs`: the table
  `est_cost_per_token` prices forwards with)."""
  new = sum(g.new_tokens for g in gens)
  decode_s = sum(g.decode_s for g in gens)
  cycles = [a for g in gens for a in g.acceptance_lengths]
  lengths = [a for g in gens for a in g.forward_lengths]
  verified = [k for g in gens for k in g.verified_drafts]
  units = sum(forward_cost_units(g.forward_verified, costs["controller_costs"],
                                 costs["controller_draft_cost"]) for g in gens)
  return {"new_tokens": new, "decode_s": round(decode_s, 4),
          "decode_tokens_per_s": round(new / max(decode_s, 1e-9), 2),
          "tau_per_cycle": round(float(np.mean(cycles)), 4) if cycles else None,
          "tokens_per_forward": round(float(np.mean(lengths)), 4) if lengths else None,
          "mean_verified_drafts": round(float(np.mean(verified)), 4) if verified else None,
          "drafter_passes": len(verified), "target_forwards": len(lengths),
          "plain_starts": sum(g.plain_start for g in gens),
          "moved_plain": sum(g.moved_plain for g in gens),
          "verify_lengths": verify_lengths(gens),
          "cycles": sum(g.cycles for g in gens), "ar_steps": sum(g.ar_steps for g in gens),
          # The cost table's estimate of this decode in AR steps per committed token.
          "est_cost_per_token": round(units / max(sum(lengths), 1), 4),
          "identical_to_ar": sum(g.output_ids == a.output_ids for g, a in zip(gens, ar_gens))}


class Setup(NamedTuple):
  """What every method decodes: the models, the prompts ((key, token ids)), the stop ids and
  the engines' static shapes (cache length, prompt length buckets: None for the defaults)."""
  target: object
  drafter: object
  prompts: list[tuple[str, list[int]]]
  stop_ids: tuple[int, ...]
  max_len: int
  length_buckets: tuple[int, ...] | None
  label: str  # how the report names the prompts


def load_setup() -> Setup:
  """The demo's models on HumanEval prompts, or with --shape random weights of that shape on
  random prompts (see the module doc)."""
  if not FLAGS.shape:
    target, drafter, tok, stop_ids = common.load_models(FLAGS)
    return Setup(target, drafter, common.demo_prompts(tok, FLAGS.half, limit=FLAGS.num_prompts),
                 tuple(stop_ids), FLAGS.max_len, None, f"HumanEval {FLAGS.half}-half prompts")
  if FLAGS.temperature > 0:
    raise BadInputError(f"--shape={FLAGS.shape}: the simulated drafts are greedy; give "
                        "--temperature=0")
  if FLAGS.prompt_len < 1 or FLAGS.num_prompts < 0:
    raise BadInputError("--prompt_len must be >= 1 and --num_prompts >= 0")
  target, drafter = accelerator.build_models(accelerator.SHAPES[FLAGS.shape],
                                             accelerator.Options.residual_scale, seed=0)
  rng = np.random.default_rng(0)
  V = target.cfg.vocab_size
  prompts = [(f"random:{i}", [int(t) for t in rng.integers(0, V, FLAGS.prompt_len)])
             for i in range(FLAGS.num_prompts or 16)]
  return Setup(target, drafter, prompts, (), FLAGS.prompt_len + FLAGS.max_new_tokens +
               FLAGS.block_size, (FLAGS.prompt_len,),
               f"random {FLAGS.prompt_len}-token prompts ({FLAGS.shape} shapes, SIMULATED "
               f"drafts: tau {FLAGS.sim_tau:g} at b=16)")


def simulated_drafts(ar_engine: Engine, setup: Setup) -> dict[str, list[int]]:
  """Each prompt key's forced drafts under --shape: its greedy continuation (decoded once by
  `ar_engine`) with one wrong token where each drawn acceptance ends (module doc)."""
  probs = accelerator.stretched_profile(accelerator.demo_survival(), FLAGS.sim_tau)
  rng, tail_rng = np.random.default_rng(1), np.random.default_rng(2)
  # Past --max_new_tokens by the drafts a request's last cycle may verify (module doc).
  gens = ar_engine.generate_batch([ids for _, ids in setup.prompts],
                                  max_new_tokens=FLAGS.max_new_tokens + FLAGS.block_size - 1,
                                  block_size=1)
  # The cycles a continuation cut at --max_new_tokens would draw keep their draws (the same
  # as before the tail); the cycles past them draw apart.
  return {key: accelerator.simulated_continuation(g.output_ids, FLAGS.block_size, probs,
                                                  setup.target.cfg.vocab_size, rng,
                                                  tail_from=FLAGS.max_new_tokens - 1,
                                                  tail_rng=tail_rng)[0]
          for (key, _), g in zip(setup.prompts, gens)}


def verify_lengths(gens: list[Generation]) -> dict[str, int]:
  """Target forwards by what they verified: "ar" (an AR step, no drafter pass) and "k=n" (n
  drafts after a drafter pass), in that order."""
  return common.by_verify_length(collections.Counter(v for g in gens for v in g.forward_verified))


def batch_forwards(engine: Engine, costs: dict) -> dict:
  """The target forwards `engine`'s loop calls ran, each over all its slots, every repeat
  (`Engine.forwards_run`: a batch's forward counts once however many rows decode), by verify
  length, and their cost in AR steps of the run's table (`forward_cost_units`): what a batch
  pays, where `est_cost_per_token` counts each row's forwards."""
  counts = engine.forwards_run
  units = forward_cost_units(list(counts.elements()), costs["controller_costs"],
                             costs["controller_draft_cost"])
  return {"by_verify_length": common.by_verify_length(counts), "cost": round(units, 1)}


def controller_costs(target, drafter, max_len: int
                     ) -> tuple[dict, str, ForwardCosts | None]:
  """(the confidence methods' cost fields, "given" | "measured" | "cached", the measurement):
  the flags' costs (no measurement), or those measured once on this machine at
  b = --block_size, --batch_size rows."""
  given = bool(FLAGS.controller_costs), FLAGS.controller_draft_cost >= 0
  if any(given):
    if not all(given):
      raise BadInputError("--controller_costs and --controller_draft_cost: give both or neither")
    return {"controller_costs": control.parse_costs(FLAGS.controller_costs, "--controller_costs"),
            "controller_draft_cost": FLAGS.controller_draft_cost}, "given", None
  measured, hit = forward_costs(target, drafter, FLAGS.batch_size, FLAGS.block_size, max_len,
                                cache_dir=FLAGS.cost_cache)
  print(f"  {measured.describe()}")
  table, draft = measured.relative()
  return ({"controller_costs": table, "controller_draft_cost": draft},
          "cached" if hit else "measured", measured)


def precompile(engines: dict[str, Engine], methods: list[str], size: dict, prompts: list
               ) -> dict[str, float]:
  """Seconds each method's engine took to compile what its requests may take (`--precompile`):
  its block size (a learned engine: the sizes its requests decode at, `Engine.learned_sizes`,
  and policy prefills; an engine another
  method shares, `SHARED`: that method's too), at every prompt's
  length + --max_new_tokens, in the run's sampling form, each loop also run once (its untimed
  first runs: `Engine.precompile`'s `warm` at batch 1, `all_windows` in a batch), so that no
  timed request holds one; then start-up's objects are frozen out of garbage collections
  (`bp_jax.gc_freeze`), as a server's are."""
  form = form_of([(FLAGS.temperature, FLAGS.top_k, 1.0, 0.0)])
  lengths = [len(ids) + FLAGS.max_new_tokens for _, ids in prompts]
  secs = {}
  for m in methods:
    if m in SHARED:  # its sizes compile in its owner's engine
      continue
    users = [m] + [u for u, owner in SHARED.items() if owner == m and u in methods]
    sizes = {b for u in users
             for b in (engines[m].learned_sizes if size[u] == LEARNED else (size[u],))}
    learned = any(size[u] == LEARNED for u in users)
    t0 = time.perf_counter()
    engines[m].precompile(sorted(sizes), policy=learned,
                          plain_prefill=any(size[u] != LEARNED for u in users),
                          request_lengths=lengths, all_windows=FLAGS.batch_size > 1,
                          forms=(form,), warm=True)
    secs[m] = round(time.perf_counter() - t0, 2)
  frozen = freeze_after_startup()
  print("  precompiled (s): " + ", ".join(f"{m} {s:.1f}" for m, s in secs.items())
        + f"; {frozen:,} objects kept out of garbage collections", flush=True)
  return secs


def warm_up(engines: dict[str, Engine], methods: list[str], groups: list, size: dict,
            forced: dict, group_size: int) -> None:
  """Every method decodes `groups` once, untimed, in the timed runs' order (`--warmup_groups`):
  what a warm engine has done before (each program's first uses, the online prices, the start
  rule's recent requests) without its tallies (`Engine.clear_tallies`); then what start-up made
  is frozen out of garbage collections, as a server's is."""
  for i, group in enumerate(groups):
    for m in method_order(methods, i):
      decode_group(engines[m], group, size[m], i * group_size, forced[m])
  if groups:
    for m in methods:
      engines[m].clear_tallies()
    frozen = freeze_after_startup()  # as a server does after its warm-up (`bp_jax.gc_freeze`)
    print(f"  warm-up: {len(groups)} group(s) decoded by every method, untimed; {frozen:,} "
          "objects kept out of garbage collections", flush=True)


def decode_group(engine: Engine, group: list, block_size: int, first: int,
                 forced: dict[str, list[int]] | None = None) -> list[Generation]:
  """One group of prompts decoded by `engine`: one request alone, or a batch; the group's
  prompts are prompts `first`, `first` + 1, ... of the run, each sampled with its index as
  seed (every method alike); `forced`: each prompt key's forced drafts (None: the drafter's)."""
  kw = dict(max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature,
            top_k=FLAGS.top_k, block_size=block_size)
  conts = None if forced is None else [forced[key] for key, _ in group]
  if len(group) == 1:
    return [engine.generate(group[0][1], seed=first, **kw,
                            forced_continuation=None if conts is None else conts[0])]
  return engine.generate_batch([ids for _, ids in group], seeds=first, **kw,
                               forced_continuations=conts)


def profiled(engine: Engine, group: list, block_size: int,
             forced: dict[str, list[int]] | None) -> dict:
  """`accelerator.profile_counts` of one more decode of `group` by `engine`, per target
  forward its batches ran (`Engine.forwards_run`: a batch's forward counts once): the device
  kernels and device-to-host copies (on a GPU each evaluated predicate of a data-dependent
  loop copies to the host and waits) per forward, under "cycles" the forwards."""
  def run() -> int:
    before = sum(engine.forwards_run.values())
    decode_group(engine, group, block_size, 0, forced)
    return max(sum(engine.forwards_run.values()) - before, 1)
  return accelerator.profile_counts(run)


def idle_gaps(engine: Engine, group: list, gaps: list[float], reps: int = 2
              ) -> dict[str, list[float]]:
  """Seconds of the first loop call of `reps` decodes of `group` by `engine` (a plain AR
  engine: every decode replays the same calls) after each idle gap in `gaps` (seconds the host
  sleeps first), by gap."""
  out: dict[str, list[float]] = {}
  for gap in gaps:
    for _ in range(reps):
      time.sleep(gap)
      before = len(engine.call_log)
      decode_group(engine, group, 1, 0)
      out.setdefault(f"{gap:g}", []).append(round(engine.call_log[before].seconds, 5))
  return out


def seconds_per_token(gens: list[Generation]) -> float:
  """Decode seconds per new token of one repeat of a group: the repeat kept is the fastest by
  this (by its seconds alone when repeats give the same tokens)."""
  return sum(g.decode_s for g in gens) / max(sum(g.new_tokens for g in gens), 1)


def mean_of_repeats(repeats: list[list[Generation]]) -> tuple[int, float]:
  """(new tokens per repeat, mean decode seconds) of one group's repeats. The fastest repeat
  flatters a method whose repeats take different paths: the default's start rule moves on
  between repeats, so a request's fastest repeat is mostly one that did not explore (batch 1,
  T = 1: 80 of 82 kept decodes plain against 183 of 246; docs/results/controller.md)."""
  tokens = [sum(g.new_tokens for g in r) for r in repeats]
  return int(round(float(np.mean(tokens)))), float(np.mean([sum(g.decode_s for g in r)
                                                             for r in repeats]))


# The speedups between methods the report gives besides each method's over AR, where both ran.
PAIRS = (("priced", "backoff"), ("priced_online", "priced"), ("priced_long", "priced"),
         ("priced_default", "priced_online"), ("priced_default", "priced_default_full"),
         ("priced_default_full", "ar_full"), ("priced_default", "priced_default_noplain"),
         ("priced_default", "priced_default_every8"), ("priced_default", "priced_default_every4"),
         ("priced_default", "priced_default_margin1"),
         ("priced_default", "priced_default_bmargin1"), ("priced_default_bmargin1", "backoff"),
         ("priced_default", "priced_default_bmargin0"), ("priced_default_bmargin0", "backoff"),
         ("priced_default_bmargin0_move1", "priced_default_bmargin0"),
         ("priced_default_bmargin0_move1", "backoff"),
         ("priced_default", "priced_default_draftfirst"),
         ("priced_default", "priced_default_nomove"),
         ("priced_default", "priced_default_movemiss"),
         ("priced_default", "priced_default_notail"),
         ("priced_default", "priced_default_tailany"),
         ("priced_default", "priced_default_nojoin"),
         ("priced_default", "priced_default_fullest"),
         ("priced_default", "priced_default_streak"),
         ("priced_default", "priced_default_explorebusy"),
         ("priced_default", "priced_default_nofwd"),
         ("priced_default", "priced_default_serverstreaks"),
         ("priced_default", "priced_default_explorers"),
         ("priced_default", "priced_default_noearlyprobe"),
         ("priced_default", "priced_default_nodecline"),
         ("priced_default", "priced_default_decline"),
         ("priced_default", "priced_default_nogate"), ("priced_default", "none"),
         ("priced_default", "priced_default_nohold"),
         ("priced_default", "ar_padded"), ("ar", "ar_tied"), ("none", "none_tied"),
         ("priced_default", "ar_twin"), ("priced_default", "backoff"),
         ("priced_default_twin", "priced_default"), ("learned_default", "priced_default"),
         ("learned_default", "learned_fixed"), ("learned_fixed", "priced_default"))


# Our AR measured twice (`ar` and `ar_twin`, identical engines): per unit, their mean seconds per
# new token. A default's speedup over it is the mean of its speedups over each, and does not take
# the faster or the slower of two engines that differ only by the run's luck.
AR_BOTH = "ar_both"
DEFAULTS = ("priced_default", "learned_default")


def method_pairs(methods: list[str]) -> list[tuple[str, str]]:
  """(a, b) for each speedup a / b reported: every method over AR, then the `PAIRS` that ran,
  then each default's over both AR engines (`AR_BOTH`) where ar_twin ran."""
  both = [(m, AR_BOTH) for m in DEFAULTS if m in methods and "ar_twin" in methods]
  return ([(m, "ar") for m in methods if m != "ar"]
          + [(a, b) for a, b in PAIRS if a in methods and b in methods] + both)


def with_ar_both(fig: Callable[[str], tuple[list, list]]) -> Callable[[str], tuple[list, list]]:
  """`fig` (method -> its [units] new tokens and seconds) that also gives `AR_BOTH`: ar's tokens
  at the mean of ar's and ar_twin's seconds per new token, unit by unit."""
  def both(m: str) -> tuple[list, list]:
    if m != AR_BOTH:
      return fig(m)
    (tokens, secs), (twin_tokens, twin_secs) = fig("ar"), fig("ar_twin")
    return tokens, [t * (s / max(t, 1) + ts / max(tt, 1)) / 2
                    for t, s, tt, ts in zip(tokens, secs, twin_tokens, twin_secs)]
  return both


def speedup_entry(a: tuple[list, list], b: tuple[list, list]) -> dict:
  """a's speedup over b from paired (new tokens, seconds) per unit, with its 95% bootstrap
  interval (none for one unit)."""
  return bootstrap_entry(*a, *b, reps=FLAGS.bootstrap_reps)


def group_speedups(per_group: dict[str, list[tuple[int, float]]], methods: list[str]) -> dict:
  """The speedups of `method_pairs` from each method's (new tokens, seconds) per group (e.g.
  the mean of its repeats), with 95% paired bootstrap intervals over the groups (one request
  each at batch 1)."""
  fig = with_ar_both(lambda m: ([t for t, _ in per_group[m]], [s for _, s in per_group[m]]))
  return {f"{a}/{b}": speedup_entry(fig(a), fig(b)) for a, b in method_pairs(methods)}


def intervals(groups: dict[str, list[list[Generation]]], methods: list[str],
              batched: bool) -> dict:
  """The speedups of `method_pairs` (each method's over AR, and the `PAIRS` that ran) of the
  fastest decodes, with 95% paired bootstrap intervals over the requests decoded alone, or
  over the groups when `batched`: a group's requests ran in the same loop calls, in the same
  repeat, so they share that run's luck on a machine whose speed moves between runs;
  resampling them one by one as if independent gave intervals too narrow to trust (batch 8,
  T = 1: 0.851x [0.835, 0.868] in the table, 0.970x per loop call measured another way;
  docs/results/controller.md)."""
  if batched:
    fig = lambda m: ([sum(g.new_tokens for g in grp) for grp in groups[m]],
                     [sum(g.decode_s for g in grp) for grp in groups[m]])
  else:
    fig = lambda m: ([g.new_tokens for grp in groups[m] for g in grp],
                     [g.decode_s for grp in groups[m] for g in grp])
  fig = with_ar_both(fig)
  return {f"{a}/{b}": speedup_entry(fig(a), fig(b)) for a, b in method_pairs(methods)}


class Engines(NamedTuple):
  """Each method's engine (methods in `SHARED` share their owner's), the methods owning one
  (`own`), each method's block size (1, --block_size or `LEARNED`), its forced drafts (None:
  the drafter's) and under --shape the simulated drafts (else None)."""
  by_method: dict[str, Engine]
  own: list[str]
  size: dict[str, int | str]
  forced: dict[str, dict | None]
  sim: dict[str, list[int]] | None


def build_engines(methods: list[str], setup: Setup, target, costs: dict, source: str,
                  measured: ForwardCosts | None) -> Engines:
  """The run's engines from the flags (`target`: the decode form of `setup.target`; `costs`,
  `source`, `measured`: `controller_costs`), with --sim_clock_ms each on its own simulated
  clock (one noise sequence for all, call by call), their call logs and tallies empty."""
  drafter = setup.drafter
  default_costs = costs if source == "given" else {}
  tied = lambda m: m.endswith("_tied")
  learned = learned_policy(methods)
  policy_of = lambda m: learned if m == "learned_default" else (None, ())
  engines = {m: Engine(setup.target if tied(m) else target, stop_ids=setup.stop_ids,
                       drafter=drafter, head_apart=False if tied(m) else None,
                       # learned_default's sizes reach past --block_size: it measures its
                       # own start-up costs, as decode.py's engine does (cached likewise).
                       measured_costs=None if m == "learned_default" else measured,
                       cost_cache=FLAGS.cost_cache,
                       policy=policy_of(m)[0], policy_sizes=policy_of(m)[1],
                       shapes=ShapeOptions(max_len=setup.max_len,
                                           length_buckets=setup.length_buckets,
                                           block_sizes=tuple(sorted(
                                               {1, FLAGS.block_size, *policy_of(m)[1]}))),
                       loop=LoopOptions(**engine_options(m, costs, default_costs)),
                       batching=BatchOptions(batch_size=FLAGS.batch_size,
                                             shrink=not (m.endswith("_full")
                                                         or FLAGS.sim_clock_ms),
                                             move_plain_after=move_plain_after(m)))
             for m in methods if m not in SHARED}
  engines.update({m: engines[owner] for m, owner in SHARED.items() if m in methods})
  own = [m for m in methods if m not in SHARED]  # one name per engine, for its own tallies
  for variant, (field, value) in START_RULES.items():
    if variant in engines:
      starts = engines[variant].starts
      setattr(starts, field, getattr(starts, value) if isinstance(value, str) else value)
  # Before the call logs and simulated clocks start: AR's decode of the continuations is no
  # part of its tallies, nor of its clock's noise and stalls.
  sim = simulated_drafts(engines["ar"], setup) if FLAGS.shape else None
  engines["ar"].clear_tallies()
  for m in methods:  # every loop call (the priced methods' with their prices after each)
    engines[m].call_log = []
  if "priced_default_nohold" in engines:
    engines["priced_default_nohold"].prices.hold_outliers = False
  if FLAGS.sim_clock_ms:
    if source != "given":
      raise BadInputError("--sim_clock_ms needs the device's prices: give --controller_costs "
                          "and --controller_draft_cost")
    for m in methods:  # one noise sequence for all, call by call
      engines[m].clock = SimClock(engines[m], costs["controller_costs"],
                                  costs["controller_draft_cost"], FLAGS.sim_clock_ms,
                                  FLAGS.sim_clock_noise, FLAGS.sim_clock_stall_s,
                                  FLAGS.sim_clock_stall_every)
      if engines[m].prices is not None:  # as an engine that measured its one-token forward
        engines[m].prices.set_ar_step_floor(FLAGS.sim_clock_ms * 1e-3, FLAGS.batch_size)
  size = {m: 1 if loop_method(m) == "ar" else LEARNED if m == "learned_default"
          else FLAGS.block_size for m in methods}
  forced = {m: None if size[m] == 1 else sim for m in methods}
  return Engines(engines, own, size, forced, sim)


def check_run_flags() -> None:
  """The flags every run of these engines needs right (here and benchmarks/arrivals.py)."""
  if FLAGS.repeats < 1 or FLAGS.max_new_tokens < 1 or FLAGS.block_size < 2:
    raise BadInputError("--repeats and --max_new_tokens must be >= 1, --block_size >= 2")
  if FLAGS.precompile and FLAGS.shape:
    raise BadInputError("--precompile with --shape: the forced drafts' loops are programs of "
                        "their own that precompile does not build; give one or the other")
  if FLAGS.warmup_groups < 0:
    raise BadInputError(f"--warmup_groups must be >= 0, got {FLAGS.warmup_groups}")


def main(_):
  methods = parse_methods(FLAGS.methods)
  check_run_flags()
  for m, owner in SHARED.items():
    if m in methods and owner not in methods:
      raise BadInputError(f"--methods: {m} decodes in {owner}'s engine; add {owner}")
  if FLAGS.group_size and FLAGS.group_size < FLAGS.batch_size:
    raise BadInputError(f"--group_size={FLAGS.group_size}: give 0 (4 x --batch_size) or at "
                        f"least --batch_size={FLAGS.batch_size}")
  started = time.perf_counter()
  setup = load_setup()
  # The form every engine decodes with (a tied head apart on a CPU), measured as it runs.
  target, drafter, prompts = decode_form(setup.target), setup.drafter, setup.prompts
  costs, source, measured = controller_costs(target, drafter, setup.max_len)
  print(f"  controller costs ({source}): verify {costs['controller_costs']}, drafter "
        f"{costs['controller_draft_cost']} ({time.perf_counter() - started:.0f} s since start)",
        flush=True)
  engines, own, size, forced, sim = build_engines(methods, setup, target, costs, source,
                                                  measured)
  # Outputs that do not depend on the path decoding takes (greedy, or `exact` at T > 0): every
  # repeat must give the same tokens. Under `rejection` at T > 0 a method whose choices follow
  # timings (priced_online) draws other tokens, from the same distribution, on another repeat.
  path_free = FLAGS.temperature == 0 or FLAGS.verify == "exact"
  B = FLAGS.batch_size
  G = 1 if B == 1 else FLAGS.group_size or 4 * B
  groups = [prompts[i:i + G] for i in range(0, len(prompts), G)]
  best: dict[str, list[list[Generation]]] = {m: [] for m in methods}
  # Per group: (new tokens, mean decode seconds over the repeats) of each method.
  means: dict[str, list[tuple[int, float]]] = {m: [] for m in methods}
  # Requests that took the speculative loop (not a plain start, nor a learned pick of size 1),
  # over every repeat.
  drafted = {m: 0 for m in methods if loop_method(m) != "ar"}
  # Per method and group, each repeat's (new tokens, decode seconds, requests that drafted,
  # requests moved to the plain bucket, wall seconds end to end), in the order run: one
  # repeat's methods ran together.
  per_repeat: dict[str, list[list[list]]] = {m: [] for m in methods}
  # Per group: (new tokens, wall seconds end to end) of each method's fastest repeat by them.
  walled: dict[str, list[tuple[int, float]]] = {m: [] for m in methods}
  precompile_s = precompile(engines, methods, size, prompts) if FLAGS.precompile else {}
  warm_up(engines, methods, groups[:FLAGS.warmup_groups], size, forced, G)
  compiled_before = {m: engines[m].compiled.total for m in own}  # what the timed runs compile
  xla_built = {m: 0 for m in methods}  # and any XLA program, eager ops' included
  pauses = GcPauses().start()  # Python's collections during the timed runs
  for i, group in enumerate(groups):
    runs: dict[str, list[list[Generation]]] = {m: [] for m in methods}
    walls: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(FLAGS.repeats):
      for m in method_order(methods, i):
        built, t0 = compile_cache.programs_built(), time.perf_counter()
        runs[m].append(decode_group(engines[m], group, size[m], i * G, forced[m]))
        walls[m].append(time.perf_counter() - t0)
        xla_built[m] += compile_cache.programs_built() - built
    for m in methods:
      if path_free:
        for j in range(len(group)):
          check_repeats_agree([r[j] for r in runs[m]])
      best[m].append(min(runs[m], key=seconds_per_token))
      if m in drafted:
        drafted[m] += sum(g.block_size > 1 and not g.plain_start for run in runs[m]
                          for g in run)
      means[m].append(mean_of_repeats(runs[m]))
      per_repeat[m].append([[sum(g.new_tokens for g in r), round(sum(g.decode_s for g in r), 5),
                             sum(not g.plain_start and g.drafter_passes > 0 for g in r),
                             sum(g.moved_plain for g in r), round(wall, 5)]
                            for r, wall in zip(runs[m], walls[m])])
      walled[m].append(min(((sum(g.new_tokens for g in r), wall)
                            for r, wall in zip(runs[m], walls[m])),
                           key=lambda tw: tw[1] / max(tw[0], 1)))
    print(f"  {i + 1}/{len(groups)} {', '.join(k for k, _ in group)} "
          f"({time.perf_counter() - started:.0f} s since start)", flush=True)
  pauses.stop()
  flat = {m: [g for grp in best[m] for g in grp] for m in methods}
  rows = {m: method_figures(flat[m], flat["ar"], costs) for m in methods}
  cis = intervals(best, methods, batched=B > 1)
  ar_rate = rows["ar"]["decode_tokens_per_s"]
  for r in rows.values():
    r["speedup_vs_ar"] = round(r["decode_tokens_per_s"] / ar_rate, 3)
  sampling = (f"T={FLAGS.temperature:g}" + (f", top_k {FLAGS.top_k}" if FLAGS.top_k else "") +
              f", verify {FLAGS.verify}" if FLAGS.temperature > 0 else "T=0")
  print(f"\n  {len(prompts)} {setup.label}, {sampling}, "
        f"{FLAGS.max_new_tokens} new tokens, b={FLAGS.block_size}, batch {B}"
        f"{f' (groups of {G} streamed)' if B > 1 else ''}, fastest of "
        f"{FLAGS.repeats}, interleaved (alternating order)")
  print(f"  {'method':<17}{'tok/s':>9}{'vs AR':>7}{'tau/cycle':>10}{'tok/fwd':>8}"
        f"{'k mean':>7}{'drafts':>7}{'AR steps':>9}{'plain':>6}{'est cost/tok':>13}"
        f"{'same as AR':>11}")
  fmt = lambda x, s: "-" if x is None else format(x, s)
  for m, r in rows.items():
    print(f"  {m:<17}{r['decode_tokens_per_s']:>9,.0f}{r['speedup_vs_ar']:>6.2f}x"
          f"{fmt(r['tau_per_cycle'], '.2f'):>10}{fmt(r['tokens_per_forward'], '.2f'):>8}"
          f"{fmt(r['mean_verified_drafts'], '.2f'):>7}{r['drafter_passes']:>7}"
          f"{r['ar_steps']:>9}{r['plain_starts'] if loop_method(m) != 'ar' else '-':>6}"
          f"{r['est_cost_per_token']:>13.3f}"
          f"{r['identical_to_ar']:>8}/{len(prompts)}")
  for m, r in rows.items():
    if m != "ar" and r["verify_lengths"]:
      print(f"  {m} target forwards by verify length: "
            + ", ".join(f"{k} {c}" for k, c in r["verify_lengths"].items()))
  resampled = (f"{len(groups)} group{'s' if len(groups) != 1 else ''} of up to {G} requests"
               if B > 1 else f"{len(prompts)} requests")
  print(f"  speedups, 95% paired bootstrap intervals over {resampled}:")
  mean_cis = group_speedups(means, methods)
  # End to end (a simulated clock times the loop calls alone): each group's wall time, its
  # prefills, insertions and the host's work between loop calls included.
  wall_cis = {} if FLAGS.sim_clock_ms else group_speedups(walled, methods)
  width = max((len(p) for p in cis), default=0) + 2
  for label, table in (("fastest of each", cis), ("mean of the repeats", mean_cis),
                       ("end to end: each group's fastest wall time, prefill and the host's "
                        "work between calls included", wall_cis)):
    if (FLAGS.repeats < 2 and table is mean_cis) or not table:
      continue
    print(f"    ({label})")
    for pair, c in table.items():
      ci = "(one unit: no interval)" if c["lo"] is None else f"[{c['lo']:.3f}, {c['hi']:.3f}]"
      print(f"    {pair:<{width}}{c['ratio']:.3f}x {ci}")
  if drafted:
    print("  requests that took the speculative loop (not a plain start nor size 1), every "
          "repeat: " + ", ".join(f"{m} {n}/{len(prompts) * FLAGS.repeats}"
                                 for m, n in drafted.items()))
  # learned_default's fastest decodes by the block size each request decoded with (1: the
  # policy's plain pick) and by the policy's own pick (none where a batch routed the request
  # plain before its prefill, `Engine.routes_learned_early`).
  learned_sizes = ({key: dict(sorted(collections.Counter(
      str(getattr(g, attr)) for grp in best["learned_default"] for g in grp
      if getattr(g, attr) is not None).items()))
      for key, attr in (("used", "block_size"), ("picked", "policy_block_size"))}
      if "learned_default" in methods else {})
  if learned_sizes:
    unpicked = sum(g.policy_block_size is None for grp in best["learned_default"] for g in grp)
    print(f"  learned_default block sizes (fastest decodes): used {learned_sizes['used']}, "
          f"the policy's picks {learned_sizes['picked']}"
          + (f" ({unpicked} routed plain before their policy ran)" if unpicked else ""))
  slot_use = {m: engines[m].slot_use for m in own if engines[m].slot_use is not None}
  if slot_use:  # batches: the idle slots (e.g. each group's tail) cost as much as busy ones
    print("  slot use (share of batched slot time holding a decoding request, every repeat): "
          + ", ".join(f"{m} {u:.3f}" for m, u in slot_use.items()))
  calls = {m: tally_json(engines[m].loop_calls) for m in own}
  print("  loop calls by block size x slots, every repeat (a batched forward counts once):")
  for m, c in calls.items():
    print(f"    {m}: {calls_line(c)}")
  compiles = {m: engines[m].compiled.summary() for m in own}
  timed_compiles = {m: engines[m].compiled.total - compiled_before[m] for m in own}
  print("  compiled programs (count, seconds; programs taken from an engine built before): "
        + ", ".join(f"{m} {c['compilations']}, {c['compile_s']:.1f} s"
                    + (f" ({c['shared_programs']} shared)" if c["shared_programs"] else "")
                    for m, c in compiles.items()))
  print("  programs compiled during the timed runs (a first use there: its compile and first "
        "run in that repeat's wall time): "
        + ", ".join(f"{m} {n}" for m, n in timed_compiles.items()))
  print("  XLA programs built during the timed runs (any jit or eager op's first use, the "
        "engine's programs included): " + ", ".join(f"{m} {n}" for m, n in xla_built.items()))
  shrinks = {m: engines[m].shrink for m in methods if B > 1 and size[m] != 1}
  if shrinks:  # the engine's rule (`Engine.shrink`): where rows cost, a tail runs fewer slots
    print("  batch tails shrink: " + ", ".join(f"{m} {'yes' if v else 'no'}"
                                               for m, v in shrinks.items()))
  batched = {m: batch_forwards(engines[m], costs) for m in own} if B > 1 else {}
  if batched:
    print("  the batches' target forwards, every repeat (cost in AR steps of the table): "
          + "; ".join(f"{m} " + ", ".join(f"{k} {c}" for k, c in b["by_verify_length"].items())
                      + f" ({b['cost']:,.1f})" for m, b in batched.items()))
  online = {m: engines[m].cost_estimate for m in own
            if m.startswith("priced") or m == "learned_default"}
  for m, est in online.items():
    for rows_, e in est["by_batch_size"].items():
      print(f"  {m} cost estimate (batch {rows_}, {e['calls']} calls): break-even "
            f"{e['break_even']} AR steps, AR step {e['ar_step_s']} s")
  # Collections inside timed calls, by the calls' wall clock (a simulated clock has none).
  gc_in_calls = ({} if FLAGS.sim_clock_ms else
                 {m: pauses.inside(engines[m].call_log) for m in own})
  if gc_in_calls:
    print("  Python GC collections inside timed loop calls (count, ms, longest; of the oldest "
          "generation): " + ", ".join(f"{m} {g['count']}, {g['ms']:.1f}, {g['max_ms']:.1f}; "
                                      f"{g['oldest']}" for m, g in gc_in_calls.items()))
  call_logs = {m: [c.to_json() for c in engines[m].call_log] for m in own
               if engines[m].call_log}
  first_calls = {m: first_call_against_peers(engines[m].call_log) for m in call_logs}
  first_calls = {m: f for m, f in first_calls.items() if f}
  if first_calls:  # a start-of-run cost (the H200's first timed calls ran 15-40 ms long)
    print("  first timed loop call against the later calls of the same forwards (ms, their "
          "median, how many): " + ", ".join(
              f"{m} {1e3 * f['first_s']:.1f} vs {1e3 * f['peers_median_s']:.1f} ({f['peers']})"
              for m, f in first_calls.items()))
  for m, log in call_logs.items():  # what the miss rule weighed cycles against, call by call
    prices = [c["break_even"] for c in log if c["block_size"] > 1 and c["break_even"]]
    if prices:
      print(f"  {m} break-even of a full cycle after each of its {len(prices)} speculative "
            f"calls: min {min(prices):.2f}, median {float(np.median(prices)):.2f}, max "
            f"{max(prices):.2f} AR steps")
  profiles = {m: profiled(engines[m], groups[0], size[m], forced[m])
              for m in methods} if FLAGS.profile else {}
  for m, p in profiles.items():
    counts = ("no device stream lines to count (a CPU)" if p["kernels_per_cycle"] is None else
              f"{p['kernels_per_cycle']} device kernels and {p['d2h_copies_per_cycle']} "
              "device-to-host copies per forward")
    print(f"  profile {m}: {p['cycles']} batch target forwards, {counts}")
  gaps = (idle_gaps(engines["ar"], groups[0], [float(g) for g in FLAGS.idle_gaps.split(",")])
          if FLAGS.idle_gaps else {})
  if gaps:
    print("  our AR's first loop call of the first group after an idle host (gap: ms each): "
          + ", ".join(f"{g} s: " + " / ".join(f"{1e3 * x:.1f}" for x in xs)
                      for g, xs in gaps.items()))
  if FLAGS.out:
    report = {"prompts": [k for k, _ in prompts], "half": FLAGS.half,
              "repeats": FLAGS.repeats, "warmup_groups": FLAGS.warmup_groups,
              "max_new_tokens": FLAGS.max_new_tokens,
              "block_size": FLAGS.block_size, "batch_size": B, "group_size": G,
              "ar_fallback": FLAGS.ar_fallback, "priced_cap": FLAGS.priced_cap,
              "start_plain": FLAGS.start_plain,
              "temperature": FLAGS.temperature, "top_k": FLAGS.top_k, "verify": FLAGS.verify,
              "drafter": FLAGS.drafter,
              "intervals": cis, "intervals_over": resampled,
              "intervals_mean_of_repeats": mean_cis, "intervals_end_to_end": wall_cis,
              "ar_fallback_accept": FLAGS.ar_fallback_accept, "methods": rows,
              "controller_costs": {**costs, "source": source}, "cost_estimates": online,
              "slot_use": slot_use, "drafted_every_repeat": drafted, "compiles": compiles,
              "precompile_s": precompile_s, "timed_compiles": timed_compiles,
              "timed_xla_programs": xla_built,
              "learned_block_sizes": learned_sizes,
              "policy": FLAGS.policy if learned_sizes else None,
              "loop_calls": calls,
              "tails_shrink": shrinks, "batch_forwards": batched,
              "profile": {m: {k: v for k, v in p.items() if k != "device_lines"}
                          for m, p in profiles.items()},
              "idle_gaps": gaps,
              "hold_costs": FLAGS.hold_costs,
              # the engines holding a measurement (the default's): the run's, as their source
              "engine_costs": {m: source for m, e in engines.items()
                               if measured is not None and e.measured_costs is measured},
              "shape": FLAGS.shape or "demo", "prompt_set": setup.label,
              "sim_tau": FLAGS.sim_tau if FLAGS.shape else None,
              # how far each simulated continuation runs past --max_new_tokens (module doc)
              "sim_tokens_past_max_new": (min(len(c) for c in sim.values())
                                          - FLAGS.max_new_tokens if sim else None),
              "repeats_per_group": per_repeat, "call_logs": call_logs,
              "first_calls": first_calls,
              "gc_in_calls": gc_in_calls}
    common.write_json(os.path.join(FLAGS.out, "controllers.json"), report, indent=1)
    print(f"  wrote {os.path.join(FLAGS.out, 'controllers.json')}")


if __name__ == "__main__":
  cli.run(main, __doc__)

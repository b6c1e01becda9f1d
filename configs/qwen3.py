"""Generic Qwen3 decoding config: every field is a `--config.<name>` flag of decode.py.

  python decode.py --config configs/qwen3.py --config.target ckpt/qwen3-4b \
      --config.prompts prompts.jsonl --config.output out/qwen3.jsonl

`blockpilot` holds the settings of train.py's BlockPilot stages (labels, policy, report).
"""

from typing import Any

import ml_collections

from bp_jax.optim_config import opt_config


def blockpilot_config(**overrides: Any) -> ml_collections.ConfigDict:
  """`cfg.blockpilot`: the fields of train.py's labels, policy and report stages."""
  c = ml_collections.ConfigDict()
  # Candidate block sizes (the policy's classes).
  c.candidates = ""              # comma-separated sizes; "" = drafter's training size +- radius
  c.radius = 3
  # Also offer block size 1: plain AR decoding, no drafter pass. Under `max_throughput` a prompt
  # whose drafts rarely survive is then labelled AR, so a learned policy can skip speculation
  # for it (it never wins under `max_tau`, where τ(1) = 1).
  c.include_ar = True
  # Prompt sets: eval_source is split by id into labelling and evaluation prompts.
  c.eval_source = "humaneval"
  c.eval_frac = 0.5              # fraction of eval_source held out for evaluation
  c.split_seed = 0
  c.label_sources = ""           # extra labelling prompt sources, comma-separated
  c.corpus_prompts = 0           # extra labelling prompts cut from the LM's training files
  c.corpus_prompt_tokens = 128   # tokens per corpus prompt
  c.limit = 0                    # > 0: keep only the first N labelling and N evaluation prompts
  # Decoding (labels and report).
  c.max_new_tokens = 128
  c.temperature = 0.0
  c.label_seeds = 1              # decodes per (prompt, size), summed, for labels at T > 0
  # The cost table that prices `max_throughput` labels (seconds per AR step and per cycle of
  # each size, medians of many timings; bp_jax/train/cost_table.py): auto = reuse
  # <workdir>/data/cost_table.json when it was measured on this machine for these models and
  # loops, else measure it; remeasure; or the path of a cost_table.json to price with.
  c.cost_table = "auto"
  c.cost_prompts = 4             # calibration prompts (the first labelling prompts)
  c.cost_reps = 8                # timed repetitions of every (calibration prompt, size, kind)
  # Policies (stage policy): one per head, feature type and label rule.
  c.features = "last_logits,last_hidden,pooled_layers,draft_confidence"
  c.rules = "max_tau,max_throughput"
  # Heads: classify (argmax of a classifier of the label), value (regressed per-size value
  # relative to the best static size, shrunk toward it: decodes with the static size unless the
  # validation prompts show a gain) and priced (regressed per-size cycles and fallback steps per
  # token, priced when decoding by the costs the engine measures on its own machine, shrunk
  # toward the labelling set's counts; max_throughput only). All by default, so `ship=auto`
  # can pick any.
  c.heads = "classify,value,priced"
  # Shrinkage grid of value and priced policies (0 = the static size always: for a priced
  # policy the best static size at the prices it decodes with).
  c.value_lams = "0,0.25,0.5,0.75,1"
  # A lam qualifies when the lower bound of this central bootstrap interval (over validation
  # prompts) of its gain over the static size is >= 1x; the best qualifying lam is kept.
  c.value_level = 0.9
  c.value_reps = 2000            # bootstrap resamples of the validation prompts per lam
  # A priced head's loss: its counts' error (in AR steps per token at the labelling prices)
  # plus this x the error of the sizes' priced costs relative to their prompt's mean, what its
  # decision compares. 0 (the counts alone) made the shipped demo/policy; 30 scored higher on
  # the demo's validation prompts (est. tokens/s 1,443 against 1,423) but decoded no faster
  # (docs/cpu_xeon167/priced_fit_2026-11-29).
  c.priced_relative_weight = 0.0
  c.hidden_dim = 256
  c.depth = 2                    # hidden layers; layers after the first are residual
  c.residual = True
  c.dropout = 0.2
  c.label_smoothing = 0.1
  c.steps = 1500                 # most optimiser steps (early stopping usually ends sooner)
  c.batch = 32
  c.val_frac = 0.2               # labelling prompts held out for early stopping
  c.eval_every = 10              # steps between validation losses
  c.patience = 15                # validations without improvement before stopping
  c.opt = opt_config(lr=1e-3, warmup_frac=0.05, min_lr_frac=0.1, weight_decay=0.05, clip=1.0)
  # Copied to <export_dir>/policy: auto (best validation est. tokens/s, any head) |
  # <feature>:<rule> (classify) | <feature>:<rule>:value | <feature>:max_throughput:priced |
  # "" (none).
  c.ship = "auto"
  # Stage report.
  c.report_dir = ""              # "" = <workdir>/report
  c.random_seed = 0              # seed of the random control
  c.report_repeats = 2           # runs per (prompt, method); the fastest times are kept
  c.replay = True                # intra-request (per-cycle) analysis by teacher-forced replay
  c.update(overrides)
  return c


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  # Checkpoints (converted by convert_weights.py or written by train.py).
  c.target = ""              # converted target checkpoint folder
  c.drafter = ""             # converted DFlash drafter folder (mode=spec)
  # At T > 0, decode with this drafter instead (one distilled on sampled responses accepts more
  # drafts under rejection sampling); "" = --config.drafter at every temperature.
  c.drafter_sampling = ""
  c.policy = ""              # block-size policy checkpoint (block_policy=learned)
  c.tokenizer = ""           # tokenizer folder; empty = the target checkpoint's own files
  c.dtype = "auto"           # auto (as stored) | float32 | bfloat16 | float16
  # Precision of float32 matmuls: highest | high | default. highest = full float32 on every
  # backend, so f32 speculative output is token-identical to AR on TPU/GPU as on CPU (JAX's
  # default there runs f32 matmuls as bf16 passes / TF32); high and default are faster, inexact.
  c.matmul_precision = "highest"
  # Prompts and outputs.
  c.prompts = "configs/prompts/example.jsonl"  # JSONL of {"prompt": ...}, 'humaneval', 'pysrc:<dir>'
  c.num_prompts = 0          # 0 = all
  c.chat = False             # apply the tokenizer's chat template
  c.output = "out/decode.jsonl"  # JSONL records; the summary goes to <output>.summary.json
  c.show = 2                 # completions printed to the terminal
  # Decoding.
  c.mode = "ar"              # ar | spec
  c.temperature = 0.0        # 0 = greedy
  # Truncation of the target's distribution at T > 0 (every mode samples exactly the truncated
  # distribution): keep the top_k most likely tokens (0 = off), then the smallest set holding
  # top_p of the probability (1.0 = off), and tokens at least min_p times as likely as the most
  # likely one (0.0 = off).
  c.top_k = 0
  c.top_p = 1.0
  c.min_p = 0.0
  # How a speculative cycle keeps drafts at T > 0 (T = 0 is greedy either way, identical to AR):
  # exact = the drafter's argmax, kept while it equals the target's own sample (token-identical
  # to AR for a seed); rejection = drafts drawn from the drafter's distribution, speculative
  # rejection sampling (accepts a draft with probability min(1, p/q); same distribution as AR;
  # its tokens for a seed depend on where cycles start, so under the priced controller's
  # measured, online costs they may differ between runs: the summary says which).
  c.verify = "rejection"     # measured better at T > 0 on the demo (docs/sampling)
  # Many requests at once: up to batch_size requests decode together in one compiled loop per
  # block-size bucket (1 = one request at a time, the plain loop); the loop returns to the host
  # every sync_cycles target forwards (cycles; an AR step of the priced back-off counts one) so
  # that finished requests free their slots for queued ones
  # (continuous batching; 0 = a batch runs until all its requests finish). docs/design.md §9.
  c.batch_size = 1
  c.sync_cycles = 16
  # A batch's tail (no request waiting for its bucket) decodes in fewer slots: the fewest of
  # batch_size, batch_size/2, ..., 1 that hold its requests (one copy of their caches; one more
  # compiled loop per size used); false = every call computes all batch_size slots.
  c.shrink_batches = True
  # In a batch, every request whose policy (block_policy=learned) picks a speculative size
  # decodes at one size (a pick of 1 stays plain): a priced policy's prior's cheapest size per
  # new token at the engine's start-up costs where it beats the middle by 3%, else the middle
  # of the policy's speculative sizes (`Engine.joint_size`; the demo: 8). Every bucket's calls
  # compute all its slots, so picks spread over several sizes ran several half-empty loops by
  # turns, and the picks (chosen for one request's costs) never beat one size in a batch; one
  # size also compiles one loop per shape, not one per size. false = each request in its
  # pick's bucket.
  c.join_learned_sizes = True
  # In a batch with the priced start's plain starts (controller_start_plain), a speculative
  # bucket's requests move to the plain AR bucket mid-decode once their batch's cycles missed
  # this many times in a row, an explorer run's also once its own cycles commit fewer tokens
  # than the start rule asks of a batch (where it has room; 0 = never): where drafting loses, a
  # batch's explorers and first requests pay a few cycles, not a whole decode in a second bucket.
  c.move_plain_after = 3
  c.seed = 0
  c.max_new_tokens = 128
  c.max_len = 1024           # cache slots per request: prompt + max_new_tokens + block_size - 1
  c.length_buckets = ""      # comma-separated prompt-length buckets; empty = powers of two
  c.block_size = 16          # block size for block_policy=fixed (mode=spec)
  c.block_sizes = ""         # comma-separated buckets; empty = drafter's training size +-4
  # Block size per request (mode=spec): fixed | learned (the policy at `policy`) | oracle (best
  # size per prompt from a labels dataset) | random (uniform over block_sizes, or the drafter's
  # training size +-3, seeded).
  c.block_policy = "fixed"
  c.policy_fallback = False  # learned with no folder at `policy`: decode fixed, with a note
  c.labelled_prompts = "refuse"  # learned: prompts the policy was labelled on: refuse | skip
  c.oracle_labels = ""       # oracle: labels dataset '<data dir>/<name>' (train.py stage labels)
  c.label_rule = "max_tau"   # oracle: max_tau | max_throughput
  c.precompile = False       # compile every bucket up front and report each compile time
  # Decode loops run the layers unrolled with per-layer weights taken once per request (fast
  # steps); True runs them with lax.scan over the stacked weights (much faster to compile for
  # deep models, slower per step: scan slices every layer's weights at every step).
  c.scan_layers = False
  # Tokens an AR step's forward runs over: 1; 2, its token and a dropped copy (same outputs), for
  # machines where a one-row matrix product costs more than a two-row one (an H200 at Qwen3-4B
  # shapes, batch 1: 5.39 ms against 3.32 ms); 0: 2 where the engine's costs (measured or
  # given) price a forward over 2 tokens below 0.9 AR steps, else 1.
  c.ar_step_tokens = 0
  # Speculative loops: after a cycle accepting <= ar_fallback_accept drafts, run plain AR steps
  # (2, 4, ... for consecutive poor cycles, at most ar_fallback) before drafting again. Lossless;
  # pays off where a cycle costs several AR steps (CPU). 0 = always draft (the paper's loop).
  c.ar_fallback = 0
  c.ar_fallback_accept = 1
  # Per-cycle verify-length controller of the speculative loops: none (verify all b-1 drafts,
  # ar_fallback unused) | backoff (none plus the AR fallback above; with ar_fallback = 0 it is
  # none) | confidence (verify k in {0, 1, 3, 7, ..., b-1} drafts per cycle, the k maximizing
  # expected committed tokens / cost from the drafter's probabilities, and skip the next
  # drafter pass when drafting does not pay: 2, 4, ... AR steps for consecutive declined cycles,
  # at most ar_fallback, 16 when 0) | priced (backoff with a cost-priced miss rule: a cycle
  # is a miss when it committed fewer tokens than it cost AR steps, drafter pass + verify of
  # its k+1 tokens, from the costs below, so it never keeps drafting where drafting loses;
  # misses back off 2, 4, ... AR steps, at most ar_fallback, 64 when 0; ar_fallback_accept
  # unused). Lossless either way. priced is the default: where a cycle costs about one AR step
  # (an accelerator) it drafts nearly always; where drafting loses (a CPU, T > 0, large
  # batches) it falls back to AR steps.
  c.controller = "priced"
  # confidence and priced: relative costs of one target forward over 1, 2, 4, 8, 16, 32 tokens (linear in
  # between) and of one drafter pass, same unit (AR steps), e.g. "1.0,2.01,2.25,2.58" and 1.58;
  # both given or both "measure": the engine times its own forwards on this machine at start-up
  # (a few seconds; bp_jax/decoding/costs.py), cached per machine, models and shapes in
  # controller_cost_cache ("default" = ~/.cache/bp_jax/costs, "" = measure every run).
  c.controller_costs = "measure"
  c.controller_draft_cost = "measure"
  c.controller_cost_cache = "default"
  # priced: keep the costs current from the loop calls' own wall times (the start-up costs are
  # the prior and the floor; bp_jax/decoding/online_costs.py): "auto" (when measured, from every
  # loop call, batches too), "on" (also when given) or "off".
  c.controller_online_costs = "auto"
  # priced: a request (alone or in a batch's slot) starts with the cap's AR steps and backs off it
  # after a miss when the recent requests' cycles committed clearly fewer tokens than a cycle
  # costs (every 4th deep start still drafts first, so the acceptance and costs stay current;
  # bp_jax/decoding/start_backoff.py); False: every request drafts first.
  c.controller_start_backoff = True
  # priced, with controller_start_backoff: a request that would start deep runs the plain AR loop
  # instead, with no probing cycle (each costs several AR steps where drafting loses; the
  # explorers still draft): alone the AR loop, in a batch a slot of the plain AR bucket (the
  # speculative loop's AR steps stage the drafter's context and cost more); False: the deep
  # start's AR steps in the speculative loop, then probes.
  c.controller_start_plain = True
  # priced: at most this many AR steps in a row after misses (0: ar_fallback, 64 when that is 0
  # too). Its own cap, so that ar_fallback can stay the back-off label sets were measured under.
  c.controller_priced_cap = 0
  # priced: after the drafter pass, a cycle verifies none of its drafts (an AR step's forward, a
  # miss) when the drafter's probabilities, scaled to the acceptance the recent cycles measured,
  # expect fewer tokens than the verify of all of them costs AR steps on this machine (the
  # drafter pass, paid already, not counted; bp_jax/decoding/decline.py); False: every cycle
  # verifies all its drafts; "auto": on in the loops of the block sizes where the costs measured
  # here price a declined cycle at least half an AR step below a full one
  # (bp_jax/decoding/options.py DECLINE_MIN_SAVING: on the development CPU; not at b = 8 on the
  # model-207 Xeon, nor on an H100 at Qwen3-4B shapes below batch 16).
  c.controller_decline = "auto"
  # priced: after a miss, the rows take AR steps only while the cycles right after misses commit
  # clearly fewer tokens than cycles do on average (bp_jax/decoding/evidence.py): where one
  # cycle's acceptance says nothing of the next, backing off only loses; False: every miss
  # backs off.
  c.controller_persist = True
  # confidence: also count a cycle that verified more than ar_fallback_accept drafts and
  # accepted at most that many as a declined one (backs off into AR steps as backoff does).
  c.controller_poor_miss = False
  # confidence and priced's decline: a JSON file of the drafter's acceptance rate per bin of its
  # probability p (benchmarks/controller_calibration.py --out writes one) used instead of the
  # raw p; '' = p.
  c.controller_calibration = ""
  c.report = ""              # folder for PNG plots (acceptance-length histogram)
  # Comparisons in one run: every prompt is also decoded by each method listed (ar, b<k> for a
  # fixed block size k, learned, random), all interleaved per request in a shuffled order,
  # `repeats` times each, fastest time kept; the summary and the printed table compare them
  # (at batch_size 1 each speedup over ar with a 95% paired bootstrap interval over the prompts:
  # in decode time, `speedup_vs_ar` in the summary, and end to end with each request's prefill,
  # `end_to_end_vs_ar`); with other fixed sizes listed (e.g. ar,b5,b6,b7,b8,b9,b10,b11), the
  # run's own method also against the fastest of them, the best fixed size in hindsight
  # (`main_vs_best_fixed`; paired at batch_size 1).
  c.compare = ""
  c.repeats = 1
  # JAX's persistent compilation cache: "default" = ~/.cache/bp_jax/jax, "" = off, or a folder.
  c.compile_cache = "default"
  # Device mesh, e.g. "data:4,model:2" (axes data and model, a missing one is 1): weights are
  # split over `model` (heads, KV heads, MLP width, vocabulary), batch and KV-cache rows over
  # `data`, by one rule table (bp_jax/parallel/rules.py); a dimension that does not divide is
  # replicated. Uses the first data*model devices. "" = one device, nothing sharded. train.py's
  # draft and policy stages read it too (data-parallel batches).
  c.mesh = ""
  # Decode with a drafter (or policy) whose recorded target fingerprint differs from the target
  # given (it was trained for other weights: τ ≈ 1), with a loud warning instead of an error.
  c.allow_foreign_drafter = False
  c.about = ""               # a line printed before decoding (the demo says what its model is)
  c.blockpilot = blockpilot_config()
  return c

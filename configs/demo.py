"""The embedded demo: a small Qwen3 trained from scratch on Python source, and its DFlash drafter.

One config serves both scripts:
  python train.py                      # reproduce demo/target and demo/drafter (stages: all)
  python train.py --config.stage=blockpilot  # labels, block-size policies (demo/policy), report
  python decode.py                     # decode HumanEval prompts with the shipped demo
Every field is a `--config.<name>` flag (e.g. --config.lm.steps=100). Run from the repo root:
relative paths (workdir, export_dir, target, drafter) are relative to the current folder.
"""

import ml_collections

from bp_jax.optim_config import opt_config
from configs import qwen3

DRAFT_BLOCK_SIZE = 8


def get_config() -> ml_collections.ConfigDict:
  c = qwen3.get_config()
  # ---- decode.py (see configs/qwen3.py for every field) ------------------------------------
  c.target = "demo/target"       # shipped target (written by train.py, stage lm)
  c.drafter = "demo/drafter"     # shipped drafter (written by train.py, stage draft)
  # At T > 0 the drafter distilled on sampled responses (demo/drafter is the T = 0 one).
  c.drafter_sampling = "demo/drafter_sampling"
  c.prompts = "humaneval"
  c.num_prompts = 8
  c.mode = "spec"
  c.max_new_tokens = 128
  c.max_len = 640               # HumanEval: longest prompt 490 tokens + 128 new + block - 1
  c.dtype = "float32"
  c.matmul_precision = "highest"  # full f32 matmuls on TPU/GPU too (see configs/qwen3.py)
  c.block_size = DRAFT_BLOCK_SIZE  # the fixed size (and the fallback without a policy)
  # The per-cycle controller: priced = after a cycle that committed fewer tokens than it cost
  # AR steps (drafter pass + verify, by the costs the engine measures on this machine at
  # start-up and keeps current from its own loop calls), run 2, 4, ... (at most ar_fallback)
  # plain AR steps before drafting again (lossless). On this CPU a b=8 cycle costs ~4-5 AR
  # steps, on an accelerator ~1: the same rule drafts less here and nearly always there. Try
  # --config.controller=backoff (a miss = a cycle accepting <= ar_fallback_accept drafts, at
  # any cost), confidence (verify 0, 1, 3 or 7 drafts per cycle by the drafter's confidence
  # and the measured costs, configs/qwen3.py) or none (the paper's loop). Labels and the
  # shipped policy were made under backoff's loop, which priced shares (same ar_fallback).
  c.ar_fallback = 16
  c.controller = "priced"
  # priced's misses back off up to 64 AR steps (not ar_fallback's 16, which stays the form the
  # labels were measured under): where drafting loses (T = 1 here) a request probes once per
  # ~64 tokens instead of once per ~16 (docs/results/controller.md).
  c.controller_priced_cap = 64
  # confidence only: the drafter's p is underconfident (p 0.65 -> 83% accepted); this table of
  # acceptance per p bin was fitted on 48 HumanEval labelling-half prompts (HumanEval/134 on,
  # benchmarks/controller_calibration.py --skip 24 --num_prompts 48) and replaces p in the rule.
  c.controller_calibration = "demo/controller_calibration.json"
  # BlockPilot: the shipped policy picks each request's block size from its prefill, its
  # per-size counts priced by the costs this engine measures (the summary's policy.prices_from).
  # Without demo/policy, decode.py says so and decodes with block_size. HumanEval prompts the
  # policy was labelled on are skipped (never evaluate on them).
  c.policy = "demo/policy"
  c.block_policy = "learned"
  c.policy_fallback = True
  c.labelled_prompts = "skip"
  # At T > 0: speculative rejection sampling (measured better than `exact` at T = 0.6 and 1.0
  # on the held-out prompts, docs/sampling; T = 0 is greedy and identical either way); at T > 0
  # decode.py takes drafter_sampling above.
  c.verify = "rejection"
  # Show what a newcomer looks for: plain AR decoding of the same prompts in the same run,
  # interleaved per request, outputs compared token for token, tokens/s and speedup.
  c.compare = "ar"
  c.repeats = 1
  c.about = ("demo: a 4.2M-parameter Qwen3-architecture target trained from scratch on this "
             "Python's standard library (~30 min on 2 CPU cores) with a 1.7M-parameter DFlash "
             "drafter; its code is not good, that is not the point. The table below compares "
             "speculative decoding with the target's own AR decoding of the same prompts, "
             "token for token, and says how fast each was on this machine.")

  # ---- train.py ------------------------------------------------------------------------------
  c.workdir = "runs/demo"        # datasets, training runs and checkpoints of every stage
  c.stage = "all"                # comma-separated: tokenizer,lm_data,lm,regenerate,draft | all
  c.export_dir = "demo"          # final target/drafter checkpoints are copied here ('' = don't)
  c.seed = 0                     # model init, data order and splits
  c.corpus = ""                  # folder of Python source; '' = this Python's standard library
  c.mesh = ""                    # "data:D,model:M": data-parallel draft/policy steps (qwen3.py)

  # Stage `tokenizer` (named `bpe` here: `tokenizer` is decode.py's tokenizer-folder field).
  c.bpe = ml_collections.ConfigDict()
  c.bpe.vocab_size = 4096        # byte-level BPE size, special tokens included

  c.lm_data = ml_collections.ConfigDict()
  c.lm_data.val_frac = 0.02      # fraction of corpus files held out for the LM's eval loss

  c.model = ml_collections.ConfigDict()  # the target's Qwen3 sizes (about 4.2M parameters)
  c.model.vocab_size = 4096
  c.model.hidden_size = 256
  c.model.intermediate_size = 768
  c.model.num_hidden_layers = 4
  c.model.num_attention_heads = 4
  c.model.num_key_value_heads = 2
  c.model.head_dim = 64
  c.model.rms_norm_eps = 1e-6
  c.model.rope_theta = 10000.0
  c.model.tie_word_embeddings = True
  c.model.max_position_embeddings = 2048

  c.lm = ml_collections.ConfigDict()
  c.lm.seq_len = 512             # tokens per training sequence (data chunks hold seq_len + 1)
  c.lm.batch = 8                 # sequences per step
  c.lm.steps = 800               # optimiser steps: 3.3M tokens (~1 epoch), ~30 min on 2 cores
  c.lm.opt = opt_config(lr=2e-3, warmup_frac=0.04, min_lr_frac=0.1, weight_decay=0.1, clip=1.0,
                        b1=0.9, b2=0.95)
  c.lm.eval_every = 200          # steps between held-out evaluations (and one at the end)
  c.lm.eval_batches = 8          # held-out batches per evaluation
  c.lm.checkpoint_every = 100    # steps between checkpoints (and one at the end)
  c.lm.log_every = 10            # steps between metrics.jsonl records
  c.lm.export_dtype = "bfloat16"  # stored dtype of the exported target (float32 | bfloat16)

  # Self-distillation data: prompts with responses regenerated by the trained target.
  c.regenerate = ml_collections.ConfigDict()
  # Prompts are HumanEval-shaped: a training file's text up to the end of a function's
  # docstring, so the target writes function bodies as it does on HumanEval (never HumanEval).
  c.regenerate.prompt_style = "docstring"  # docstring | window (fixed-size windows of a file)
  c.regenerate.num_prompts = 2048    # prompts taken from the LM training files
  c.regenerate.prompt_tokens = 192   # longest prompt (docstring: the last 192 tokens before it)
  c.regenerate.max_new_tokens = 160  # response length generated by the target
  c.regenerate.temperature = 0.0     # 0 = greedy responses
  c.regenerate.also_greedy = False   # with temperature > 0: each prompt's greedy response too

  # DFlash drafter training against the frozen target.
  c.draft = ml_collections.ConfigDict()
  c.draft.num_layers = 2
  c.draft.block_size = DRAFT_BLOCK_SIZE
  c.draft.gamma = 4.0               # loss weight exp(-(k-1)/gamma) (docs/design.md §6: 4 for b=8)
  c.draft.anchors_per_seq = 32      # anchor blocks sampled per sequence per step
  c.draft.batch = 8
  c.draft.steps = 1500              # ~6 epochs of the regenerated responses
  # Objective: ce (the data token, as DFlash) | kl (forward KL to the frozen target's
  # distribution at each block position, soft targets at distill_temperature) | tvd (total
  # variation: 1 - TV is rejection sampling's acceptance) | mix ((1-w) ce + w kl, w=mix_weight).
  c.draft.drop_short = False       # skip responses shorter than a block (else refuse them)
  c.draft.loss = "ce"
  c.draft.distill_temperature = 1.0
  c.draft.mix_weight = 0.5
  c.draft.ce_label = "data"        # CE against the data token | the target's argmax (argmax)
  c.draft.opt = opt_config(lr=6e-4, warmup_frac=0.04, min_lr_frac=0.0, weight_decay=0.0,
                           clip=1.0)
  # Target layers whose hidden states feed the drafter: a shallow one and the deepest allowed.
  # Never the last layer (3): transformers' `hidden_states` hands drafters that layer after the
  # final norm, bp_jax before it, so an exported drafter would see other features elsewhere
  # (docs/design.md §1); DFlash's own formula, layers 1..L-3, repeats layer 1 on a 4-layer target.
  c.draft.target_layer_ids = (1, 2)
  c.draft.export_dtype = "bfloat16"
  c.draft.ship_name = "drafter"     # copied to <export_dir>/<ship_name>
  c.draft.init_from = ""            # a drafter checkpoint to fine-tune instead of a random init

  # BlockPilot stages (labels, policy, report): HumanEval split in halves by id (labelling /
  # evaluation), plus windows of the LM's training files as extra labelling prompts; candidate
  # sizes DRAFT_BLOCK_SIZE +- 3 = 5..11; 128 new tokens at T=0 (set temperature=1.0 and
  # label_seeds for T=1 labels).
  c.blockpilot = qwen3.blockpilot_config(corpus_prompts=512, corpus_prompt_tokens=128,
                                         hidden_dim=256, depth=2)
  # The shipped policy: a priced head (its counts priced by the decoding machine's costs; the
  # value heads' validation figures are this labelling machine's prices, which a decode
  # elsewhere does not pay). Of the four priced heads only last_hidden's validation chose
  # lam > 0 (docs/cpu_xeon167/priced_policy_2026-11-29).
  c.blockpilot.ship = "last_hidden:max_throughput:priced"
  return c

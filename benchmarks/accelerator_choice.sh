#!/usr/bin/env bash
# The default's verify-length choice at Qwen3-4B shapes on an accelerator: issue 19's device
# rows, one short call. benchmarks/controllers.py --shape 4b (random bf16 weights; every
# speculative method drafts the SIMULATED acceptance profile, mean τ 6.5 at b = 16) at batch 1,
# 8, 4 and 16, each batch size its own process under a time limit so that the rows done come
# back when a later one runs out. Methods: our AR, the paper's loop at b = 16 (none), the default
# (priced_default), an engine identical to AR (ar_twin: the run's noise floor) and, at batch 1,
# our AR with its steps run as two-token forwards (ar_padded).
#
#   bash benchmarks/accelerator_choice.sh [seconds per batch size, default 130]
#
# BATCHES="1 16 8 4" runs those batch sizes in that order; GROUPS=8 decodes 8 static batches per
# batch size above 1 instead of 4 (the intervals resample them; on an H200 a group of batch 8
# took ~6 s, all methods and repeats, after ~90-150 s of start-up and compiles); DEADLINE=540
# ends the whole run within that many seconds (each batch size gets what is left, up to its
# limit; none starts with under a minute left), so that a device lease's one call returns with
# the rows it finished.
# METHODS=none,priced_default,priced_default_nogate replaces the methods besides our AR (e.g. the
# default with and without its back-off gate). PROFILE=0 drops the profiler pass that counts
# each method's device kernels and device-to-host copies per batch target forward (on a GPU each
# evaluated predicate of a data-dependent loop is such a copy, and the host waits for it).
# After the timed runs our AR decodes the first group twice after each idle gap of IDLE_GAPS
# seconds (default 0,0.2,1,3; empty: skipped; ~12 s): on the H200 every method's first timed
# call ran 15-40 ms long, and a device whose clocks fall while the host is busy would show it.
# Every method first decodes the first group once, untimed (--warmup_groups 1: on an H200 the
# first group's calls held one-time costs, each method's first AR steps among them, that fastest
# of 2 did not filter out: batch 4, the default's first group 0.79x the paper's loop, the others
# 0.986-0.990x). Writes ${OUT:-out}/accelerator_choice/B<batch>/{controllers.json,log.txt}
# (the json holds every priced loop call with its break-even: `call_logs`). SHAPE=tiny runs the
# same at the test shape (a CPU smoke run); programs are cached in $JAX_COMPILATION_CACHE_DIR
# (ar_twin's are ar's). Then, with 45 s or more left (TRUNCATION=0: never), the verify rules'
# sampling work alone at Qwen3's vocabulary, batch 16, b = 16 (benchmarks/verify_cost.py: top-k
# 20 + top-p 0.95, read off the candidates; top-p 0.9 alone on random logits, the bisection's
# worst case), each also with every row bisected (--top_candidates 64,0), into $root/verify_cost.
# AB_XLA_FLAGS="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" runs each batch size a second
# time, in a process of its own with those flags added to XLA_FLAGS, into $root/B<batch>_ab: XLA
# flags act when a process starts its backend, so the two arms are two processes one after the
# other (a GPU's AR twin reads 0.99-1.01x, so the pair compares within that). The flags in the
# example let XLA:GPU run the decode loops' while loops and branches as CUDA graph nodes on the
# device; in the H200's profiles each trip's predicate was copied to the host, which then
# launched the next trip's ~700-1,200 kernels (per batch forward).
set -uo pipefail
limit=${1:-130}
batches=${BATCHES:-1 8 4 16}
deadline=$(( $(date +%s) + ${DEADLINE:-100000} ))
export PYTHONUNBUFFERED=1
shape=${SHAPE:-4b}
root=${OUT:-out}/accelerator_choice
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/bp_jax_jax_cache}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
arms=("")
[[ -n "${AB_XLA_FLAGS:-}" ]] && arms+=("$AB_XLA_FLAGS")
base_xla_flags=${XLA_FLAGS:-}
for B in $batches; do
 for extra in "${arms[@]}"; do
  left=$(( deadline - $(date +%s) ))
  if (( left < 60 )); then echo "batch $B${extra:+ ($extra)}: skipped, $left s left"; continue; fi
  run_limit=$(( left < limit ? left : limit ))
  out_dir="$root/B$B${extra:+_ab}"
  export XLA_FLAGS="$base_xla_flags${extra:+ $extra}"
  mkdir -p "$out_dir"
  prompts=$(( B == 1 ? 12 : ${GROUPS:-4} * B ))
  methods=${METHODS:-none,priced_default,ar_twin}
  profile=$( (( ${PROFILE:-1} )) && echo --profile )
  (( B == 1 )) && methods=$methods,ar_padded  # one-row AR steps as two-token forwards
  start=$(date +%s)
  timeout "$run_limit" python3 -m benchmarks.controllers --shape "$shape" --block_size 16 \
    --prompt_len 256 --max_new_tokens 128 --num_prompts "$prompts" --repeats 2 --warmup_groups 1 \
    --batch_size "$B" --group_size "$B" --methods "$methods" \
    --cost_cache "" $profile --idle_gaps "${IDLE_GAPS-0,0.2,1,3}" --out "$out_dir" \
    > "$out_dir/log.txt" 2>&1
  rc=$?
  echo "batch $B${extra:+ ($extra)}: rc $rc in $(( $(date +%s) - start )) s"
  (( rc == 0 )) || tail -4 "$out_dir/log.txt"
  grep -E 'target forward over|since start|  profile |break-even of a full cycle|Python GC|first timed|idle host' \
    "$out_dir/log.txt" | cut -c1-200
  sed -n '/ method /,$p' "$out_dir/log.txt" | grep -v '^  wrote' | head -40
 done
done
export XLA_FLAGS="$base_xla_flags"
left=$(( deadline - $(date +%s) ))
if (( ${TRUNCATION:-1} )) && (( left >= 45 )); then
  for setting in "20 0.95" "0 0.9"; do
    set -- $setting
    timeout $(( left / 2 )) python3 -m benchmarks.verify_cost --batch_size 16 --block_size 16 \
      --vocab 151936 --reps 20 --top_k "$1" --top_p "$2" --out "$root/verify_cost/k$1_p$2" 2>&1 \
      | tail -8
  done
fi

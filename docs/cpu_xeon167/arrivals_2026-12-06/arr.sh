#!/bin/bash
# Arrival traces on the simulated H200 clock; $1 tag, $2 methods, $3 batch, $4 loads, rest: extra flags
cd /work/main
TAG=$1; M=$2; B=$3; L=$4; shift 4
case $B in
  4) C="--controller_costs 1.0,1.0192,1.0829,1.1343,1.3005 --controller_draft_cost 0.2565 --sim_clock_ms 3.38";;
  8) C="--controller_costs 1.0,1.0666,1.1098,1.2697,1.6273 --controller_draft_cost 0.3028 --sim_clock_ms 3.52";;
  16) C="--controller_costs 1.0,1.0376,1.1749,1.4635,2.0976 --controller_draft_cost 0.3761 --sim_clock_ms 3.91";;
esac
PYTHONPATH=. python -m benchmarks.arrivals --num_prompts 0 --half eval --repeats 1 --methods $M --sim_clock_noise 0.03 --block_size 8 --batch_size $B $C --loads $L --warmup_groups 1 --out ${OUT:-/tmp/s76}/$TAG "$@" > ${OUT:-/tmp/s76}/$TAG.log 2>&1
echo done > ${OUT:-/tmp/s76}/$TAG.done

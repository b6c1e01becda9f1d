#!/bin/bash
# usage: serve_start.sh REPO OUTPREFIX [batch]  -- starts serve.py, records maps every 3 s, stops at "listening" or exit
cd $1
B=${3:-16}
PORT=$((8100 + RANDOM % 500))
start=$(date +%s.%N); : > $2.log
python serve.py --batch_size $B --port $PORT --config.compile_cache= >> $2.log 2>&1 &
PID=$!
: > $2.maps
while kill -0 $PID 2>/dev/null; do
  echo "$(date +%s) $(wc -l < /proc/$PID/maps 2>/dev/null)" >> $2.maps
  if grep -q "listening" $2.log; then
    echo "ready after $(python -c "import time;print(round(time.time()-$start,1))") s" >> $2.log
    curl -s localhost:$PORT/v1/completions -H 'Content-Type: application/json' -d '{"model": "target", "prompt": "def fib(n):", "max_tokens": 16}' >> $2.log
    echo >> $2.log
    curl -s localhost:$PORT/metrics | grep -E "compilations|let_go" >> $2.log
    echo "maps now $(wc -l < /proc/$PID/maps)" >> $2.log
    kill $PID; break
  fi
  sleep 3
done
wait $PID
echo "exit $? after $(python -c "import time;print(round(time.time()-$start,1))") s" >> $2.log

#!/bin/bash
# usage: mon.sh PID OUT  -- samples map count, RSS every 3 s
while kill -0 $1 2>/dev/null; do
  echo "$(date +%s) $(wc -l < /proc/$1/maps 2>/dev/null) $(grep VmRSS /proc/$1/status 2>/dev/null | awk '{print $2}')" >> $2
  sleep 3
done

"""Plots b16_learned_precompile_map_count.txt (seconds, memory maps, RSS kB of the process,
sampled every 3 s by map_count_monitor.sh) against the kernel's limit: map_count.png.

  python docs/cpu_xeon167/map_limit_2026-12-05/plot_map_count.py
"""
import os

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = os.path.dirname(os.path.abspath(__file__))
rows = [line.split() for line in open(os.path.join(HERE, "b16_learned_precompile_map_count.txt"))]
t, maps, rss = ([float(r[i]) for r in rows if len(r) == 3] for i in range(3))
fig, ax = plt.subplots(figsize=(7, 4))
ax.plot(t, maps, label="memory maps of the process")
ax.axhline(65530, color="red", ls="--", label="vm.max_map_count (65,530)")
ax.set_xlabel("seconds since the benchmark started")
ax.set_ylabel("memory maps (/proc/PID/maps lines)")
ax2 = ax.twinx()
ax2.plot(t, [r / 2**20 for r in rss], color="gray", lw=0.8, label="resident memory (GiB)")
ax2.set_ylabel("resident memory (GiB)")
ax.set_title("Batch-16 learned engine's full precompile, before the fix\n"
             "(Xeon family 6 model 167; XLA:CPU aborted at the limit)")
ax.legend(loc="upper left", fontsize=8)
ax2.legend(loc="lower right", fontsize=8)
fig.tight_layout()
fig.savefig(os.path.join(HERE, "map_count.png"), dpi=100)

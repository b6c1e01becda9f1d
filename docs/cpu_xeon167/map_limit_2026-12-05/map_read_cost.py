"""What one `compiled.maps_in_use` read costs at 30,000 memory regions (anonymous pages of
alternating protections, so that the kernel keeps them apart): 18-23 ms on the model-167 Xeon.

  PYTHONPATH=. python docs/cpu_xeon167/map_limit_2026-12-05/map_read_cost.py
"""
import mmap
import time

from bp_jax.decoding.compiled import maps_in_use

pages = [mmap.mmap(-1, 4096, prot=mmap.PROT_READ if i % 2 else mmap.PROT_READ | mmap.PROT_WRITE)
         for i in range(30_000)]
t0 = time.perf_counter()
for _ in range(10):
  use = maps_in_use()
print(f"{use[0]:,} regions of {use[1]:,}: {(time.perf_counter() - t0) / 10 * 1e3:.1f} ms a read")

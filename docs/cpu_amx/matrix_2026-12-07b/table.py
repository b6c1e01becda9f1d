"""The rows' table from each run's report: BB_tT.json, or BB_tT/controllers.json as
`benchmarks.controllers --out` writes it (argument: the folder holding them).

  python docs/cpu_amx/matrix_2026-12-07b/table.py docs/cpu_amx/matrix_2026-12-07b
"""
import json, os, sys
root = sys.argv[1]
f = lambda r: f"{r['ratio']:.3f}x [{r['lo']:.3f}, {r['hi']:.3f}]"
print("| B | T | learned / AR, decode | learned / AR, end to end | / b = 8 own engine, e2e | "
      "/ b = 8 one engine, e2e | b = 8 own engine / AR, e2e | ar_twin / ar, e2e | "
      "drafted (learned, b = 8) |")
print("|---|---|---|---|---|---|---|---|---|")
for B in (1, 4, 8, 16):
  for T in (0, 1):
    paths = [os.path.join(root, f"b{B}_t{T}.json"),
             os.path.join(root, f"b{B}_t{T}", "controllers.json")]
    p = next((q for q in paths if os.path.exists(q)), None)
    if p is None:
      continue
    d = json.load(open(p))
    i, e = d["intervals"], d["intervals_end_to_end"]
    dr = d["drafted_every_repeat"]
    print(f"| {B} | {T} | {f(i['learned_default/ar'])} | {f(e['learned_default/ar'])} | "
          f"{f(e['learned_default/priced_default'])} | {f(e['learned_default/learned_fixed'])} | "
          f"{f(e['priced_default/ar'])} | {f(e['ar_twin/ar'])} | "
          f"{dr['learned_default']}, {dr['priced_default']} |")

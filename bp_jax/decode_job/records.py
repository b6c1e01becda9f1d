"""decode.py's output: one record per request and the run's summary, each figure with one
meaning (see `bp_jax.decoding.generation`)."""

from __future__ import annotations

import collections

import numpy as np

from bp_jax.decode_job.block_choice import block_policy_of, sampling_options
from bp_jax.decoding import evidence
from bp_jax.decoding.call_tally import calls_line
from bp_jax.decoding.generation import Generation
from bp_jax.decoding.verify import same_tokens_as_ar
from bp_jax.eval.resources import peak_rss_mb
from bp_jax.text.tokenizer import tokenizer_size


def record_of(i: int, prompt, g: Generation, tok, block_policy: str = "fixed") -> dict:
  """One output line. `block_size`: the bucket it decoded in; `policy_block_size`: a learned
  policy's pick (a batch decodes it at the engine's joint size,
  `BatchOptions.join_learned`); `acceptance_lengths`: committed tokens per speculative cycle
  (τ's terms);
  `forward_lengths` / `forward_is_cycle` / `forward_verified`: every target forward of the loop
  in order, AR steps of the fallback included (`forward_verified`: k + 1 after a drafter pass
  whose k drafts it verified, 0 without one); `verified_histogram`: drafts verified (k) -> how
  many forwards after a drafter pass verified that many; `mean_verified_drafts`: their mean k;
  `ids_beyond_tokenizer`: generated ids the tokenizer cannot decode."""
  limit = tokenizer_size(tok)
  return {"id": prompt.id, "index": i, "prompt": prompt.text, "prompt_tokens": g.prompt_len,
          "output_ids": g.output_ids, "text": tok.decode(g.output_ids, skip_special_tokens=False),
          "new_tokens": g.new_tokens, "prefill_s": round(g.prefill_s, 6),
          "decode_s": round(g.decode_s, 6), "block_size": g.block_size,
          "block_policy": block_policy, "policy_probs": g.policy_probs,
          "policy_block_size": g.policy_block_size,
          "acceptance_lengths": g.acceptance_lengths, "forward_lengths": g.forward_lengths,
          "forward_is_cycle": g.forward_is_cycle, "forward_verified": g.forward_verified,
          "cycles": g.cycles, "ar_steps": g.ar_steps, "drafter_passes": g.drafter_passes,
          "mean_verified_drafts": (None if g.mean_verified_drafts is None
                                   else round(g.mean_verified_drafts, 4)),
          "verified_histogram": verified_histogram(g.verified_drafts),
          "target_forwards": g.target_forwards, "plain_start": g.plain_start,
          "moved_plain": g.moved_plain,
          "tau": None if g.tau is None else round(g.tau, 4),
          "tokens_per_forward": (None if g.tokens_per_forward is None
                                 else round(g.tokens_per_forward, 4)),
          "ids_beyond_tokenizer": sum(t >= limit for t in g.output_ids)}


def verified_histogram(verified_drafts) -> dict[str, int]:
  """Drafts verified (k, as a string key) -> count, in increasing k."""
  hist = collections.Counter(int(k) for k in verified_drafts)
  return {str(k): hist[k] for k in sorted(hist)}


def _mean_of(records: list[dict], field: str) -> float | None:
  vals = [r[field] for r in records if r.get(field) is not None]
  return round(float(np.mean(vals)), 4) if vals else None


def figures(records: list[dict]) -> dict:
  """Throughput and acceptance figures of a set of records (one meaning each):
  `tau`: mean over requests of each request's committed tokens per speculative cycle (the
  paper's τ, averaged per request as the DFlash benchmark does); `tau_pooled_over_cycles`: the
  mean over all cycles of all requests; `tokens_per_forward`: mean over requests of committed
  tokens per target forward (cycles and fallback AR steps together); `mean_verified_drafts`:
  mean over all drafter passes of all requests of the drafts their forward verified."""
  new = sum(r["new_tokens"] for r in records)
  prefill = sum(r["prefill_s"] for r in records)
  decode = sum(r["decode_s"] for r in records)
  accepts = [a for r in records for a in r["acceptance_lengths"]]
  verified = [v - 1 for r in records for v in r.get("forward_verified", []) if v > 0]
  return {"prompts": len(records), "new_tokens": new,
          "tokens_per_s": round(new / max(prefill + decode, 1e-9), 3),
          "decode_tokens_per_s": round(new / max(decode, 1e-9), 3),
          "prefill_s": round(prefill, 4), "decode_s": round(decode, 4),
          "tau": _mean_of(records, "tau"),
          "tau_pooled_over_cycles": round(float(np.mean(accepts)), 4) if accepts else None,
          "tokens_per_forward": _mean_of(records, "tokens_per_forward"),
          "cycles": sum(r["cycles"] for r in records),
          "ar_steps": sum(r["ar_steps"] for r in records),
          "drafter_passes": len(verified),
          "plain_starts": sum(bool(r.get("plain_start")) for r in records),
          "moved_plain": sum(bool(r.get("moved_plain")) for r in records),
          "mean_verified_drafts": round(float(np.mean(verified)), 4) if verified else None}


def verify_lengths_chosen(records: list[dict], batch_size: int) -> dict:
  """The verify length (k + 1 tokens) chosen per cycle, as a histogram, with the batch size the
  controller chose it for (a batched loop chooses one length for all its rows)."""
  hist = collections.Counter(v for r in records for v in r.get("forward_verified", []) if v > 0)
  return {"batch_size": int(batch_size), "lengths": {str(k): hist[k] for k in sorted(hist)}}


def decline_evidence_of(engine) -> dict | None:
  """What the priced decline measured of the drafter (`Engine.evidence_state`): the recent
  row-cycles it weighed (decayed) and the drafts accepted per draft its probabilities expected;
  None where no loop declines."""
  state = getattr(engine, "evidence_state", None)
  if state is None or not engine.loop_options.controller_decline:
    return None
  rows, expected, accepted = (float(x) for x in state[evidence.DECLINE])
  return {"row_cycles": round(rows, 1),
          "accepted_per_expected": round(accepted / expected, 4) if expected > 0 else None}


def backoff_gate_of(engine) -> dict | None:
  """What the priced back-off's gate measured (`evidence.backs_off`): the tokens a row-cycle
  committed right after a miss and on average (decayed, over about the last 100 of each),
  whether misses persist, whether the average cycle loses at one request's price of a full
  cycle of the largest block size now, whether the cycles after misses pay several such prices
  (`evidence.pays_after_miss`), and whether misses then back one request off; None
  where no loop gates its back-off."""
  state = getattr(engine, "evidence_state", None)
  if state is None or not engine.loop_options.controller_persist:
    return None
  after_rows, after_tokens, rows, tokens = (float(x) for x in state[evidence.PERSIST])
  return {"row_cycles_after_miss": round(after_rows, 1),
          "tokens_after_miss": round(after_tokens / after_rows, 3) if after_rows > 0 else None,
          "row_cycles": round(rows, 1),
          "tokens_per_cycle": round(tokens / rows, 3) if rows > 0 else None,
          **_gate_verdict(engine, state)}


def _gate_verdict(engine, state) -> dict:
  persists = bool(evidence.persists(state))
  prices = getattr(engine, "prices", None)
  if prices is None:
    return {"misses_persist": persists, "backs_off": persists}
  price = prices.break_even(max(engine.block_sizes), 1)
  return {"misses_persist": persists, "cycle_price": round(price, 3),
          "cycles_lose": bool(evidence.cycles_lose(state, price)),
          "cycles_after_misses_pay": bool(evidence.pays_after_miss(state, price)),
          "backs_off": bool(evidence.backs_off(state, price))}


def ar_step_probe_of(engine) -> dict | None:
  """What an engine that prices nothing else measured of its AR step (`Engine._padded`): a
  forward over one token and over two, in ms, and the form its AR steps took; None where it
  measured nothing (a CPU, costs given or measured, or the form set)."""
  probe = getattr(engine, "ar_step_probe", None)
  if probe is None:
    return None
  return {"one_token_ms": round(1e3 * probe[0], 3), "two_tokens_ms": round(1e3 * probe[1], 3),
          "ar_step_tokens": engine.loop_options.ar_step_tokens}


def controller_costs_of(engine) -> dict | None:
  """The costs the confidence or priced controller priced its choices with: their source ("given",
  "measured" here, or "cached" from an earlier measurement on this machine), the table in AR
  steps, and the measured seconds; None when the loops price nothing."""
  source = getattr(engine, "costs_source", None)
  if source is None:
    return None
  opts, measured = engine.loop_options, engine.measured_costs
  return {"source": source, "verify_costs": list(opts.controller_costs),
          "draft_cost": opts.controller_draft_cost,
          "measured": None if measured is None else measured.to_json(),
          "described": None if measured is None else measured.describe(),
          "online": getattr(engine, "cost_estimate", None),
          "ar_step_tokens": opts.ar_step_tokens,
          "rows_cost": None if measured is None else measured.rows_cost(),
          "tail_shrink": bool(getattr(engine, "shrink", False))}


def outputs_repeat_for_seed(cfg, engine) -> bool:
  """Whether another run with this config and seed writes the same outputs: always at T = 0, for
  plain AR and for verify=exact (AR's own tokens for the seed); verify=rejection at T > 0 only
  where the controller decides the same way every run (`Engine.timed_decisions`)."""
  if cfg.mode != "spec" or same_tokens_as_ar(engine.verify, cfg.temperature):
    return True
  return not engine.timed_decisions


def summarize(records: list[dict], engine, cfg, wall_s: float) -> dict:
  """The run's summary: `figures` of its records plus compilation, warm-up and memory."""
  accepts = [a for r in records for a in r["acceptance_lengths"]]
  hist = collections.Counter(accepts)
  comp = engine.compiled.summary()
  return {
      "mode": cfg.mode, "block_policy": block_policy_of(cfg), "temperature": cfg.temperature,
      "verify": engine.verify, "controller": engine.controller,
      **sampling_options(cfg),
      **figures(records), "wall_s": round(wall_s, 3),
      "acceptance_histogram": {str(k): hist[k] for k in sorted(hist)},
      "verified_histogram": verified_histogram(
          v - 1 for r in records for v in r.get("forward_verified", []) if v > 0),
      "verify_lengths_chosen": verify_lengths_chosen(records, getattr(engine, "batch_size", 1)),
      "controller_costs": controller_costs_of(engine),
      "ar_step_probe": ar_step_probe_of(engine),
      "decline_evidence": decline_evidence_of(engine),
      "backoff_gate": backoff_gate_of(engine),
      "outputs_repeat_for_seed": outputs_repeat_for_seed(cfg, engine),
      "block_sizes_used": dict(collections.Counter(str(r["block_size"]) for r in records)),
      # A learned policy's picks, where a batch decoded some in another bucket (join_learned).
      "block_sizes_picked": dict(collections.Counter(
          str(r["policy_block_size"]) for r in records
          if r.get("policy_block_size") is not None)),
      "ids_beyond_tokenizer": sum(r["ids_beyond_tokenizer"] for r in records),
      "compilations": comp["compilations"], "compilations_by_function": comp["by_function"],
      "compile_s": comp["compile_s"], "compile_s_per_bucket": comp["per_key_s"],
      "compile_cache_hits": comp["compile_cache_hits"],
      "shared_programs": comp["shared_programs"],
      "loop_warmup_s": round(sum(engine.programs.warmup_seconds.values()), 3),
      "prefill_warmup_s": round(engine.prefill_warmup_seconds, 3),
      "peak_rss_mb": peak_rss_mb(),
  }


def _fmt(x, spec: str) -> str:
  return "-" if x is None else format(x, spec)


def costs_line(c: dict) -> str:
  """The controller's costs in one line: where they came from and what they are."""
  table = ",".join(f"{x:g}" for x in c["verify_costs"])
  line = f"{c['source']}: verify {table} AR steps (1, 2, 4, ... tokens), drafter {c['draft_cost']:g}"
  line += f" [{c['described']}]" if c.get("described") else ""
  if c.get("ar_step_tokens") == 2:
    line += "; AR steps run as two-token forwards (a one-token one costs more here)"
  if c.get("rows_cost") is not None and not c.get("tail_shrink"):
    line += (f"; batch tails keep their slots (a full batch's step costs {c['rows_cost']:.2f} "
             "one-row steps here)")
  return line + online_line(c.get("online"))


def ar_step_line(p: dict) -> str:
  """'two-token forwards (measured here: one token 6.190 ms, two 4.160 ms)': the AR steps'
  form and the probe it came from (`ar_step_probe_of`)."""
  form = "two-token forwards" if p["ar_step_tokens"] == 2 else "one-token forwards"
  return (f"{form} (measured here: one token {p['one_token_ms']:.3f} ms, two "
          f"{p['two_tokens_ms']:.3f} ms)")


def online_line(online: dict | None) -> str:
  """'; online (12 calls, batch 1): a cycle over 8 tokens costs 5.31 AR steps (0.84 ms per AR
  step)': the priced controller's estimate from its loop calls ('' when it is off)."""
  if not online or not online.get("online"):
    return ""
  parts = []
  for rows, e in online["by_batch_size"].items():
    evens = ", ".join(f"a cycle over {n} tokens costs {b:.2f}" for n, b in e["break_even"].items())
    ar = f" ({1e3 * e['ar_step_s']:.3f} ms per AR step)" if e["ar_step_s"] else ""
    # A batch's plain AR bucket: its step, and a cycle's price in its steps (the start rule's).
    plain = (f", plain AR loop {1e3 * e['plain_step_s']:.3f} ms per step (a cycle: "
             + ", ".join(f"{b:.2f}" for b in e["start_break_even"].values()) + " of them)"
             if e.get("plain_step_s") and e.get("start_break_even") else "")
    parts.append(f"online ({e['calls']} calls, batch {rows}): "
                 f"{evens + ' AR steps' if evens else 'no cycle yet'}{ar}{plain}")
  return "; " + "; ".join(parts)


def lengths_line(hist: dict) -> str:
  """'1: 12 (10%), 8: 108 (90%)': cycles per verify length."""
  total = sum(hist.values()) or 1
  return ", ".join(f"{k}: {n} ({100 * n / total:.0f}%)" for k, n in hist.items())


def print_summary(s: dict) -> None:
  """The summary's lines that apply to the run (a plain AR run has no block size, controller,
  drafter or τ)."""
  spec = s["mode"] == "spec"
  rows = [("mode", s["mode"]),
          *([("block policy", s["block_policy"]), ("block sizes used", s["block_sizes_used"])]
            if spec else []),
          *([("block sizes the policy picked", f"{s['block_sizes_picked']} (a batch decodes "
              "them at one size, Engine.joint_size)")]
            if spec and s.get("block_sizes_picked")
            and s["block_sizes_picked"] != s["block_sizes_used"] else []),
          *([("verify-length controller", s.get("controller", "-"))] if spec else []),
          *([("controller costs", costs_line(s["controller_costs"]))]
            if spec and s.get("controller_costs") else []),
          *([("drafter", s["drafter"])] if spec and s.get("drafter") else []),
          *([("AR steps", ar_step_line(s["ar_step_probe"]))] if s.get("ar_step_probe") else []),
          ("prompts", s["prompts"]),
          ("new tokens", s["new_tokens"]),
          ("tokens/s (prefill+decode)", s["tokens_per_s"]),
          ("decode tokens/s", s["decode_tokens_per_s"]),
          *([("tau (tokens per spec. cycle)", _fmt(s["tau"], ".3f")),
             ("tokens per target forward", _fmt(s["tokens_per_forward"], ".3f")),
             ("drafts verified per drafter pass", _fmt(s.get("mean_verified_drafts"), ".3f"))]
            if spec else []),
          *([("outputs for a seed", "may differ between runs: verify=rejection at T > 0 draws "
              "depend on where cycles start, which the priced controller picks from this "
              "machine's timings (verify=exact, or given controller_costs with "
              "controller_online_costs=off, repeat them)")]
            if not s.get("outputs_repeat_for_seed", True) else []),
          *([("decoded plain by the priced start", f"{s['plain_starts']} of {s['prompts']} "
              "requests (the recent requests' drafting lost, or a batch's policy expected it "
              "to before any had drafted)")] if s.get("plain_starts") else []),
          *([("moved to plain decoding mid-request", f"{s['moved_plain']} of {s['prompts']} "
              "requests (drafting lost there: cycles that kept missing, an explorer run's τ, or a "
              "tail whose slowest row ends sooner plain)")] if s.get("moved_plain") else []),
          *([(f"verify length per cycle (batch {s['verify_lengths_chosen']['batch_size']})",
              lengths_line(s["verify_lengths_chosen"]["lengths"]))]
            if spec and s.get("verify_lengths_chosen", {}).get("lengths") else []),
          *([("drafts accepted per expected (decline)",
              f"{_fmt(s['decline_evidence']['accepted_per_expected'], '.3f')} over the last "
              f"~{s['decline_evidence']['row_cycles']:g} row-cycles (verify length 1: a "
              "cycle that declined its drafts)")]
            if spec and s.get("decline_evidence") else []),
          *([("tokens per row-cycle after a miss (back-off gate)",
              f"{_fmt(s['backoff_gate']['tokens_after_miss'], '.2f')} against "
              f"{_fmt(s['backoff_gate']['tokens_per_cycle'], '.2f')} on average: misses "
              + (("back the rows off (cycles lose on average, at "
                  f"{s['backoff_gate']['cycle_price']:g} AR steps)")
                 if s["backoff_gate"].get("cycles_lose") else
                 "back the rows off" if s["backoff_gate"]["backs_off"] else
                 ("persist, but the cycles after them pay "
                  f"{evidence.PAYS_MULTIPLE:g}x their price "
                  f"({s['backoff_gate']['cycle_price']:g} AR steps): the next cycle runs at once")
                 if s["backoff_gate"].get("cycles_after_misses_pay")
                 and s["backoff_gate"]["misses_persist"] else
                 "do not persist, the next cycle runs at once"))]
            if spec and s.get("backoff_gate") else []),
          *([("slot time holding a decoding row", f"{s['slot_use']:.1%} (batched calls; "
              "idle slots cost as much as busy ones" + (
                  "; a batch's tail ran in fewer slots)" if s.get("shrink_batches")
                  else ")"))] if s.get("slot_use") is not None else []),
          *([("loop calls (every method of the run)", calls_line(s["loop_calls"]))]
            if s.get("loop_calls") else []),
          *([("plain loop timed by probes", f"{s['plain_probes']} calls on copies of drafting "
              "rows, their tokens dropped (among the loop calls; no request decoded plain "
              "for it)")] if s.get("plain_probes") else []),
          ("compilations", f"{s['compilations']} {s['compilations_by_function']}"),
          ("compile time (s)", f"{s['compile_s']} ({s['compile_cache_hits']} of "
                               f"{s['compilations']} loaded from the compile cache" + (
                                   f", {s['shared_programs']} shared with another engine of "
                                   "this run" if s.get("shared_programs") else "") + ")"),
          ("programs' first runs (s)", f"loops {s['loop_warmup_s']}, prefills "
                                        f"{s.get('prefill_warmup_s', 0.0)}"),
          ("peak RSS (MB)", s["peak_rss_mb"])]
  if s.get("ids_beyond_tokenizer"):
    rows.append(("ids the tokenizer can't decode", s["ids_beyond_tokenizer"]))
  width = max(len(k) for k, _ in rows)
  print("\n".join(f"  {k:<{width}}  {v}" for k, v in rows))
  if s.get("compare"):
    print_comparison(s)


def _against_ar(r: dict, ar: dict | None, speed: str, interval: str) -> str:
  """A comparison row's `speed` over AR's, with its interval (`interval`) where it has one: then
  the interval's own ratio, so that the printed figure and its bounds come from one computation
  (the tokens per second in the summary are rounded apart)."""
  if ar is None:
    return "-"
  if r.get(interval):
    return _ratio_text(r[interval])
  return f"{r[speed] / ar[speed]:.2f}x"


def _ratio_text(entry: dict | None) -> str:
  """A speedup entry ({"ratio", "lo", "hi"}) as printed: with its interval where it has one."""
  if entry is None:
    return "-"
  if entry.get("lo") is None:
    return f"{entry['ratio']:.2f}x"
  return "{ratio:.2f}x [{lo:.2f}, {hi:.2f}]".format(**entry)


def print_comparison(s: dict) -> None:
  """The methods of one interleaved run side by side, speedups against plain AR, and the run's
  own method against the best fixed size in hindsight where one was compared."""
  rows = {"main: " + s["main"]["method"]: s["main"], **s["compare"]}
  ar = next((r for r in rows.values() if r["method"] == "ar"), None)
  how = ("interleaved per request" if s.get("batch_size", 1) == 1 else
         f"in batches of {s['batch_size']}, one pass over the prompts per method, alternating")
  print(f"\n  compared in one run, {how}, fastest of {s['repeats']} "
        f"(T={s['temperature']}):")
  head = (f"  {'method':<16} {'decode tok/s':>12} {'speedup vs AR [95%]':>22} "
          f"{'end to end vs AR [95%]':>23} {'tau/cycle':>9} {'tok/forward':>11} "
          f"{'identical to AR':>16}")
  print(head)
  for name, r in rows.items():
    speed = _against_ar(r, ar, "decode_tokens_per_s", "speedup_vs_ar")
    whole = _against_ar(r, ar, "tokens_per_s", "end_to_end_vs_ar")
    same = r.get("identical_to_ar")
    mark = "-" if same is None else f"{'✓' if same == r['prompts'] else '✗'} {same}/{r['prompts']}"
    print(f"  {name:<16} {r['decode_tokens_per_s']:>12,.0f} {speed:>22} {whole:>23} "
          f"{_fmt(r['tau'], '.2f'):>9} {_fmt(r['tokens_per_forward'], '.2f'):>11} {mark:>16}")
  best = s.get("main_vs_best_fixed")
  if best:  # the bar a default must clear: the better of AR and the best fixed size
    print(f"  main: {s['main']['method']} against the best fixed size in hindsight "
          f"({best['method']}): {_ratio_text(best['decode'])} in decode time, "
          f"{_ratio_text(best['end_to_end'])} end to end")
  paired_best = bool(best and best["decode"] and best["decode"]["lo"] is not None)
  if any(r.get("speedup_vs_ar") for r in rows.values()) or paired_best:
    print(f"  ([95%]: paired bootstrap over the {s['prompts']} prompts, each method's fastest "
          "decode of each; end to end: that decode and the request's fastest prefill)")
  elif ar and s.get("batch_size", 1) > 1:
    print("  (no interval: a batch's requests share their loop calls, so their times are not "
          "the prompts' own)")
  if not same_tokens_as_ar(s["verify"], s["temperature"]):
    print("  (verify=rejection at T > 0 samples the target's own distribution, not AR's tokens "
          "for a seed: outputs are not compared)")

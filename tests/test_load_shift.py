"""benchmarks/load_shift.py's parts: when a phase's price counts as followed (alone and in a
batch), the phases a command line may name, the load it runs beside the decodes (processes
that start with the phase and are gone after it), and its units (a request alone, a group in a
batch)."""

from __future__ import annotations

import pytest

from benchmarks import load_shift
from bp_jax.errors import BadInputError


def _calls(break_evens, block_size=8):
  return [{"block_size": block_size, "break_even": b} for b in break_evens]


def test_followed_after_counts_speculative_calls_until_halfway():
  # From 3.0 toward this phase's median (4.75): halfway is 3.875, passed at the third
  # speculative call; the plain calls' prices (block size 1) are not its calls.
  calls = _calls([3.1, 3.5]) + _calls([9.0], block_size=1) + _calls([4.6, 5.0, 5.1, 4.9])
  assert load_shift.followed_after(calls, 3.0) == 3
  # Downward alike: from 6 toward 4 (halfway 5), passed at the second.
  assert load_shift.followed_after(_calls([5.5, 4.8, 4.0, 4.0, 3.9]), 6.0) == 2
  # Nothing to follow: no earlier phase, no speculative call, or a median within 10%.
  assert load_shift.followed_after(_calls([4.0, 4.2]), None) is None
  assert load_shift.followed_after(_calls([9.0], block_size=1), 3.0) is None
  assert load_shift.followed_after(_calls([3.1, 3.2, 3.0]), 3.0) is None


def test_phases_are_checked():
  assert load_shift.parse_phases("idle, load,idle") == ["idle", "load", "idle"]
  for bad in ("", "idle,busy"):
    with pytest.raises(BadInputError, match="--phases="):
      load_shift.parse_phases(bad)


def test_a_load_runs_its_processes_only_while_open():
  with load_shift.Load("compute", 2) as load:
    procs = list(load.running)
    assert len(procs) == 2 and all(p.poll() is None for p in procs)
  assert all(p.returncode is not None for p in procs) and not load.running


def test_drafted_and_plain_requests_are_reported_apart():
  from types import SimpleNamespace as G
  default = [G(plain_start=False, new_tokens=100, decode_s=0.5, acceptance_lengths=[4, 6]),
             G(plain_start=True, new_tokens=100, decode_s=1.0, acceptance_lengths=[]),
             G(plain_start=False, new_tokens=50, decode_s=0.5, acceptance_lengths=[2])]
  ar = [G(new_tokens=100, decode_s=1.0), G(new_tokens=100, decode_s=0.8),
        G(new_tokens=50, decode_s=0.5)]
  got = load_shift.by_start({"default": default, "ar": ar})
  # drafted: 150 tokens in 1.0 s against 150 in 1.5 s; τ over their 3 cycles
  assert got["drafted"] == {"requests": 2, "speedup_vs_ar": 1.5, "tau": 4.0}
  assert got["plain"] == {"requests": 1, "speedup_vs_ar": 0.8, "tau": None}
  assert "plain" not in load_shift.by_start({"default": default[::2], "ar": ar[::2]})


def test_a_batch_follows_the_price_in_plain_loop_steps():
  # A batch's start rule weighs a cycle in plain-loop steps at its size (`start_break_even`),
  # renewed by every call of that many slots, plain ones too; calls before any price (None)
  # and a tail's calls (fewer slots, their own size's price) are not the batch's.
  call = lambda size, be, start, rows=4: {"block_size": size, "break_even": be,
                                          "start_break_even": start, "rows": rows}
  calls = [call(1, 9.0, None), call(1, 9.0, 5.5), call(8, 3.0, 6.5), call(1, 3.0, 7.0),
           call(1, 3.0, 2.0, rows=1), call(1, 3.0, 7.2)]
  assert load_shift.prices(calls, rows=4) == [5.5, 6.5, 7.0, 7.2]
  assert load_shift.prices(calls) == [3.0]
  # From 5.0 toward this phase's median (6.75): halfway 5.875, passed at the second call.
  assert load_shift.followed_after(calls, 5.0, rows=4) == 2
  # One request's: the speculative call's 3.0 is the phase (from 5.0, past halfway at once).
  assert load_shift.followed_after(calls, 5.0) == 1


def test_a_unit_is_a_request_alone_or_a_group():
  from types import SimpleNamespace as G
  default = [G(plain_start=False, new_tokens=100, decode_s=0.5, acceptance_lengths=[4, 6],
               cycles=2, ar_steps=3, forward_verified=[8, 8, 0, 0, 0], output_ids=[1]),
             G(plain_start=True, new_tokens=100, decode_s=1.5, acceptance_lengths=[],
               cycles=0, ar_steps=100, forward_verified=[0] * 100, output_ids=[2])]
  ar = [G(new_tokens=100, decode_s=1.0, output_ids=[1]), G(new_tokens=100, decode_s=1.0,
                                                          output_ids=[1])]
  # 200 tokens in 2.0 s against 200 in 2.0 s; τ over the group's 2 cycles
  assert load_shift.unit_entry(default, ar) == {
      "requests": 2, "drafted": 1, "tau": 5.0, "cycles": 2, "ar_steps": 103, "speedup": 1.0}
  figures = load_shift.phase_figures(
      [{"block_size": 8, "break_even": 4.0, "start_break_even": 5.0, "rows": 2}],
      {"default": [default], "ar": [ar]}, 4.2, rows=2)
  assert (figures["requests"], figures["drafted"], figures["break_even"]["median"]) == (2, 1, 5.0)
  assert figures["speedup_vs_ar"]["ratio"] == 1.0 and figures["identical_to_ar"] == 1

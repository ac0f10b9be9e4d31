"""Advice for a Fleet loop (``RunFacts.own_loop``): its evaluation count and cadence are
what the loop was seen doing, and the fix names the loop's own lever in words, never a
config key only ``fit`` reads (``run.eval_every``, ``data.num_workers``, ...)."""

from __future__ import annotations

import re

from gpufleet.monitor.diagnose import RunFacts, Summary, diagnose

_ROW = {"rank": 0, "data": 0.0, "forward": 0.004, "backward": 0.008, "optimizer": 0.002,
        "other": 0.001}
# Keys of fit's config: none may be named to a Fleet loop, none offered to try there.
_FIT_KEYS = re.compile(r"\b(data|optim|run)\.[a-z_]+|checkpoint\.every|perf\.compile")


def _summary(**kw) -> Summary:
    base = {"steps": 100, "step_s": 0.015, "rank_phases": [dict(_ROW)], "train_s": 1.5}
    return Summary(**{**base, **kw})


def test_an_own_loop_s_evaluations_are_counted_as_it_ran_them():
    """The phase timer counted 1900 evaluation forwards (batches); the loop evaluated 8
    times, every 24 steps: the finding says so and asks the loop to evaluate less."""
    s = _summary(outside={"eval": (19.0, 1900)})
    facts = RunFacts(own_loop=True, evaluations=8, eval_every=24, steps=192)
    [found] = [f for f in diagnose(s, facts) if f.rule == "time-outside-steps"]
    assert "evaluations take 2.38 s each, 8 so far, every 24 step(s)" in found.message
    assert found.fix.startswith("evaluate less often in your loop: every 24 step(s) now")
    assert not _FIT_KEYS.search(found.fix) and found.changes == {}
    # fit's own loop keeps its key and interval
    fit = [f for f in diagnose(s, RunFacts(eval_every=200)) if f.rule == "time-outside-steps"]
    assert fit[0].fix.startswith("raise run.eval_every from 200")


def test_an_own_loop_saving_often_is_told_to_call_save_less_often():
    s = _summary(outside={"checkpoint": (6.0, 20)})
    [found] = diagnose(s, RunFacts(own_loop=True, steps=100))
    assert "20 so far, every 5 step(s)" in found.message  # 100 steps / 20 saves
    assert found.fix.startswith("call fleet.save less often in your loop: every 5 step(s)")
    assert "Fleet(overrides={'checkpoint.async_save': True})" in found.fix
    assert not _FIT_KEYS.search(found.fix)


def test_other_advice_names_the_loop_s_levers_not_fit_s_keys():
    """An input-bound own loop (data 60% of the step): the fix is about its DataLoader's
    num_workers, and no fit key is offered as a setting to try."""
    row = {**_ROW, "data": 0.03}
    s = _summary(rank_phases=[row], step_s=0.045)
    facts = RunFacts(own_loop=True, cpus_per_rank=8)
    [found] = [f for f in diagnose(s, facts) if f.rule == "input-bound"]
    assert "your DataLoader's num_workers" in found.fix
    assert not _FIT_KEYS.search(found.fix + found.message)
    assert not [k for k in found.changes if _FIT_KEYS.match(k)]
    fit = [f for f in diagnose(s, RunFacts(cpus_per_rank=8)) if f.rule == "input-bound"]
    assert "data.num_workers" in fit[0].fix and "data.num_workers" in fit[0].changes

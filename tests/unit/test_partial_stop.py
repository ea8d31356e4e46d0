"""Partial rollout (loop/schedule.py ``PartialSchedule._extend``): a sample aborted right after it emitted a stop
token (EOS or a sampling stop id) has ended, whatever its finish reason says: it is judged, never resumed past it."""

from __future__ import annotations

from megatron_dapo.loop.schedule import Slot
from megatron_dapo.types import Sample, SamplingParams, TokenizerInfo
from tests.unit.test_schedule import MAX_NEW, RESP, TickEngine, cfg, run_steps, schedule

EOS = RESP + 3  # one of the tick engine's response tokens


def _eos_engine() -> TickEngine:
    engine = TickEngine()
    engine.tokenizer = TokenizerInfo((EOS,), 0, decode=lambda ids: " ".join(map(str, ids)))
    return engine


def test_an_abort_right_after_a_stop_token_is_finished():
    s = schedule(cfg(), _eos_engine())
    stops = s._stop_ids(SamplingParams(stop_token_ids=(RESP + 5,)))
    assert stops == {EOS, RESP + 5}
    for last in (EOS, RESP + 5):
        slot = Slot()
        s._extend(slot, Sample([1, 2, 3], [RESP, last], [-0.5, -0.5], "abort"), MAX_NEW, stops)
        assert slot.finished and slot.finish_reason == "stop", last
    slot = Slot()  # an abort mid-answer stays unfinished (resumed next step)
    s._extend(slot, Sample([1, 2, 3], [RESP, RESP + 1], [-0.5, -0.5], "abort"), MAX_NEW, stops)
    assert not slot.finished
    slot = Slot()  # resumed, then aborted right after its EOS on the last token of its budget: it stopped
    s._extend(slot, Sample([1, 2, 3], [RESP] * (MAX_NEW - 1), [-0.5] * (MAX_NEW - 1), "abort"), MAX_NEW, stops)
    s._extend(slot, Sample([1, 2, 3], [EOS], [-0.5], "abort"), MAX_NEW, stops)
    assert slot.finish_reason == "stop" and slot.resumed == 1


def test_no_sample_is_resumed_past_its_eos():
    engine = _eos_engine()
    aborted_at_eos = []
    generate = engine.generate_requests

    def recording(requests, sampling):
        for smp in generate(requests, sampling):
            if smp.finish_reason == "abort" and smp.response_ids[-1:] == [EOS]:
                aborted_at_eos.append(smp)
            yield smp

    engine.generate_requests = recording
    s = schedule(cfg(), engine)
    steps = run_steps(s, 5)
    assert aborted_at_eos, "no sample was aborted right after EOS: the test checks nothing"
    resumed = [r for r in engine.requests if len(r.input_ids) > 3]
    assert resumed, "no sample was resumed"
    assert not [r.input_ids for r in resumed if r.input_ids[-1] == EOS]  # nothing continues after its EOS
    trained = [f for groups, *_ in steps for g in groups for f in g.finish_reasons]
    assert "abort" not in trained

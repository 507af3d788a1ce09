"""state: a saved state checked once — its version and mode, its fingerprint, every count an int
(numpy integers of any width accepted, bools and floats never), and mixture phases compared by what
they draw."""

import json

import numpy as np
import pytest

from tokenmill.base.errors import ConfigError
from tokenmill.load.state import Difference, consumed_of, count_of, phase_changes, phases_of, \
    respelled, same_weights


def test_consumed_of_checks_the_whole_state():
    state = {"version": 1, "consumed_samples": np.int64(8), "fingerprint": "f"}
    assert consumed_of(state, "f") == 8 and type(consumed_of(state, "f")) is int
    for bad, match in [({**state, "version": True}, "version"), ({**state, "fingerprint": "g"},
                       "fingerprint"), ({**state, "consumed_samples": 8.0}, "got consumed_sample"
                                                                             "s=8.0 of type float"),
                       (json.dumps(state, default=int), "version"),
                       ({**state, "mode": "stream"}, r"want version 1\)"),
                       ({**state, "consumed_samples": 2**63}, r"in \[0, 2\*\*63\)")]:
        with pytest.raises(ConfigError, match=match):
            consumed_of(bad, "f")
    stream = {**state, "mode": "stream"}
    assert consumed_of(stream, "f", mode="stream") == 8
    with pytest.raises(ConfigError, match="unsupported stream loader state .*mode 'stream'"):
        consumed_of(state, "f", mode="stream", kind="stream loader")
    assert consumed_of({**state, "fingerprint": "g"}, "f", also=("g",)) == 8


@pytest.mark.parametrize("value", [np.uint8(7), np.int16(7), np.int64(7), np.uint64(7), 7])
def test_a_count_is_a_plain_int_from_any_integer(value):
    assert count_of("pass_samples", value, minimum=1) == 7
    assert type(count_of("pass_samples", value, minimum=1)) is int


@pytest.mark.parametrize("value", [True, np.bool_(True), 7.0, "7", [7], 0])
def test_a_count_that_is_not_an_int_at_least_its_minimum_is_refused_saying_what_to_do(value):
    with pytest.raises(ConfigError, match=r"pass_samples must be an int >= 1 .*\(got pass_sampl"
                                          r"es=.*; pass the state_dict\(\) a loader saved"):
        count_of("pass_samples", value, minimum=1)


def test_weights_are_the_same_when_they_draw_the_same():
    assert same_weights({"a": 0.9, "b": 0.1}, {"a": 9, "b": 1})
    assert same_weights([0.9, 0.1], [9, 1]) and same_weights([1, 3], [0.25, 0.75])
    assert same_weights({"a": 1, "b": 0}, {"a": 3})  # weight 0: left out
    assert not same_weights({"a": 0.9, "b": 0.1}, {"a": 0.8, "b": 0.2})
    assert not same_weights({"a": 1}, {"b": 1}) and not same_weights([1, 1], [1, 1, 1])
    assert same_weights(None, None) and not same_weights(None, [1])


def test_respelled_gives_the_saved_spelling_only_for_the_same_draws_in_other_numbers():
    assert respelled([0.9, 0.1], (9.0, 1.0)) == (0.9, 0.1)
    assert respelled([9, 1], (0.9, 0.1)) == (9.0, 1.0)
    for saved in ([0.9, 0.1], [0.8, 0.2], [0.9], [0.9, 0.0], [True, 1], "ab", None, [0.9, "x"]):
        assert respelled(saved, (0.9, 0.1)) is None, saved


def test_phase_changes_name_each_phase_and_refuse_only_those_begun():
    saved = [[0, {"a": 0.9, "b": 0.1}], [40, {"a": 1.0}], [100, {"b": 1.0}]]
    respelled_ = [[0, {"a": 9, "b": 1}], [40, {"a": 5}], [100, {"b": 2}]]
    assert phase_changes(saved, respelled_, 60) == []
    edited = [[0, {"a": 0.9, "b": 0.1}], [40, {"a": 0.5, "b": 0.5}], [120, {"b": 1.0}]]
    assert phase_changes(saved, edited, 60) == [
        Difference("phase 1 (from sample 40) changed {'a': 1.0} → {'a': 0.5, 'b': 0.5}, but it "
                   "started before the checkpoint (the run has consumed 60 samples): only phases "
                   "that start after the checkpoint may change", False),
        Difference("phase 2 (from sample 100) was removed (starts after the checkpoint)", True),
        Difference("phase 2 (from sample 120) was added (starts after the checkpoint)", True)]


@pytest.mark.parametrize("record", [None, "phases", [[0]], [[0, {"a": "1"}]], [[-1, {"a": 1}]],
                                    [[True, {"a": 1}]], [[0, {"a": -1}]]])
def test_a_malformed_saved_schedule_is_refused_in_one_line(record):
    with pytest.raises(ConfigError, match="pass the state_dict\\(\\) a loader saved, unchanged"):
        phases_of(record)

"""Meter: exact arithmetic on a scripted clock, every verdict boundary, token counting, MFU."""

import math
import tracemalloc

import numpy as np
import pytest

from tokenmill.base.errors import ConfigError
from tokenmill.observe.metrics import (
    DATA_BOUND_ABOVE_PCT,
    EXCELLENT_BELOW_PCT,
    POOR_ABOVE_PCT,
    Instrumented,
    Meter,
    ModelCost,
    count_tokens,
    verdict_for,
)


class FakeClock:
    """Time moves only when the scripted iterator waits or the scripted loop steps."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def scripted(clock, waits, batch=None):
    """Yields one batch per scripted wait, each after blocking that long."""
    for w in waits:
        clock.advance(w)
        yield batch


def drive(meter, clock, steps):
    """The training loop: step k of the consumer takes steps[k] seconds."""
    steps = iter(steps)
    for _ in meter:
        clock.advance(next(steps))


def metered(waits, steps, **kw):
    clock = FakeClock()
    meter = Meter(scripted(clock, waits, kw.pop("batch", None)), clock=clock,
                  **{"tokens_per_batch": 1000, **kw})
    drive(meter, clock, steps)
    return meter


# ---- arithmetic --------------------------------------------------------------------------------


def test_exact_numbers_on_a_scripted_clock():
    # first next() 7 s (not counted); waits 1+1+2+4 = 8 s; steps 20+18+18+18+18 = 92 s; wall 100 s
    s = metered([7.0, 1.0, 1.0, 2.0, 4.0], [20.0, 18.0, 18.0, 18.0, 18.0]).summary()
    assert s["steps"] == 5
    assert s["time_to_first_batch_s"] == 7.0
    assert s["wait_s"] == 8.0
    assert s["wall_s"] == 100.0
    assert s["data_wait_pct"] == 8.0
    assert s["tokens"] == 5000
    assert s["tokens_per_s"] == 50.0  # 5 batches × 1000 tokens processed in 100 s
    assert s["steps_per_s"] == 0.05
    assert s["wait_p50_ms"] == 1500.0
    assert s["wait_p99_ms"] == pytest.approx(3940.0, rel=1e-12)  # linear: 2 + 0.97 × (4 − 2) s
    assert s["step_p50_ms"] == 18000.0
    assert s["verdict"] == "data-bound (mild)"
    assert s["verdict_detail"] == ("waited 8.0 s of 100.0 s wall (8.00%); median wait 1.5 s vs "
                                   "median step 18.0 s; first batch after 7.0 s (not counted)")
    assert s["queue_depth"] is None and s["stage_s"] is None
    assert s["flops_per_s"] is None and s["mfu"] is None


def test_percentiles_are_exact_and_cover_only_the_window():
    waits = [0.0] + [k / 1024 for k in range(101)]  # exact in binary; p99 index 0.99·100 = 99
    order = np.random.default_rng(0).permutation(101)
    s = metered([waits[0]] + [waits[1 + i] for i in order], [1.0] * 102).summary()
    assert s["wait_p50_ms"] == 50 * 1000 / 1024
    assert s["wait_p99_ms"] == 99 * 1000 / 1024
    # window=4 keeps only the last four waits for percentiles; totals keep everything
    s = metered([0.0, 64.0, 1.0, 1.0, 1.0, 1.0], [2.0] * 6, window=4).summary()
    assert s["wait_p99_ms"] == 1000.0
    assert s["wait_s"] == 68.0


def test_the_first_batch_is_reported_apart_and_a_step_in_progress_is_not_counted():
    clock = FakeClock()
    meter = Meter(scripted(clock, [30.0, 1.0, 1.0]), clock=clock, tokens_per_batch=10)
    next(meter)
    assert meter.summary()["time_to_first_batch_s"] == 30.0
    assert meter.summary()["verdict"] == "warming up"
    assert meter.summary()["data_wait_pct"] == 0.0
    clock.advance(9.0)
    next(meter)  # step 1 (9 s) ends, wait 1 s
    clock.advance(500.0)  # step 2 in progress: not counted yet
    s = meter.summary()
    assert (s["steps"], s["wall_s"], s["data_wait_pct"], s["tokens_per_s"]) == (2, 10.0, 10.0, 1.0)


def test_breaking_out_of_the_loop_and_an_empty_iterable():
    clock = FakeClock()
    meter = Meter(scripted(clock, [1.0, 1.0, 1.0, 1.0]), clock=clock, tokens_per_batch=1)
    for i, _ in enumerate(meter):
        clock.advance(3.0)
        if i == 1:
            break
    s = meter.summary()
    assert (s["steps"], s["wall_s"], s["wait_s"]) == (2, 4.0, 1.0)
    empty = Meter([], clock=FakeClock()).summary()
    assert empty["steps"] == 0 and empty["time_to_first_batch_s"] is None
    assert empty["verdict"] == "warming up" and empty["tokens_per_s"] == 0.0


def test_reset_measures_from_now_and_keeps_time_to_first_batch():
    clock = FakeClock()
    meter = Meter(scripted(clock, [5.0, 50.0, 50.0, 1.0, 1.0]), clock=clock, tokens_per_batch=10)
    it = iter(meter)
    for _ in range(3):
        next(it)
        clock.advance(2.0)
    meter.reset()  # mid-step 3: its remaining time counts from here
    clock.advance(8.0)
    for _ in it:
        clock.advance(8.0)
    s = meter.summary()
    # after reset: step 8, wait 1, step 8, wait 1, step 8 → wall 26, wait 2; 3 steps ended
    assert (s["steps"], s["wall_s"], s["wait_s"], s["time_to_first_batch_s"]) == (2, 26.0, 2.0, 5.0)
    assert s["tokens_per_s"] == 30 / 26


def test_works_with_any_iterator_and_the_real_clock():
    meter = Meter(iter([np.zeros((2, 3))] * 4))
    assert iter(meter) is meter
    assert sum(1 for _ in meter) == 4
    s = meter.summary()
    assert s["steps"] == 4 and s["tokens"] == 24
    assert s["wall_s"] >= 0 and 0 <= s["data_wait_pct"] <= 100


def test_the_loop_allocates_nothing_per_step():
    meter = Meter(range(60_000), tokens_per_batch=1, window=1000)
    for _ in range(1000):
        next(meter)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for _ in meter:
        pass
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert grown < 20_000, grown  # 59,000 steps; a float each would be ~1.4 MB


# ---- verdict ------------------------------------------------------------------------------------


def test_verdict_bands_and_which_side_each_boundary_falls_on():
    assert (EXCELLENT_BELOW_PCT, DATA_BOUND_ABOVE_PCT, POOR_ABOVE_PCT) == (1.0, 5.0, 20.0)
    below, above = lambda x: np.nextafter(x, -np.inf), lambda x: np.nextafter(x, np.inf)
    assert verdict_for(0.0) == "compute-bound (excellent)"
    assert verdict_for(below(1.0)) == "compute-bound (excellent)"
    assert verdict_for(1.0) == "compute-bound"
    assert verdict_for(above(1.0)) == "compute-bound"
    assert verdict_for(below(5.0)) == "compute-bound"
    assert verdict_for(5.0) == "compute-bound"
    assert verdict_for(above(5.0)) == "data-bound (mild)"
    assert verdict_for(below(20.0)) == "data-bound (mild)"
    assert verdict_for(20.0) == "data-bound (mild)"
    assert verdict_for(above(20.0)) == "data-bound (poor)"
    assert verdict_for(100.0) == "data-bound (poor)"


@pytest.mark.parametrize("wait,verdict", [
    (0.5, "compute-bound (excellent)"), (1.0, "compute-bound"), (1.5, "compute-bound"),
    (5.0, "compute-bound"), (5.5, "data-bound (mild)"), (20.0, "data-bound (mild)"),
    (20.5, "data-bound (poor)"), (99.5, "data-bound (poor)")])  # 100%: no step (below)
def test_meter_verdict_at_the_boundaries(wait, verdict):
    # wall = (100 − wait) step + wait + 0 step = 100 s, so data wait % == wait exactly
    s = metered([3.0, wait], [100.0 - wait, 0.0]).summary()
    assert s["data_wait_pct"] == wait
    assert s["verdict"] == verdict


# ---- stages and queue depth ---------------------------------------------------------------------


class FakeLoader:
    """Instrumented: `__iter__` returns a generator (like Loader); stages are cumulative seconds."""

    def __init__(self, clock, waits, per_batch, depths):
        self.clock, self.waits, self.per_batch, self.depths = clock, waits, per_batch, iter(depths)
        self.stages = {k: 0.0 for k in per_batch}

    def __iter__(self):
        for w in self.waits:
            self.clock.advance(w)
            for k, v in self.per_batch.items():
                self.stages[k] += v
            yield {"inputs": np.zeros((4, 8), np.int32), "targets": np.zeros((4, 8), np.int32)}

    def stage_times(self):
        return dict(self.stages)

    def queue_depth(self):
        return next(self.depths)


def test_stage_attribution_and_queue_depth_from_an_instrumented_iterable():
    clock = FakeClock()
    loader = FakeLoader(clock, [9.0, 5.0, 5.0, 5.0], {"read": 0.5, "assemble": 4.0,
                                                    "transfer": 0.25}, depths=[0, 1, 2])
    assert isinstance(loader, Instrumented)
    meter = Meter(loader, clock=clock)
    drive(meter, clock, [15.0, 15.0, 15.0, 15.0])
    s = meter.summary()
    assert s["data_wait_pct"] == 20.0  # 15 s of 75 s
    assert s["tokens_per_s"] == 4 * 32 / 75
    # counted from the end of the first batch
    assert s["stage_s"] == {"read": 1.5, "assemble": 12.0, "transfer": 0.75}
    assert s["queue_depth"] == 1.0
    assert s["verdict"] == "data-bound (mild): assemble"
    assert s["verdict_detail"] == (
        "waited 15.0 s of 75.0 s wall (20.00%); median wait 5.0 s vs median step 15.0 s; "
        "stages read 1.5 s, assemble 12.0 s, transfer 750.0 ms; mean queue depth 1.0; "
        "first batch after 9.0 s (not counted)")


def test_stages_do_not_name_a_culprit_when_compute_bound_and_attributes_work_too():
    class Attr:
        stage_times = {"read": 1.0}

        def __iter__(self):
            return iter([1, 2, 3])

    s = metered([0.0, 0.0], [1.0, 1.0]).summary()
    assert s["verdict"] == "compute-bound (excellent)"
    meter = Meter(Attr(), clock=FakeClock())
    list(meter)
    s = meter.summary()
    assert s["stage_s"] == {"read": 0.0} and s["queue_depth"] is None


# ---- tokens -------------------------------------------------------------------------------------


class TorchLike:
    """`.size` is a method, as in torch."""

    def __init__(self, *shape):
        self.shape = shape

    def size(self):
        return self.shape

    def numel(self):
        return math.prod(self.shape)


class JaxLike:
    """`.size` is an int; converting to numpy would copy off the device, so it must not happen."""

    size = 96
    shape = (8, 12)

    def __array__(self, *a, **k):
        raise AssertionError("copied a device array to the host")


def test_count_tokens_for_dicts_tuples_and_arrays():
    arr = np.zeros((8, 16), np.int32)
    assert count_tokens(arr) == 128
    assert count_tokens({"targets": np.zeros(3), "inputs": arr}) == 128
    assert count_tokens({"meta": "x", "ids": np.zeros((2, 5))}) == 10  # first array-like value
    assert count_tokens((arr, np.zeros(1))) == 128
    assert count_tokens([np.zeros((3, 3)), arr]) == 9
    assert count_tokens({"inputs": TorchLike(4, 1024)}) == 4096
    assert count_tokens((JaxLike(),)) == 96
    assert count_tokens([[1, 2, 3]]) == 3  # a list of numbers is the token array itself
    assert count_tokens([5, 6]) == 2
    with pytest.raises(TypeError, match="tokens_per_batch"):
        count_tokens({"text": "hello"})


def test_meter_counts_tokens_unless_told():
    batch = {"inputs": np.zeros((2, 50)), "targets": np.zeros((2, 50))}
    assert metered([0.0, 0.0], [1.0, 1.0], batch=batch, tokens_per_batch=None).summary()[
        "tokens_per_s"] == 100.0
    assert metered([0.0, 0.0], [1.0, 1.0], batch=batch, tokens_per_batch=7).summary()[
        "tokens_per_s"] == 7.0


# ---- MFU ----------------------------------------------------------------------------------------


def test_model_cost_from_params_uses_6n_plus_attention():
    cost = ModelCost.from_params(124_000_000, seq_len=1024, n_layers=12, d_model=768)
    assert cost.flops_per_token == 6 * 124_000_000 + 12 * 12 * 768 * 1024 == 857_246_208
    assert cost.peak_flops is None
    with pytest.raises(ConfigError, match="seq_len"):
        ModelCost.from_params(1, seq_len=0, n_layers=1, d_model=1)
    with pytest.raises(ConfigError, match="flops_per_token"):
        ModelCost(0)
    with pytest.raises(ConfigError, match="peak_flops"):
        ModelCost(1.0, peak_flops=float("nan"))


def test_achieved_flops_and_mfu():
    f = 857_246_208
    cost = ModelCost.from_params(124_000_000, seq_len=1024, n_layers=12, d_model=768,
                                 peak_flops=100 * f)
    s = metered([0.0, 1.0], [9.0, 10.0], tokens_per_batch=1000, cost=cost).summary()
    assert s["tokens_per_s"] == 100.0  # 2000 tokens in 20 s
    assert s["flops_per_s"] == 100 * f
    assert s["mfu"] == 1.0
    s = metered([0.0, 1.0], [9.0, 10.0], tokens_per_batch=1000, cost=ModelCost(f)).summary()
    assert s["flops_per_s"] == 100 * f and s["mfu"] is None


# ---- the report ---------------------------------------------------------------------------------


def test_report_format():
    m = metered([1.0, 0.5, 0.5], [9.0, 10.0, 0.0], tokens_per_batch=322_000)
    assert m.report() == ("step 3 | 48,300 tok/s | data wait 5.0% | p99 wait 500.0 ms | "
                          "compute-bound")
    m = metered([1.0, 0.5, 0.5], [9.0, 10.0, 0.0], tokens_per_batch=322_000,
                cost=ModelCost(1e6, peak_flops=386.4e9))
    assert m.report() == ("step 3 | 48,300 tok/s | data wait 5.0% | p99 wait 500.0 ms | "
                          "MFU 12.5% | compute-bound")


def test_report_every_calls_log_at_the_end_of_every_nth_step_and_is_not_timed():
    clock, lines = FakeClock(), []

    def log(line):
        lines.append(line)
        clock.advance(1000.0)  # a slow logger is nobody's wait and nobody's step

    meter = Meter(scripted(clock, [0.0, 1.0, 1.0, 1.0, 1.0]), clock=clock, tokens_per_batch=1,
                  report_every=2, log=log)
    drive(meter, clock, [4.0] * 5)
    assert [ln.split(" | ")[0] for ln in lines] == ["step 2", "step 4"]
    assert lines[0] == ("step 2 | 0 tok/s | data wait 11.1% | p99 wait 1,000.0 ms | "
                        "data-bound (mild)")
    assert meter.summary()["wall_s"] == 24.0


def test_bad_settings_are_refused_with_the_value():
    for kw, name in [({"report_every": 0}, "report_every"), ({"window": 0}, "window"),
                     ({"tokens_per_batch": -1}, "tokens_per_batch"), ({"cost": 5.0}, "cost")]:
        with pytest.raises(ConfigError, match=name):
            Meter([], **kw)


def test_a_loop_that_does_no_work_gets_no_verdict_on_overlap():
    """The README's quick start metered a loop whose body is `pass`: it said "data-bound (poor)".
    With no step there is nothing to overlap data with: the verdict says so, not "poor"."""
    s = metered([0.5, 1e-4, 1e-4, 1e-4], [2e-6, 1e-6, 1e-6, 1e-6]).summary()
    assert s["data_wait_pct"] > 90
    assert s["verdict"] == ("no step to compare with (median step 1.0 µs): the data wait of a "
                            "loop that does no work; meter the training step")
    assert metered([0.5, 1e-4, 1e-4], [1e-2, 1e-2, 1e-2]).summary()["verdict"] == "compute-bound (excellent)"

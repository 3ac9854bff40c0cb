"""bench/timing.py on the CPU: medians of host-timed runs, and the line-up option checked."""

import time

import pytest
import torch

from fused_dlrm.bench.timing import per_call_us, time_ms


def test_time_ms_is_the_median_run_on_the_cpu():
    calls = []

    def run():  # one slow run in the middle must not move the median
        calls.append(None)
        time.sleep(0.05 if len(calls) == 8 else 0.002)

    ms = time_ms(run, warmup=2, iters=11, device=torch.device("cpu"))
    assert len(calls) == 13
    assert 2.0 <= ms < 20.0


def test_time_ms_names_a_bad_start():
    with pytest.raises(ValueError, match="start must be 'host' or 'device'"):
        time_ms(lambda: None, device=torch.device("cpu"), start="gpu")

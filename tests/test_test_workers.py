"""The test run's pytest-xdist workers share the cores out instead of each taking all of them."""

from __future__ import annotations

import os

import pytest

from alpacafarm.testing.pytest_plugin import worker_threads


def test_workers_share_the_cores_and_a_plain_run_or_a_callers_setting_is_left_alone():
    assert worker_threads({"workercount": 2}, 2, {}) == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    assert worker_threads({"workercount": 4}, 16, {}) == {"OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "4"}
    assert worker_threads({"workercount": 4}, 2, {})["OMP_NUM_THREADS"] == "1"
    assert worker_threads(None, 2, {}) == {}
    assert worker_threads({"workercount": 2}, 2, {"OMP_NUM_THREADS": "2"}) == {}


def test_this_worker_runs_with_a_share_of_the_cores():
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if count is None:
        pytest.skip("not under pytest-xdist")
    import torch

    assert int(os.environ["OMP_NUM_THREADS"]) == torch.get_num_threads()
    if int(count) > 1:
        assert torch.get_num_threads() < (os.cpu_count() or 1) or (os.cpu_count() or 1) == 1

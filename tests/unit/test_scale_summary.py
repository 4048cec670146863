"""benchmarks/scale.py's memory figure: the Python heap's growth over the second half of a run, which must
tell a leak from the steps and transient peaks a flat heap shows (a per-partition view built once, a
watermark refresh's objects alive at the moment a batch is sampled)."""
from __future__ import annotations

import importlib.util
import pathlib
import random

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("scale_benchmark", ROOT / "benchmarks" / "scale.py")
scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scale)


def _flat_heap(batches: int, leak_per_batch: float = 0.0) -> list[int]:
    rng = random.Random(3)
    blocks = []
    for i in range(batches):
        n = 297_500 + (30_000 if i >= 350 else 0) + rng.randrange(-200, 200) + int(leak_per_batch * i)
        if i % 240 == 7:
            n += 150_000  # a refresh under way when the batch was sampled
        blocks.append(n)
    return blocks


def test_a_flat_heap_with_a_step_and_transient_peaks_reads_as_flat():
    blocks = _flat_heap(1000)
    assert abs(scale._steady_growth(blocks)) < 100
    assert scale._slope(blocks) * 100 > 2_000  # what a plain slope over the run said


def test_a_leak_of_one_object_a_read_shows():
    assert scale._steady_growth(_flat_heap(1000, leak_per_batch=80)) > 7_000


def test_too_short_a_run_says_nothing():
    assert scale._steady_growth(_flat_heap(100)) is None

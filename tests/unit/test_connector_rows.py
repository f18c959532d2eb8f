"""`rows.copy_rows` on CPU tensors (on a GPU the same runs go through ``cudaMemcpy2DAsync``)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvharbor.connector.vllm.rows import copy_rows, gpu_row_copies  # noqa: E402


def test_rows_of_each_run_land_back_to_back() -> None:
    source = torch.arange(100, dtype=torch.uint8)
    target = torch.zeros(12, dtype=torch.uint8)
    # Rows of 3 bytes every 10: two from 5 (5..7, 15..17), one from 60 (60..62); target has room to spare.
    copy_rows(target, source, [(5, 2), (60, 1)], row_bytes=3, pitch_bytes=10)
    assert target.tolist() == [5, 6, 7, 15, 16, 17, 60, 61, 62, 0, 0, 0]


def test_rows_outside_the_source_or_past_the_target_are_refused() -> None:
    source, target = torch.zeros(100, dtype=torch.uint8), torch.zeros(6, dtype=torch.uint8)
    with pytest.raises(ValueError, match="lie outside a 100 B source"):
        copy_rows(target, source, [(95, 2)], row_bytes=3, pitch_bytes=3)
    with pytest.raises(ValueError, match="9 B of rows into a buffer of 6 B"):
        copy_rows(target, source, [(0, 3)], row_bytes=3, pitch_bytes=10)
    with pytest.raises(ValueError, match="rows of 4 B every 3 B"):
        copy_rows(target, source, [(0, 1)], row_bytes=4, pitch_bytes=3)
    assert not target.any()


def test_the_start_line_says_how_rows_reach_a_gpu() -> None:
    # No CUDA runtime in this CPU build's process: rows would be copied one by one.
    assert gpu_row_copies().startswith("one copy per row")

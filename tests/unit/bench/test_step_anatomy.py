"""`specserve bench step` (bench/step_anatomy.py): a small real run on the default model through the
native kernels' phase-timed build, and its table."""

from __future__ import annotations

import json

import pytest

from specserve.bench import step_anatomy
from specserve.kernels import cpu as native


def test_a_small_run_splits_the_step_into_its_phases(default_model, tmp_path):
    if not native.available():
        pytest.skip("no C compiler: the native CPU kernels are not built here")
    out = tmp_path / "step"
    assert step_anatomy.main(["--contexts", "8", "40", "--max-tokens", "4", "--repeats", "1", "--threads", "2",
                              "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["benchmark"] == "step_anatomy" and result["command"].startswith("specserve bench step")
    assert [row["context"] for row in result["rows"]] == [8, 40]
    for row in result["rows"]:
        assert all(row[p] > 0 for p in step_anatomy.PHASES)       # the timed build ran every phase
        parts = sum(row[p] for p in step_anatomy.PHASES) + row["host"]
        assert row["step"] == pytest.approx(parts, abs=1e-3) and row["step"] > row["matmuls"] + row["lm_head"]
    text = step_anatomy.markdown(result)
    assert "| 40 |" in text and "step / matmuls" in text


def test_the_normal_build_has_no_phase_timers():
    if not native.available():
        pytest.skip("no C compiler: the native CPU kernels are not built here")
    import ctypes

    phases = (ctypes.c_double * len(step_anatomy.PHASES))(1.0, 1.0, 1.0, 1.0)
    assert native.library().phase_times(phases) == 0 and list(phases) == [0.0] * 4

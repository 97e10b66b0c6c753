"""benchmarks/keras_scaling.py keeps running: its --quick mode at 1 and 2 ranks, checked for structure and
correctness (weights in sync on every rank, ringtrain's custom loop == MultiWorkerMirroredStrategy's to 1e-4),
never for speed. Deselect with `-m "not bench"`."""
import json
import os
import sys

import pytest

from test_benchmarks import BENCH_DIR, mpiexec, run_script
from test_parallel_tf import require_tensorflow

pytestmark = pytest.mark.bench


@pytest.mark.timeout(900)
def test_keras_scaling_quick(tmp_path):
    require_tensorflow()
    if mpiexec() is None:
        pytest.skip("mpiexec not found")
    out_json = str(tmp_path / "keras_scaling.json")
    stdout = run_script([sys.executable, os.path.join(BENCH_DIR, "keras_scaling.py"), "--quick", "--max-ranks", "2",
                         "--json", out_json], timeout=840)
    with open(out_json) as f:
        records = json.load(f)["records"]
    by_key = {(r["ranks"], r["mode"]): r for r in records}
    for ranks in (1, 2):
        for mode in ("fit/no-comm", "fit/ringtrain", "loop/no-comm", "loop/ringtrain") + ("loop/mwms",) * (ranks > 1):
            record = by_key[(ranks, mode)]
            assert record["samples_per_s_total"] > 0 and record["params_in_sync"], record
    assert by_key[(1, "fit/no-comm")]["efficiency"] == pytest.approx(1.0)
    assert by_key[(2, "loop/ringtrain")]["max_weight_diff_ringtrain_vs_mwms"] < 1e-4
    assert "fit/ringtrain" in stdout and "efficiency" in stdout

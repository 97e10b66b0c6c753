"""The benchmark scripts keep running: each --quick mode runs here and its output is checked for structure and
correctness (#wrong == 0, parameters in sync), never for speed. Deselect with `-m "not bench"`."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from extras import need

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(REPO_ROOT, "benchmarks")
sys.path.insert(0, BENCH_DIR)

import common          # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
import jax_scaling     # noqa: E402
import scaling_model   # noqa: E402
import train_report    # noqa: E402
import train_scaling   # noqa: E402

pytestmark = pytest.mark.bench

README_IMPLEMENTATIONS = {"ringtrain-shm", "ringtrain-mpi", "ringtrain-shm-raw", "ringtrain-mpi-raw", "MPI_Allreduce",
                          "torch-gloo"}
RECORD_KEYS = {"impl", "ranks", "bytes", "dtype", "op", "time_us", "algbw_gbps", "busbw_gbps", "wrong"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def mpiexec():
    beside_python = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside_python if os.path.exists(beside_python) else shutil.which("mpiexec")


def run_script(command, timeout):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}\n{done.stdout[-3000:]}\n" \
                                 f"{done.stderr[-3000:]}"
    return done.stdout


def assert_png(path):
    with open(path, "rb") as f:
        assert f.read(8) == PNG_MAGIC, f"{path} is not a PNG"


@pytest.fixture(scope="module")
def allreduce_quick(tmp_path_factory):
    if mpiexec() is None:
        pytest.skip("mpiexec not found")
    need("matplotlib", "bench")      # the --png plot
    folder = tmp_path_factory.mktemp("allreduce")
    out_json, out_png = str(folder / "allreduce.json"), str(folder / "allreduce.png")
    stdout = run_script([mpiexec(), "-n", "2", sys.executable, os.path.join(BENCH_DIR, "allreduce.py"), "--quick",
                         "--json", out_json, "--png", out_png], timeout=150)
    with open(out_json) as f:
        return json.load(f), stdout, out_png, out_json


def test_allreduce_quick_records_are_complete_and_correct(allreduce_quick):
    records, stdout, out_png, _ = allreduce_quick
    assert isinstance(records, list) and records
    impls = {r["impl"] for r in records}
    # every host implementation README.md's Performance table quotes, and the torch-tensor path, must have run
    # (GPU ones skip here)
    wanted = README_IMPLEMENTATIONS | {"ringtrain-torch-shm", "ringtrain-shm-adasum"}
    assert wanted <= impls, (sorted(wanted - impls), stdout[-3000:])
    for r in records:
        assert RECORD_KEYS <= set(r), r
        assert r["wrong"] == 0, f"{r['impl']} {r['dtype']} {r['bytes']} B: {r['wrong']} wrong elements"
        assert r["ranks"] == 2 and r["dtype"] == "float32"
        assert r["op"] == {"ringtrain-shm-average": "average", "ringtrain-shm-adasum": "adasum"}.get(r["impl"], "sum")
        assert r["time_us"] > 0
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9, rel=1e-9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 2 * (2 - 1) / 2, rel=1e-9)
    for impl in impls:
        sizes = sorted(r["bytes"] for r in records if r["impl"] == impl)
        assert sizes == [4096, 16384, 65536, 262144, 1048576], (impl, sizes)
    for column in ("size", "count", "dtype", "op", "time_us", "algbw", "busbw", "#wrong"):
        assert column in stdout
    assert "ratio vs MPI_Allreduce" in stdout and "memcpy bandwidth" in stdout
    assert_png(out_png)


def test_scaling_model_runs_on_the_quick_allreduce_json(allreduce_quick, tmp_path):
    _, _, _, allreduce_json = allreduce_quick
    out_json, out_png = str(tmp_path / "model.json"), str(tmp_path / "model.png")
    stdout = run_script([sys.executable, os.path.join(BENCH_DIR, "scaling_model.py"), "--allreduce-json",
                         allreduce_json, "--json", out_json, "--png", out_png], timeout=60)
    with open(out_json) as f:
        result = json.load(f)
    assert {f["impl"] for f in result["fits"]} >= {"MPI_Allreduce", "ringtrain-shm"}
    assert {p["algorithm"] for p in result["projections"]} == set(scaling_model.ALGORITHMS)
    assert max(p["ranks"] for p in result["projections"]) == 1024
    assert all(0 < p["efficiency"] <= 1 for p in result["projections"])
    assert len(result["published"]) == len(scaling_model.PUBLISHED)
    assert "agrees" in stdout or "too" in stdout
    assert_png(out_png)


def test_train_scaling_quick(tmp_path):
    if mpiexec() is None:
        pytest.skip("mpiexec not found")
    pytest.importorskip("torch")
    need("matplotlib", "bench")      # the --png plot
    out_json, out_png = str(tmp_path / "train.json"), str(tmp_path / "train.png")
    stdout = run_script([sys.executable, os.path.join(BENCH_DIR, "train_scaling.py"), "--quick", "--max-ranks", "2",
                         "--metric", "--json", out_json, "--png", out_png], timeout=300)
    with open(out_json) as f:
        result = json.load(f)
    records = result["records"]
    assert len(result["machine"]["commit"]) >= 40 or result["machine"]["commit"] == "unknown"
    ran = {(r["model"], r["ranks"], r["mode"]): r for r in records if "skipped" not in r}
    modes = ["no-comm", "lockstep", "torch-ddp"] + [m + twin for m in ("ringtrain-after-backward", "ringtrain-overlap")
                                                     for twin in ("", "+metric", "+paired")]
    if importlib.util.find_spec("horovod") is not None:   # the optional peer, where someone built it
        modes.append("horovod")
    else:
        assert {(r["model"], r["ranks"], r["mode"]) for r in records if "skipped" in r} == \
            {(m, n, "horovod") for m in ("convnet", "mlp") for n in (1, 2)}
    expected = {(model, n, m) for model in ("convnet", "mlp") for n in (1, 2) for m in modes}
    assert set(ran) == expected, sorted(ran)
    for (model, ranks, mode), r in ran.items():
        assert r["params_in_sync"], f"{model} {mode} at {ranks} ranks left different parameters on different ranks"
        assert r["samples_per_s_total"] == pytest.approx(ranks * r["samples_per_s_per_rank"])
        assert r["efficiency"] > 0   # never a speed bound: this machine is shared and noisy
        assert 0 < r["forward_backward_ms"] < r["step_ms"] and r["page_faults_per_step"] >= 0
        if mode not in ("no-comm", "lockstep", "torch-ddp"):
            # same seed, same data, averaged gradients: ringtrain (and Horovod) must train exactly what DDP trains
            assert r["max_param_diff_vs_ddp"] <= 1e-4, (model, ranks, mode, r["max_param_diff_vs_ddp"])
        if mode == "ringtrain-overlap" and ranks > 1:
            assert r["hidden_share"] is not None and 0 <= r["hidden_share"] <= 1
        if mode == "ringtrain-after-backward":
            assert r["hidden_share"] is None       # no allreduce runs before backward returns
        if mode.endswith("+metric"):
            assert r["metric_ms"] > 0
        if mode.endswith("+paired"):
            # 4 measured steps after 2 warm-up steps (indices 2-5, ABBA by index): each call first twice, second twice
            assert {key: len(times) for key, times in r["pair"].items()} == \
                dict.fromkeys(train_report.PAIR_SAMPLES, 2), r["pair"]
            assert all(t > 0 for times in r["pair"].values() for t in times)
            assert len(r["pair_round_excess_ms"]) == 1
    for model in ("convnet", "mlp"):   # the optimizer's default schedule is exactly one of the two
        defaults = [ran[(model, 2, m)]["default"] for m in ("ringtrain-after-backward", "ringtrain-overlap")]
        assert defaults.count(True) == 1, defaults
    for model in ("convnet", "mlp"):
        assert ran[(model, 1, "no-comm")]["efficiency"] == pytest.approx(1.0)
    # the model with hundreds of small tensors issue 10 names, beside the convnet's few large ones
    assert ran[("mlp", 1, "no-comm")]["tensors"] >= 400 and ran[("convnet", 1, "no-comm")]["tensors"] <= 10
    assert "training scaling, mlp" in stdout and "training scaling, convnet" in stdout
    assert "points_below_ceiling" in stdout and "x_ddp_throughput" in stdout
    assert "ringtrain_2nd_us" in stdout and "paired_step_change" in stdout
    assert_png(out_png)


# ---------------------------------------------------------------- the helpers and the model, no MPI

def test_fit_recovers_known_alpha_and_beta():
    alpha, bandwidth, ranks = 20e-6, 4e9, 2          # per hop; 2(N-1) hops moving bytes/N each
    records = [{"impl": "x", "ranks": ranks, "bytes": n, "dtype": "float32", "op": "sum",
                "time_us": 1e6 * (2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * n / bandwidth)}
               for n in common.size_ladder(4096, 64 << 20)]
    fit = scaling_model.fit_alpha_beta(records)["x"]
    assert fit["alpha_us"] == pytest.approx(20.0, rel=1e-6)
    assert fit["bandwidth_gbps"] == pytest.approx(4.0, rel=1e-6)
    assert fit["max_relative_error"] < 1e-9


def test_projection_formulas():
    hw = {"intra_latency_s": 1e-6, "intra_bandwidth": 100e9, "network_latency_s": 10e-6, "network_bandwidth": 10e9}
    nbytes = 100e6
    # one rank per node: the hierarchical ring is the flat ring
    assert scaling_model.comm_seconds("ring (hierarchical)", 16, 1, nbytes, hw) == pytest.approx(
        scaling_model.comm_seconds("ring (flat)", 16, 1, nbytes, hw))
    flat = 2 * 15 * (10e-6 + nbytes / (16 * 10e9))
    assert scaling_model.comm_seconds("ring (flat)", 16, 1, nbytes, hw) == pytest.approx(flat)
    # across nodes a parameter server without local aggregation moves g times more through each NIC than the ring
    assert scaling_model.comm_seconds("parameter server", 64, 8, nbytes, hw) > \
        3 * scaling_model.comm_seconds("ring (hierarchical)", 64, 8, nbytes, hw)
    for algorithm in scaling_model.ALGORITHMS:
        assert scaling_model.comm_seconds(algorithm, 1, 8, nbytes, hw) == 0.0
        step, efficiency, _ = scaling_model.step_projection(algorithm, 1, 8, nbytes, 0.1, hw, 0.5, 32 << 20)
        assert (step, efficiency) == (pytest.approx(0.1), pytest.approx(1.0))
    # fully hidden communication costs nothing; unhidden adds straight to the step
    _, hidden, comm = scaling_model.step_projection("ring (flat)", 2, 1, 1e6, 1.0, hw, 1.0, 32 << 20)
    assert hidden == pytest.approx(1.0)
    step, _, comm = scaling_model.step_projection("ring (flat)", 2, 1, 1e6, 1.0, hw, 0.0, 32 << 20)
    assert step == pytest.approx(1.0 + comm)


def test_step_breakdown_quick(tmp_path):
    """Every mode runs on 2 ranks (lockstep+traffic and its :views check, when made, that their work is an
    allreduce: the script fails otherwise); the cross-rank stamps are consistent: no rank leaves the barrier or
    synchronize() before the last rank finished its backward (after_last >= 0), and waits are never negative.
    With overlap a rank's last bucket leaves from a hook inside backward(), so a peer may finish that allreduce
    while this rank is still returning from backward(): there after_last may dip below 0 by that return's time
    (-0.08 ms seen in a quiet CI run, -3 to -5 ms on a machine loaded 5x over), never by a step's worth: the bound
    is the step's own forward and backward time, not a fixed number of milliseconds."""
    if mpiexec() is None:
        pytest.skip("mpiexec not found")
    pytest.importorskip("torch")
    out_json = str(tmp_path / "breakdown.json")
    stdout = run_script([mpiexec(), "-n", "2", sys.executable, os.path.join(BENCH_DIR, "step_breakdown.py"),
                         "--model", "mlp", "--rounds", "1", "--steps", "3", "--json", out_json], timeout=300)
    with open(out_json) as f:
        result = json.load(f)
    assert result["one_host"] and set(result["per_round"]) == {"no-comm", "lockstep", "lockstep+traffic",
                                                                 "lockstep+traffic:views", "after-backward",
                                                                 "overlap", "ddp"}
    for mode, rounds in result["per_round"].items():
        for r in rounds:
            if mode in ("no-comm", "ddp"):    # free-running ranks share no step; DDP meets inside backward()
                assert r["after_last"] is None and r["wait"] is None
            else:
                floor = -r["fwd_bwd"] if mode == "overlap" else 0
                assert r["after_last"] >= floor and r["wait"] >= 0, (mode, r)
            assert 0 < r["fwd_bwd"] < r["step_wall"] and r["faults"] >= 0 and r["proc_cpu"] > 0
            if mode in ("after-backward", "overlap"):
                # the account of ringtrain's own time: the one bucket's allreduce ran on the transport, its cycle
                # on the agreement, after backward on the training thread
                buckets = r["buckets"]
                assert buckets["caller.agree"][0] + buckets["engine.agree"][0] > 0, (mode, buckets)
                assert buckets["caller.transport"][0] + buckets["engine.transport"][0] > 0, (mode, buckets)
                if mode == "after-backward":
                    assert buckets["engine.transport"][0] == 0, buckets
    assert "after-backward against lockstep:" in stdout and "overlap against lockstep:" in stdout
    # the floor of the allreduce's memory traffic (it checked, when made, that it computes one)
    for floor in ("lockstep+traffic", "lockstep+traffic:views"):
        assert f"after-backward against {floor}:" in stdout
        assert result["summary"]["after-backward"][f"x_{floor}_paired"] > 0
    assert "ringtrain's time per step by bucket phase" in stdout


def test_gradient_views_floor_quick(tmp_path):
    """Both loops run, every phase is timed, and gradients kept as views train the same parameters as torch's own
    loop (the benchmark compares them)."""
    pytest.importorskip("torch")
    out_json = str(tmp_path / "floor.json")
    run_script([sys.executable, os.path.join(BENCH_DIR, "gradient_views_floor.py"), "--steps", "3",
                "--json", out_json], timeout=120)
    with open(out_json) as f:
        result = json.load(f)
    assert result["same_parameters"] and result["tensors"] == 402
    for name in ("steal", "views"):
        assert set(result["summary"][name]) == {"zero", "fwd+bwd", "step", "total"}
        assert all(v["p25"] > 0 for v in result["summary"][name].values())


def test_train_scaling_reports_the_median_round_and_the_targets():
    rounds = [{"mode": "ringtrain", "ranks": 2, "samples_per_s_per_rank": v, "hidden_share": h, "params_in_sync": ok}
              for v, h, ok in ((300.0, 0.5, True), (100.0, None, True), (200.0, 0.7, False))]
    record = train_report.median_round(rounds)
    assert record["samples_per_s_per_rank"] == 200.0          # the median, not the best (300) nor the first
    assert record["hidden_share"] == pytest.approx(0.6)       # rounds without a value do not count
    assert record["params_in_sync"] is False                  # one bad round makes the mode bad
    assert record["rounds"] == [300.0, 100.0, 200.0]
    records = [{"model": "mlp", "ranks": 2, "mode": m, "efficiency": e, "samples_per_s_total": t}
               for m, e, t in (("no-comm", 0.95, 950.0), ("lockstep", 0.92, 920.0), ("torch-ddp", 0.5, 500.0),
                               ("ringtrain", 0.9, 900.0))]
    records.append({"model": "mlp", "ranks": 2, "mode": "horovod", "skipped": "not installed"})
    table = train_report.target_table(records)
    rows = {line.split()[1]: line.split() for line in table.splitlines() if line.split()[:1] == ["mlp"]}
    # the target column (points below no-comm) stays; lockstep only adds the method's own share of the gap
    assert rows["ringtrain"] == ["mlp", "ringtrain", "90%", "95%", "5.0", "92%", "2.0", "1.80"]
    assert rows["lockstep"] == ["mlp", "lockstep", "92%", "95%", "3.0", "92%", "-", "1.84"]
    assert "no-comm" not in rows and "horovod" not in table


def test_jax_scaling_pairs_each_round_with_the_peer_round_of_the_same_job():
    assert jax_scaling.round_order("abc", 0) == ("a", "b", "c")
    assert jax_scaling.round_order("abc", 1) == ("c", "b", "a")      # ABBA: drift falls on every mode alike
    assert jax_scaling.quartiles([5, 1, 4, 2, 3]) == (2.0, 3.0, 4.0)
    # two runs of 3 rounds, 10 steps each; load moves both arms: round 2 of run 1 is slow for everyone
    runs = [{"times": {"ringtrain": [0.04, 0.08, 0.05], "mpi4jax": [0.05, 0.10, 0.06]}},
            {"times": {"ringtrain": [0.05, 0.05, 0.05], "mpi4jax": [0.06, 0.065, 0.055]}},
            {"times": {"jax-gloo": [0.5, 0.4]}}]                       # a job of its own: no pairing
    wrong = [{"ringtrain": 0, "mpi4jax": 0}, {"ringtrain": 2, "mpi4jax": 0}, {"jax-gloo": 0}]
    records = {r["mode"]: r for r in jax_scaling.records_for(2, runs, 10, wrong)}
    ringtrain = records["ringtrain"]
    assert ringtrain["ratios"] == pytest.approx([1.25, 1.25, 1.2, 1.2, 1.3, 1.1])
    assert ringtrain["run_ratios"] == pytest.approx([1.25, 1.2])
    assert ringtrain["steps_per_s"] == pytest.approx(200.0)            # median over all six rounds
    assert ringtrain["wrong"] == 2                                     # the worst run counts
    assert records["mpi4jax"]["ratios"] == pytest.approx([1.0] * 6)
    assert records["jax-gloo"]["ratios"] == [] and records["jax-gloo"]["rounds"] == [20.0, 25.0]


def test_common_helpers():
    # pair_summary: the per-pair ratios b / a (1.5, 1, 1, 4): median, first and third quartile
    assert common.pair_summary([2.0, 1.0, 4.0, 1.0], [3.0, 1.0, 4.0, 4.0]) == (1.25, 1.0, 2.125)
    assert common.size_ladder(4, 256) == [4, 16, 64, 256]
    assert common.bus_bandwidth(3.0, 4) == pytest.approx(3.0 * 2 * 3 / 4)
    assert common.bus_bandwidth(3.0, 1) == 3.0
    assert common.human_bytes(4096) == "4 KB" and common.human_bytes(1 << 20) == "1 MB"
    records = [{"impl": i, "ranks": 2, "bytes": 4096, "count": 1024, "dtype": "float32", "op": "sum",
                "time_us": t, "algbw_gbps": 4096 / t / 1e3, "busbw_gbps": 4096 / t / 1e3, "wrong": 0}
               for i, t in (("MPI_Allreduce", 10.0), ("ours", 5.0))]
    assert "2.00" in common.ratio_table(records, "MPI_Allreduce")
    table = common.allreduce_table(records, "ours", roof_gbps=1.0)
    assert "#wrong" in table and "of_memcpy" in table and "0.82" in table
    assert common.median([3, 1, 2]) == 2 and common.median([4, 1, 2, 3]) == 2.5
    assert common.geometric_mean([1, 4]) == pytest.approx(2.0)
    assert np.isnan(common.geometric_mean([]))


def test_pretend_node_fit_recovers_known_costs_and_projects_other_rank_counts():
    """Records generated from known alpha/B on 2, 3 and 4 ranks: the 2x2 fit recovers them, and the 2- and 3-rank
    rows (not fitted on) are projected exactly; 3 ranks as 2+1 make the lone rank run two cross-node rings."""
    truth = {"alpha_e_s": 30e-6, "bandwidth_e": 2e9, "alpha_i_s": 5e-6, "bandwidth_i": 8e9}
    records = [{"impl": impl, "ranks": p, "bytes": s, "dtype": "float32",
                "time_us": 1e6 * scaling_model.split_seconds(kind, p, s, truth)}
               for p in (2, 3, 4) for s in common.size_ladder(4096, 64 << 20)
               for impl, kind in ((scaling_model.SPLIT_FLAT, "flat"), (scaling_model.SPLIT_HIERARCHICAL,
                                                                        "hierarchical"))]
    fit = scaling_model.fit_split(records)
    for key, value in truth.items():
        assert fit[key] == pytest.approx(value, rel=1e-6), key
    rows = scaling_model.split_comparison(records, fit)
    assert {(r["ranks"], r["layout"]) for r in rows} == {(2, "1+1"), (3, "2+1"), (4, "2+2")}
    for r in rows:
        assert r["projected_us"] == pytest.approx(r["measured_us"], rel=1e-6)
    # 2+1: intra ring of 2, then two 2-rank rings of S/2 each on the lone rank
    s = 1e6
    assert scaling_model.split_seconds("hierarchical", 3, s, truth) == pytest.approx(
        2 * (5e-6 + s / (2 * 8e9)) + 2 * 2 * (30e-6 + s / (2 * 2 * 2e9)))
    # 1+1: the hierarchy is the flat ring
    assert scaling_model.split_seconds("hierarchical", 2, s, truth) == pytest.approx(
        scaling_model.split_seconds("flat", 2, s, truth))


def test_hierarchical_phases_quick(tmp_path):
    """4 ranks as 2+2: both transports give MPI_Allreduce's result, and the three steps are each timed."""
    if mpiexec() is None:
        pytest.skip("mpiexec not found")
    out_json = str(tmp_path / "phases.json")
    stdout = run_script([mpiexec(), "-n", "4", sys.executable, os.path.join(BENCH_DIR, "hierarchical_phases.py"),
                         "--mb", "0.25", "--repeats", "1", "--json", out_json], timeout=120)
    with open(out_json) as f:
        result = json.load(f)
    assert result["wrong"] == 0 and result["layout"] == "2+2", stdout
    steps = [name.strip() for name in result["rows"] if name.startswith("  hierarchical:")]
    assert steps == ["hierarchical: intra reduce-scatter", "hierarchical: cross-node rings",
                     "hierarchical: intra allgather"], stdout
    assert "flat mpi ring allreduce_out" in result["rows"] and "MPI_Sendrecv 0.0625 MB with the other node" in stdout


def test_pretend_nodes_quick(tmp_path):
    """4 ranks as 2+2: every collective, flat and hierarchical, equals numpy and has a paired ratio per round."""
    if mpiexec() is None:
        pytest.skip("mpiexec not found")
    out_json = str(tmp_path / "pretend.json")
    stdout = run_script([mpiexec(), "-n", "4", sys.executable, os.path.join(BENCH_DIR, "pretend_nodes.py"),
                         "--max-bytes", "16384", "--rounds", "2", "--repeats", "1", "--batch-seconds", "0.001",
                         "--json", out_json], timeout=120)
    with open(out_json) as f:
        records = json.load(f)
    assert {(r["impl"], r["collective"]) for r in records} == {
        (f"ringtrain-2nodes-{impl}", op) for impl in ("flat", "hierarchical")
        for op in ("allreduce", "allgather", "broadcast", "reducescatter")}, stdout
    assert all(r["wrong"] == 0 and len(r["round_time_us"]) == 2 and RECORD_KEYS <= set(r) for r in records), stdout
    assert "4 ranks as 2+2 pretend nodes" in stdout and "# total #wrong: 0" in stdout


def _table_on_two_ranks(tmp_path, script, *args):
    """Run a benchmark that prints its table and writes it to --out, on 2 ranks; the table (both the same)."""
    if mpiexec() is None:
        pytest.skip("mpiexec not found")
    out = str(tmp_path / "table.txt")
    stdout = run_script([mpiexec(), "-n", "2", sys.executable, os.path.join(BENCH_DIR, script), *args, "--out", out],
                        timeout=120)
    with open(out) as f:
        table = f.read()
    assert table.strip() == stdout.strip()
    return table


def test_shm_chunk_sweep_quick(tmp_path):
    """Runs every chunk setting on 2 ranks, checks each result against MPI_Allreduce's, writes its table."""
    table = _table_on_two_ranks(tmp_path, "shm_chunk_sweep.py", "--sizes-mb", "1,3", "--chunks-mb", "1,4",
                                "--reps", "2")
    assert "1 MB chunks ms (vs one)" in table and "4 MB chunks ms (vs one)" in table
    assert [line.split()[0] for line in table.splitlines()[3:]] == ["1", "3"], table


def test_shm_shared_result_quick(tmp_path):
    """Runs both arms on 2 ranks (each checks its result on the first repetition), writes its table."""
    table = _table_on_two_ranks(tmp_path, "shm_shared_result.py", "--sizes-mb", "0.5,2", "--reps", "2")
    assert "reduce shared" in table and "+ SGD own" in table
    assert [line.split()[0] for line in table.splitlines()[3:]] == ["0.5", "2"], table


def test_express_fallbacks_quick(tmp_path):
    """A few MLP steps on 2 ranks: every call of each rank and bucket is counted under one path, table written."""
    table = _table_on_two_ranks(tmp_path, "express_fallbacks.py", "--model", "mlp", "--steps", "4")
    rows = [line.split() for line in table.splitlines()[3:]]
    assert {row[0] for row in rows} == {"0", "1"}, table
    assert all(sum(int(r[-3]) for r in rows if r[0] == rank) == 4 for rank in ("0", "1")), table


def test_express_phases_quick(tmp_path):
    """One round of the per-phase account on 2 ranks: every arm right, every phase row there for every arm."""
    table = _table_on_two_ranks(tmp_path, "express_phases.py", "--quick")
    arms = [line.split() for line in table.splitlines() if line.strip().startswith(("MPI_Allreduce", "numpy", "torch"))]
    assert arms and all(row[-1] == "0" for row in arms), table
    for phase in ("describe/Meta", "wait for the peer", "eager reduce", "call overhead", "total"):
        assert any(line.strip().startswith(phase) for line in table.splitlines()), (phase, table)


def test_soak_quick(tmp_path):
    """benchmarks/soak.py in each mode, tiny: every line reports 0 wrong, ops/s and RSS, and the JSON matches it."""
    out_json = str(tmp_path / "soak.jsonl")
    for mode_args in (["--mode", "program", "--ops", "60"], ["--mode", "issue", "--loop-batches", "20",
                                                             "--mix-batches", "10"],
                      ["--mode", "names", "--names", "200", "--warmup", "100"]):
        out = run_script([mpiexec(), "-n", "2", sys.executable, os.path.join(BENCH_DIR, "soak.py"), *mode_args,
                          "--json", out_json], timeout=120)
        assert f"soak[{mode_args[1]}]: ranks=2" in out and " wrong=0 " in out and "ops_per_s=" in out, out
    records = [json.loads(line) for line in open(out_json)]
    assert [r["mode"] for r in records] == ["program", "issue", "names"]
    assert all(r["wrong"] == 0 and r["ops_per_rank"] > 0 and r["rss_end_mb"] > 0 for r in records)
    assert records[2]["ops_per_rank"] == 200 and records[2]["rss_warm_mb"] is not None


def test_sharded_optimizer_quick(tmp_path):
    if mpiexec() is None:
        pytest.skip("mpiexec not found")
    need("torch")
    need("matplotlib", "bench")      # the --png plot
    out_json, out_png = str(tmp_path / "sharded.json"), str(tmp_path / "sharded.png")
    # three of the five modes (a job each): the reference, a sharded mode and the peer; the sharded modes'
    # results are checked against one process by tests/parallel/test_sharded_optimizer.py
    modes = ["distributed-optimizer", "shard-gradients", "torch-zero-ddp"]
    stdout = run_script([sys.executable, os.path.join(BENCH_DIR, "sharded_optimizer.py"), "--quick",
                         "--modes", ",".join(modes), "--json", out_json, "--png", out_png], timeout=300)
    with open(out_json) as f:
        records = {r["mode"]: r for r in json.load(f)["records"]}
    assert set(records) == set(modes)
    full = records["distributed-optimizer"]["state_mb"]
    for mode, r in records.items():
        assert r["ranks_agree"], f"{mode} left different parameters on different ranks"
        assert r["step_s"] > 0 and r["peak_rss_mb"] > 0
        if mode != "distributed-optimizer":
            assert r["max_diff_vs_distributed_optimizer"] < 1e-5, f"{mode} trained a different model"
            assert r["state_mb"] <= full / 2 * 1.35, f"{mode} keeps {r['state_mb']} MB of state at 2 ranks"
    assert records["shard-gradients"]["grad_mb"] < records["distributed-optimizer"]["grad_mb"]
    assert "shard-gradients" in stdout and "x_ZeRO" in stdout
    assert_png(out_png)
    # runs split by rank count or round come together as one table: here the one run's round twice
    merged_json, merged_png = str(tmp_path / "merged.json"), str(tmp_path / "merged.png")
    stdout = run_script([sys.executable, os.path.join(BENCH_DIR, "sharded_optimizer.py"), "--merge", out_json,
                         out_json, "--json", merged_json, "--png", merged_png], timeout=60)
    with open(merged_json) as f:
        merged = {r["mode"]: r for r in json.load(f)["records"]}
    assert set(merged) == set(records) and "2 rounds per mode" in stdout
    for mode, r in merged.items():
        assert r["rounds_step_s"] == [records[mode]["step_s"]] * 2 and r["step_s"] == records[mode]["step_s"]
    assert_png(merged_png)


def test_commit_ab_orders_arms_abba_and_compares_medians_best_jobs_and_lockstep_ratios(tmp_path):
    import commit_ab
    assert commit_ab.abba(3) == ["old", "new", "new", "old", "old", "new"]

    def train_job(name, samples, lockstep):
        path = tmp_path / name
        records = [{"model": "mlp", "mode": "lockstep", "ranks": 2, "samples_per_s_total": lockstep,
                    "params_in_sync": True},
                   {"model": "mlp", "mode": "ringtrain", "ranks": 2, "samples_per_s_total": samples,
                    "params_in_sync": True},
                   {"model": "mlp", "mode": "horovod", "ranks": 2, "skipped": "not installed"}]
        path.write_text(json.dumps({"records": records}))
        return str(path)

    # the new arm's second job ran under load: its lockstep fell with it, so the ratio to lockstep holds still
    jobs = {"old": [train_job("o0", 100.0, 125.0), train_job("o1", 110.0, 125.0)],
            "new": [train_job("n0", 120.0, 125.0), train_job("n1", 60.0, 62.5)]}
    rows = {line.split("  ")[0].strip(): line.split()[-8:] for line in commit_ab.summarize("train", jobs).splitlines()
            if line.startswith("mlp")}
    old_med, new_med, ratio, old_best, new_best, best_ratio, _, _ = rows["mlp ringtrain 2"]
    assert float(old_med) == 105.0 and float(new_med) == 90.0 and float(ratio) == pytest.approx(0.86, abs=0.01)
    assert float(old_best) == 110.0 and float(new_best) == 120.0 and float(best_ratio) == pytest.approx(1.09, abs=0.01)
    assert float(rows["mlp ringtrain/lockstep 2"][2]) == pytest.approx(0.96 / 0.84, abs=0.01)
    assert "all jobs: 0" in commit_ab.summarize("train", jobs)


def test_elastic_steps_quick(tmp_path):
    """One plain and one elastic job on 2 workers, a few steps each: each launch made the world it names (an
    elastic one drives MPI's progress in its waits), every loop timed, every allreduce, broadcast and allgather
    right and the parameters in sync (the script exits non-zero otherwise), and the table says so."""
    out_json = str(tmp_path / "steps.json")
    out = run_script([sys.executable, os.path.join(BENCH_DIR, "elastic_steps.py"), "--workers", "2", "--repeats", "1",
                      "--steps", "3", "--warmup", "1", "--launches", "plain", "elastic", "--json", out_json,
                      "--out", str(tmp_path / "steps.txt")],
                     timeout=120)
    records = json.load(open(out_json))["workers"]["2"]
    for launch in ("plain", "elastic"):
        record = records[launch]
        assert (record["failed"], record["wrong"], record["out_of_sync"], len(record["jobs"])) == (0, 0, 0, 1), out
        job = record["jobs"][0]
        assert job["elastic"] == job["drives_mpi"] == (launch == "elastic"), job    # the world init() made
        assert {loop: s["steps"] for loop, s in record["summary"].items()} == {
            loop: 3 for loop in ("model", "model+lossless", "model+commit", "allgather_obj", "4KB", "1MB",
                                 "1MB bcast")}, out
    rows = [line.split() for line in out.splitlines()[1:]]
    assert len(rows) == 14 and all(row[-3:] == ["0", "0", "0"] for row in rows), out
    written = (tmp_path / "steps.txt").read_text().splitlines()      # the results file: the table between notes
    assert [line.split() for line in written[4:-1]] == rows, written
    assert written[1].startswith("# 20") and "load" in written[1] and "commit" in written[1], written
    assert written[2].startswith("# python benchmarks/elastic_steps.py --workers 2") and "end (load" in written[-1]


def test_api_latency_quick_measures_every_form_beside_mpi(tmp_path):
    """benchmarks/api_latency.py: every form at 2 ranks, numpy-equal (#wrong 0), with its ratio to MPI_Allreduce
    and to the in-place call of the same size in the same round (a smoke run: two sizes, few calls)."""
    if mpiexec() is None:
        pytest.skip("mpiexec not found")
    pytest.importorskip("torch")
    out_json, out_txt = str(tmp_path / "api.json"), str(tmp_path / "api.txt")
    stdout = run_script([mpiexec(), "-n", "2", sys.executable, os.path.join(BENCH_DIR, "api_latency.py"), "--quick",
                         "--sizes", "4096,262144", "--pairs", "3", "--json", out_json, "--out", out_txt], timeout=120)
    with open(out_txt) as f:
        lines = f.read().splitlines()
    assert "UTC start, commit" in lines[0] and lines[1].startswith("# mpiexec -n 2 python benchmarks/api_latency.py")
    assert "UTC end" in lines[-1]
    with open(out_json) as f:
        written = json.load(f)
    records = written["records"]
    # --pairs: per size, the median of the per-pair ratios out of place / in place, between its quartiles
    assert [(p["bytes"], p["pairs"]) for p in written["pairs"]] == [(4096, 3), (262144, 3)], written["pairs"]
    for p in written["pairs"]:
        low, high = p["x_in_place_quartiles"]
        assert 0 < low <= p["x_in_place"] <= high and p["in_place_us"] > 0 and p["out_of_place_us"] > 0, p
    forms = {r["form"] for r in records}
    assert forms == {"in_place", "out_of_place", "unnamed", "async_wait", "async_wait_", "grouped", "scalar", "numpy",
                     "MPI_Allreduce"}, forms
    for r in records:
        assert r["wrong"] == 0, r
        assert r["time_us"] > 0 and r["x_mpi"] > 0 and r["faults_per_call"] >= 0, r
        assert (r["x_in_place"] is None) == (r["form"] == "scalar"), r
        assert r["x_conv_mpi"] is None, r       # (TF and JAX eager forms only: --tf / --jax)
    assert {r["bytes"] for r in records if r["form"] == "out_of_place"} == {4096, 262144}
    assert "x_in_place" in stdout and "faults" in stdout and "quartiles" in stdout


def test_train_scaling_metric_twins_and_their_table():
    args = train_scaling.parse_args(["--metric", "--modes", "no-comm,ringtrain-overlap,torch-ddp"])
    assert args.modes == "no-comm,ringtrain-overlap,ringtrain-overlap+metric,ringtrain-overlap+paired,torch-ddp"
    # ABBA over the steps: each call goes second in half of every four steps
    orders = [train_scaling.pair_order(step) for step in range(8)]
    assert [first for first, _ in orders] == ["ringtrain", "mpi", "mpi", "ringtrain"] * 2
    assert all(sorted(order) == ["mpi", "ringtrain"] for order in orders)

    def paired_round(ringtrain_second_us, mpi_second_us, throughput):
        us = 1e-6
        return {"mode": "ringtrain-overlap+paired", "step_ms": 10.2, "samples_per_s_per_rank": throughput,
                "params_in_sync": True,
                "pair": {"ringtrain_second": [t * us for t in ringtrain_second_us],
                         "mpi_second": [t * us for t in mpi_second_us],
                         "ringtrain_first": [1000 * us, 1200 * us], "mpi_first": [900 * us, 1100 * us]}}

    # two rounds: ringtrain 40/60 and 50/50 us in second position, MPI 20/20 and 30/30: per round 30 and 20 us
    # beyond MPI; pooled medians 50 and 25 us, 25 us = 0.25% of the 10 ms step without a metric
    paired = train_report.median_round([paired_round([40, 60], [20, 20], 98.0),
                                         paired_round([50, 50], [30, 30], 97.0)])
    assert paired["pair"]["ringtrain_second"] == pytest.approx([40e-6, 60e-6, 50e-6, 50e-6])
    assert paired["pair_round_excess_ms"] == pytest.approx([0.030, 0.020])
    assert paired["rounds"] == [98.0, 97.0]
    records = [{"model": "mlp", "ranks": 2, "mode": "ringtrain-overlap", "step_ms": 10.0, "rounds": [100.0, 90.0]},
               {"model": "mlp", "ranks": 2, "mode": "ringtrain-overlap+metric", "step_ms": 10.1, "metric_ms": 1.05,
                "rounds": [99.0, 90.0]},
               dict(paired, model="mlp", ranks=2),
               {"model": "mlp", "ranks": 1, "mode": "ringtrain-overlap", "step_ms": 8.0, "rounds": [100.0]},
               {"model": "mlp", "ranks": 1, "mode": "ringtrain-overlap+metric", "step_ms": 8.0, "metric_ms": 0.02,
                "rounds": [100.0]}]
    rows = [line.split() for line in train_report.metric_table(records).splitlines() if line.startswith("  mlp")]
    # the user's call, its wait included, is 1050 us = 10.50% of the 10 ms step; per round 100/99 and 90/90: median
    # +0.5%. First position: ringtrain 1100 us (median of 1000, 1200, 1000, 1200), MPI 1000: 100 us = 1.00%
    # beyond MPI there. Without a +paired twin
    # the excess is not known.
    assert rows == [["mlp", "2", "ringtrain-overlap", "10.00", "10.10", "1050.0", "10.50%", "50.0", "25.0", "25.0",
                     "0.25%", "20.0..30.0", "0.50%", "1100.0", "1000.0", "100.0", "1.00%", "+0.5%"],
                    ["mlp", "1", "ringtrain-overlap", "8.00", "8.00", "20.0", "0.25%"] + ["-"] * 10 + ["+0.0%"]], rows
    # a position without samples (a run of one step) has no median, and no excess
    lone = train_report.paired_metric({"ringtrain_first": [1e-3], "mpi_first": [], "ringtrain_second": [],
                                        "mpi_second": [2e-5]})
    assert lone["ringtrain_first_ms"] == pytest.approx(1.0) and lone["mpi_second_ms"] == pytest.approx(0.02)
    assert lone["mpi_first_ms"] is None and lone["excess_ms"] is None and lone["excess_first_ms"] is None

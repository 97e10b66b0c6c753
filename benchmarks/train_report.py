"""train_scaling.py's records and tables: a mode's rounds as one record, the records of every job with their
efficiencies, the report (per-model table, the targets, the metric's cost) and the plot. No MPI and no torch here:
the tables are functions of the records, tested on records made by hand."""
import os

import common

METRIC = "+metric"           # a mode's twin that also averages a scalar metric every step (--metric)
PAIRED = "+paired"           # its twin that averages it twice a step, ringtrain and MPI_Allreduce in ABBA order
PAIR_SAMPLES = ("ringtrain_first", "mpi_first", "ringtrain_second", "mpi_second")   # per-step times (s), rank mean


def median_round(rounds):
    """A mode's rounds as one record: the median of each timing; parameters in sync only if they were every round.
    A +paired twin's per-step call times are pooled over the rounds, and each round's excess is kept beside them."""
    record = dict(rounds[0])
    for key, value in rounds[0].items():
        if isinstance(value, float):
            values = [r[key] for r in rounds if r.get(key) is not None]
            record[key] = common.median(values) if values else None
    record["params_in_sync"] = all(r["params_in_sync"] for r in rounds)
    record["rounds"] = [r["samples_per_s_per_rank"] for r in rounds]
    if "pair" in rounds[0]:
        record["pair"] = {key: [t for r in rounds for t in r["pair"][key]] for key in PAIR_SAMPLES}
        record["pair_round_excess_ms"] = [paired_metric(r["pair"])["excess_ms"] for r in rounds]
    return record


def paired_metric(pair):
    """A +paired twin's per-step times (s) as medians in ms per call and position, and the excesses: ringtrain's
    median minus MPI's in second position (excess_ms) and in first (excess_first_ms). None where a position has no
    sample (fewer than two steps)."""
    medians = {f"{key}_ms": 1e3 * common.median(pair[key]) if pair[key] else None for key in PAIR_SAMPLES}
    for excess, position in (("excess_ms", "second"), ("excess_first_ms", "first")):
        rt, mpi = medians[f"ringtrain_{position}_ms"], medians[f"mpi_{position}_ms"]
        medians[excess] = None if rt is None or mpi is None else rt - mpi
    return medians


def summarise(jobs):
    """Flat records, one per (model, ranks, mode), with efficiency against that model's single-process
    plain-torch throughput."""
    single = next((j for j in jobs if j["ranks"] == 1), None)
    records = []
    for job in jobs:
        for model, measured in job["models"].items():
            own_base = {m: r.get("samples_per_s_total") for m, r in single["models"][model]["modes"].items()} \
                if single else {}
            base = own_base.get("no-comm")
            for mode, r in measured["modes"].items():
                if "skipped" in r:
                    records.append({"model": model, "mode": mode, "ranks": job["ranks"], "skipped": r["skipped"]})
                    continue
                n = job["ranks"]
                record = dict(r, model=model, threads_per_rank=job["threads_per_rank"],
                              load_average=job.get("load_average"),
                              batch_per_rank=job["batch_per_rank"], parameters=measured["parameters"],
                              tensors=measured["tensors"], width=measured["width"], ddp_backend=job["ddp_backend"])
                record["efficiency"] = r["samples_per_s_total"] / (n * base) if base else None
                record["efficiency_vs_own_1rank"] = (r["samples_per_s_total"] / (n * own_base[mode])
                                                     if own_base.get(mode) else None)
                records.append(record)
    return records


def print_report(records, jobs, rounds):
    job = jobs[0]
    for model in dict.fromkeys(r["model"] for r in records):
        rows = []
        measured = [r for r in records if r["model"] == model and "skipped" not in r]
        for r in (r for r in records if r["model"] == model):
            if "skipped" in r:
                rows.append([r["ranks"], r["mode"]] + ["-"] * 9 + [f"skipped: {r['skipped']}"])
                continue
            hidden = r.get("hidden_share")
            rows.append([r["ranks"], r["mode"] + ("*" if r.get("default") else ""), f"{r['step_ms']:.1f}",
                         _ms(r.get("forward_backward_ms")), _ms(r.get("after_backward_ms")),
                         f"{r['samples_per_s_per_rank']:.1f}",
                         f"{r['samples_per_s_total']:.1f}", _pct(r["efficiency"]),
                         _pct(r["efficiency_vs_own_1rank"]), "-" if hidden is None else _pct(hidden),
                         "-" if r.get("page_faults_per_step") is None else f"{r['page_faults_per_step']:.0f}",
                         ("in sync" if r["params_in_sync"] else "RANKS DIFFER") +
                         (f", |dw vs ddp| {r['max_param_diff_vs_ddp']:.1e}" if "max_param_diff_vs_ddp" in r else "")])
        shape = measured[0] if measured else {"parameters": 0, "tensors": 0}
        print(common.format_table(
            ["ranks", "mode", "step_ms", "fwd_bwd_ms", "after_bwd_ms", "samples/s/rank", "samples/s", "efficiency",
             "eff_own_T1", "hidden", "faults/step", "check"], rows,
            title=f"training scaling, {model}: {shape['parameters'] / 1e6:.2f} M parameters in {shape['tensors']} "
                  f"tensors, batch {job['batch_per_rank']} per rank, {job['threads_per_rank']} thread(s) per rank, "
                  f"{os.cpu_count()} cores, median of {rounds} interleaved round(s); efficiency = T(N)/(N*T(1)), "
                  f"T(1) = plain torch on 1 rank; * = the DistributedOptimizer's default schedule here; fwd_bwd_ms = "
                  f"zero_grad+forward+backward, after_bwd_ms = the rest of the step (means over ranks)"))
        print()
    print(target_table(records))
    if any(r["mode"].endswith((METRIC, PAIRED)) for r in records):
        print()
        print(metric_table(records))


def metric_table(records):
    """What averaging one scalar metric per step costs each ringtrain mode, from its two twins in the same rounds.

    The user's call comes right after optimizer.step(), where the ranks arrive apart: the first call there (ours,
    MPI's, any) waits for the slowest rank. That wait is not the metric's cost: without the metric the next step's
    first gradient allreduce waits for the same rank instead, so the step pays it either way, and it is ~1 ms at 2
    ranks here, larger than the call and varying by tenths of a millisecond from job to job. What the metric adds to
    the step is the call itself once the ranks are together. The +paired twin measures exactly that: every step it
    calls ringtrain's allreduce and MPI_Allreduce of the same scalar, in ABBA order over the steps; the first call
    absorbs the wait, the second finds the ranks together. ringtrain_2nd_us and mpi_2nd_us are the medians (over
    steps and rounds, mean over ranks per step) in second position, excess_us their difference: what ringtrain's
    call costs beyond the reference library's, with both measured in the same steps of the same job, so the wait's
    noise does not enter. excess_share and ringtrain_2nd_share are over the step without the metric; excess_rounds
    the range of the per-round excess. Two effects the second position leaves out, so the first position's medians
    (half the wait, as a mean over ranks, plus the call) and their difference excess_1st_us stand beside it: how a
    library takes a peer that arrives late (a rank that stopped spinning must be woken), and the first call's exit
    skew, which the second call absorbs. The ABBA order gives both positions the same waits in expectation, so
    excess_1st_us is paired too, but it carries the waits' variance. The user-visible A/B stays beside it:
    metric_us is the user's call's own time in the +metric twin (the wait included), and paired_step_change the
    median over rounds of that twin's step time over the plain mode's."""
    rows = []
    for r in records:
        if not r["mode"].endswith(METRIC) or "skipped" in r:
            continue
        key = (r["model"], r["ranks"])
        twins = {b["mode"]: b for b in records if (b["model"], b["ranks"]) == key and "skipped" not in b}
        plain = r["mode"].removesuffix(METRIC)
        base, paired = twins.get(plain), twins.get(plain + PAIRED)
        if base is None:
            continue
        # per round: samples/s without over with (the twins ran back to back), median over rounds
        change = sorted(b / m for b, m in zip(base["rounds"], r["rounds"]))
        step = base["step_ms"]
        p = paired_metric(paired["pair"]) if paired is not None else {}
        spread = paired.get("pair_round_excess_ms") if paired is not None else None
        spread = [e for e in spread or () if e is not None]
        rows.append([r["model"], r["ranks"], base["mode"], f"{step:.2f}", f"{r['step_ms']:.2f}",
                     f"{1e3 * r['metric_ms']:.1f}", f"{100 * r['metric_ms'] / step:.2f}%",
                     _us(p.get("ringtrain_second_ms")), _us(p.get("mpi_second_ms")), _us(p.get("excess_ms")),
                     _share(p.get("excess_ms"), step),
                     f"{1e3 * min(spread):.1f}..{1e3 * max(spread):.1f}" if spread else "-",
                     _share(p.get("ringtrain_second_ms"), step),
                     _us(p.get("ringtrain_first_ms")), _us(p.get("mpi_first_ms")), _us(p.get("excess_first_ms")),
                     _share(p.get("excess_first_ms"), step),
                     f"{100 * (common.median(change) - 1):+.1f}%"])
    return common.format_table(
        ["model", "ranks", "mode", "step_ms", "step_ms+metric", "metric_us", "metric_share", "ringtrain_2nd_us",
         "mpi_2nd_us", "excess_us", "excess_share", "excess_rounds_us", "ringtrain_2nd_share", "ringtrain_1st_us",
         "mpi_1st_us", "excess_1st_us", "excess_1st_share", "paired_step_change"],
        rows, title="a scalar metric averaged every step (hvd.allreduce(loss.detach()), unnamed, out of place). "
                    "+paired twin, ringtrain and MPI_Allreduce of the scalar both at the metric point every step, "
                    "ABBA order: the first call absorbs the wait for the slowest rank (paid by the step with or "
                    "without a metric), the second is the call's own cost with the ranks together; *_2nd_us = "
                    "medians in second position, excess = ringtrain's minus MPI's (its share of the step without "
                    "a metric; range over rounds), *_1st_us = first position (half the wait + the call, with the "
                    "late peer's wake-up), excess_1st = their difference. +metric twin: "
                    "metric_us = the user's call alone, wait included (mean over ranks), metric_share = that over "
                    "the step; paired_step_change = median over rounds of the step time with it over without it")


def _us(ms):
    return "-" if ms is None else f"{1e3 * ms:.1f}"


def _share(ms, step_ms):
    return "-" if ms is None else f"{100 * ms / step_ms:.2f}%"


def target_table(records):
    """Issue 10's training targets at the largest rank count: efficiency within 5 points of the no-comm ceiling,
    and at least 1.3x DDP's throughput, for every model, with every figure from this same run. Beside them, the
    points below the lockstep mode (the synchronous ceiling): the part of the gap the method itself costs."""
    top = max(r["ranks"] for r in records)
    rows = []
    for model in dict.fromkeys(r["model"] for r in records):
        by_mode = {r["mode"]: r for r in records if r["model"] == model and r["ranks"] == top and "skipped" not in r}
        ceiling = by_mode.get("no-comm", {}).get("efficiency")
        lockstep = by_mode.get("lockstep", {}).get("efficiency")
        ddp = by_mode.get("torch-ddp", {}).get("samples_per_s_total")
        for mode, r in by_mode.items():
            if mode == "no-comm":
                continue
            rows.append([model, mode + ("*" if r.get("default") else ""), _pct(r["efficiency"]), _pct(ceiling),
                         _points_below(ceiling, r["efficiency"]), _pct(lockstep),
                         "-" if mode == "lockstep" else _points_below(lockstep, r["efficiency"]),
                         f"{r['samples_per_s_total'] / ddp:.2f}" if ddp else "-"])
    return common.format_table(
        ["model", "mode", "efficiency", "ceiling", "points_below_ceiling", "lockstep", "points_below_lockstep",
         "x_ddp_throughput"], rows,
        title=f"{top} ranks against the targets (<= 5 points below the ceiling, >= 1.3x DDP); lockstep = "
              f"the synchronous ceiling (a barrier per step, no gradients), for the part of the gap that is the "
              f"method's own")


def _points_below(ceiling, efficiency):
    return "-" if ceiling is None or efficiency is None else f"{100 * (ceiling - efficiency):.1f}"


def _ms(value):
    return "-" if value is None else f"{value:.1f}"


def _pct(value):
    return "-" if value is None else f"{100 * value:.0f}%"


def plot(records, path):
    plt = common.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    series = list(dict.fromkeys((r["model"], r["mode"]) for r in records if "skipped" not in r))
    for model, mode in series:
        points = sorted((r["ranks"], r["samples_per_s_total"], r["efficiency"]) for r in records
                        if (r["model"], r["mode"]) == (model, mode) and "skipped" not in r)
        style = "-" if model == "convnet" else "--"
        left.plot([p[0] for p in points], [p[1] for p in points], style, marker="o", label=f"{model} {mode}")
        right.plot([p[0] for p in points], [100 * (p[2] or 0) for p in points], style, marker="o",
                   label=f"{model} {mode}")
    left.set_xlabel("ranks")
    left.set_ylabel("samples/s (total)")
    left.set_yscale("log")
    right.set_xlabel("ranks")
    right.set_ylabel("scaling efficiency (%)")
    right.set_ylim(0, 110)
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"training scaling on {os.cpu_count()} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

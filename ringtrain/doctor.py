"""Merge the ranks' flight recorder files into one report that says where the ranks diverged.

    python -m ringtrain.doctor DIR          # DIR: where the ranks wrote rank<r>.json (the stall message names it)

ringtrain-run prints the same report itself when a job fails. Every rank numbers its collectives in program order
(#1, #2, ...), so in a healthy job #k is the same collective on every rank. The report walks the numbers all the
ranks' buffers cover and stops at the first one where the ranks differ: some ranks are in collective A and others in
B (they called different collectives), or some have not submitted #k at all (they are behind: a skipped
collective, a rank stuck outside ringtrain). When no number differs, every rank is in the same collective and the
report says which and in what state (the transport or a peer is the problem, not the program).
"""
import argparse
import glob
import json
import os
import sys

STATES_OPEN = ("submitted", "running")


def load(directory):
    """{(label, rank): dump} of the files in `directory` (the newest file of a rank wins)."""
    dumps = {}
    for path in sorted(glob.glob(os.path.join(directory, "rank*.json"))):
        try:
            with open(path, encoding="utf-8") as f:
                dump = json.load(f)
        except (OSError, ValueError) as e:
            print(f"ringtrain.doctor: skipping {path}: {e}", file=sys.stderr)
            continue
        key = (dump.get("label", ""), dump["rank"])
        if key not in dumps or dump["time"] > dumps[key]["time"]:
            dumps[key] = dump
    return dumps


def _ranks(ranks):
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


def _verb(ranks, one, many):
    return one if len(ranks) == 1 else many


def divergence(dumps):
    """The report for one group of ranks (one process set): a list of lines, the first the verdict."""
    by_rank = {d["rank"]: {e["seq"]: e for e in d["collectives"]} for d in dumps}
    size = max(d["size"] for d in dumps)
    lines = []
    missing = sorted(set(range(size)) - set(by_rank))
    if missing:
        lines.append(f"no flight recorder file from {_ranks(missing)} (not reachable, or died before writing)")
    last = {r: d["last_seq"] for r, d in ((d["rank"], d) for d in dumps)}
    first = {r: min(entries) if entries else last[r] + 1 for r, entries in by_rank.items()}
    start, end = max(first.values()), max(last.values())
    verdict = None
    for seq in range(start, end + 1):
        names = {r: (by_rank[r][seq]["name"] if seq in by_rank[r] else None) for r in by_rank}
        if len(set(names.values())) > 1:
            verdict = _diverged(seq, names, by_rank)
            break
    if verdict is None:
        verdict = _together(end, by_rank)
    lines.insert(0, verdict)
    for r in sorted(by_rank):
        lines.append("  " + _rank_line(r, by_rank[r], last[r]))
    return lines


def _diverged(seq, names, by_rank):
    groups = {}
    for r, name in names.items():
        groups.setdefault(name, []).append(r)
    parts = []
    for name, ranks in sorted(groups.items(), key=lambda item: (item[0] is None, sorted(item[1]))):
        if name is None:
            behind = []
            for r in sorted(ranks):
                done = _last_completed(by_rank[r], seq)
                where = f"last completed #{done['seq']} {done['name']!r}" if done else "completed nothing recorded"
                behind.append(f"{_ranks([r])} {where} and has not submitted #{seq}")
            parts.append("; ".join(behind))
        else:
            states = {by_rank[r][seq]["state"] for r in ranks}
            are = _verb(ranks, "is", "are")
            if states & set(STATES_OPEN):
                parts.append(f"{_ranks(ranks)} {are} in {name!r} (#{seq})")
            elif states == {"completed"}:
                now = _first_open(by_rank[ranks[0]])
                parts.append(f"{_ranks(ranks)} completed {name!r} (#{seq})"
                             + (f" and {are} in {now['name']!r} (#{now['seq']})" if now else ""))
            else:
                parts.append(f"{_ranks(ranks)} failed in {name!r} (#{seq})")
    return f"ranks diverged at #{seq}: " + "; ".join(parts)


def _together(end, by_rank):
    open_ = {r: [e for e in entries.values() if e["state"] in STATES_OPEN] for r, entries in by_rank.items()}
    if any(open_.values()):
        first_open = min(e["seq"] for entries in open_.values() for e in entries)
        names = {by_rank[r][first_open]["name"] for r in by_rank if first_open in by_rank[r]}
        waiting = sorted(r for r, entries in open_.items() if any(e["seq"] == first_open for e in entries))
        return (f"no divergence: every rank submitted the same collectives up to #{end}; {_ranks(waiting)} "
                f"{_verb(waiting, 'is', 'are')} in {', '.join(map(repr, sorted(names)))} (#{first_open}) -- the "
                "ranks agree on what to run, so look at the transport, a dead peer or the stall message")
    return f"no divergence: every rank completed the same collectives up to #{end}"


def _first_open(entries):
    open_ = [e for e in entries.values() if e["state"] in STATES_OPEN]
    return min(open_, key=lambda e: e["seq"]) if open_ else None


def _last_completed(entries, before):
    done = [e for seq, e in entries.items() if seq < before and e["state"] == "completed"]
    return max(done, key=lambda e: e["seq"]) if done else None


def _rank_line(r, entries, last):
    open_ = [e for e in entries.values() if e["state"] in STATES_OPEN]
    done = _last_completed(entries, last + 1)
    failed = [e for e in entries.values() if e["state"] == "failed"]
    parts = [f"rank {r}: {last} collectives"]
    if done:
        parts.append(f"last completed #{done['seq']} {done['name']!r}")
    if open_:
        parts.append("open: " + ", ".join(f"#{e['seq']} {e['name']!r} ({e['state']})" for e in open_[-3:]))
    if failed:
        e = failed[-1]
        parts.append(f"failed: #{e['seq']} {e['name']!r} ({(e['error'] or 'error').split(':')[0]})")
    return "; ".join(parts)


def report(directory):
    """The merged report of every group (the world, each process set) found in `directory`, as text."""
    dumps = load(directory)
    if not dumps:
        return f"no flight recorder files (rank*.json) in {directory}"
    groups = {}
    for (label, _), dump in dumps.items():
        groups.setdefault(label, []).append(dump)
    out = []
    for label in sorted(groups):
        group = groups[label]
        # what happened first: each file lists why it was written, oldest first (the lowest rank's list)
        first = min(group, key=lambda d: d["rank"])
        reason = (first.get("first_reasons") or [first["reason"]])[0]
        out.append(f"flight recorder of {label or 'the world'} ({len(group)} of {max(d['size'] for d in group)} "
                   f"ranks), first written on: {reason[:300]}")
        out.extend(divergence(group))
    return "\n".join(out)


def job_directory(environ):
    """ringtrain-run: the job's flight recorder directory -- RINGTRAIN_FLIGHT_RECORDER_DIR when set, else a new one
    under the system's temporary directory, which the ranks are then told (returned with whether it is ours)."""
    given = environ.get("RINGTRAIN_FLIGHT_RECORDER_DIR")
    if given:
        return given, False
    import tempfile
    return tempfile.mkdtemp(prefix="ringtrain-flight-recorder-"), True


def after_job(directory, ours, stream=sys.stderr, prog="ringtrain-run"):
    """ringtrain-run, once the job ended: print the merged report when any rank wrote its flight recorder; remove
    the directory it made when nothing was written."""
    if not glob.glob(os.path.join(directory, "rank*.json")):
        if ours:
            try:
                os.rmdir(directory)
            except OSError:
                pass
        return False
    print(f"{prog}: flight recorder report ({directory}):", file=stream)
    print(report(directory), file=stream, flush=True)
    return True


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m ringtrain.doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", help="where the ranks wrote their flight recorder files")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.directory):
        print(f"ringtrain.doctor: {args.directory} is not a directory", file=sys.stderr)
        return 2
    print(report(args.directory))
    return 0


if __name__ == "__main__":
    sys.exit(main())

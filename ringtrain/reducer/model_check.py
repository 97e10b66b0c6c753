"""Say how a model differs across ranks, by name, from every rank's list of (name, *spec) entries.

Bindings allgather a small description of their model at wrap time (names, shapes, dtypes) and call
describe_model_mismatch when the lists differ, so a wrong model fails at once on every rank with the variable and
the ranks named, instead of as a shape mismatch (or a hang) in the first step. Framework-free on purpose: the torch
and TensorFlow bindings share it.
"""


def describe_model_mismatch(per_rank, owner, what, spec_text, remedy):
    """per_rank[r] = [(name, *spec), ...]. spec_text(spec tuple) -> words for one side. Names the first differences."""
    by_rank = [{entry[0]: tuple(entry[1:]) for entry in entries} for entries in per_rank]
    all_names = sorted(set().union(*by_rank))
    problems = []
    for name in all_names:
        missing = [r for r, entries in enumerate(by_rank) if name not in entries]
        if missing:
            present = [r for r in range(len(by_rank)) if r not in missing]
            problems.append(f"{what} {name!r} exists on ranks {present} but not on ranks {missing}")
            continue
        seen = {}
        for r, entries in enumerate(by_rank):
            seen.setdefault(entries[name], []).append(r)
        if len(seen) > 1:
            sides = "; ".join(f"ranks {ranks} have {spec_text(spec)}" for spec, ranks in seen.items())
            problems.append(f"{what} {name!r}: {sides}")
    if not problems:
        orders = {}
        for r, entries in enumerate(per_rank):
            orders.setdefault(tuple(e[0] for e in entries), []).append(r)
        problems.append(f"the same {what}s come in a different order on ranks "
                        + " vs ".join(str(ranks) for ranks in orders.values()))
    more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    return f"{owner}: the model differs across ranks: " + "; ".join(problems[:5]) + more + ". " + remedy

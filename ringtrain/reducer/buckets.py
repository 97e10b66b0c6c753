"""The reducer's bucket plan: what a gradient is to the reducer (Member), a bucket of them (Bucket), and the rules
that lay members out in buckets (plan_buckets; Horovod's groups= in explicit_groups). Pure: no collective here."""
import dataclasses


@dataclasses.dataclass(frozen=True, eq=False)
class Member:
    """What the reducer knows of one gradient: the binding's key for it (a parameter, an index), a name for
    messages, its size in bytes, its kind (dtype, device: a bucket holds one kind) and whether it is on the host
    (a large host member travels alone, or with large ones only: see plan_buckets)."""
    key: object
    name: str
    nbytes: int
    kind: object
    host: bool = True


@dataclasses.dataclass(eq=False)
class Bucket:
    index: int
    name: str                          # the collective's request name: the same on every rank
    members: list                      # Member, in bucket order
    flat: bool                         # travels as one flat array (one kind; several members, or one on the host)
    arrivals: list = dataclasses.field(default_factory=list)   # keys, one per arrival this step (hooks append)
    buffer: object = None              # the binding's persistent flat buffer, made at the first flat submit
    views: object = None               # views of buffer shaped like the members
    keys: list = dataclasses.field(init=False)   # the members' keys, in order (read every step: made once)

    def __post_init__(self):
        self.keys = [m.key for m in self.members]


def plan_buckets(members, first_bucket_bytes, bucket_bytes, alone_bytes=None, keep_order=True, large_alone=None,
                 large_bucket_bytes=None):
    """Split members (in expected ready order) into lists: the first small so the first collective starts early in
    backward, the rest up to bucket_bytes. One kind per bucket. A host member of alone_bytes or more is large.
    keep_order=True: buckets are consecutive runs (for overlap), and a large member is alone, so it goes out as soon
    as it is final; False: members of one kind fill the same bucket wherever they sit (reduced after backward, order
    does not matter, fewer requests), large ones only with large ones (a bucket of them is refilled every step, see
    the torch binding), up to large_bucket_bytes (default bucket_bytes). large_alone overrides whether a large
    member is alone."""
    large_alone = keep_order if large_alone is None else large_alone
    buckets, filling = [], {}       # kind (or (kind, "large")) -> [members, bytes] of the bucket still filling

    def close(kind):
        buckets.append(filling.pop(kind)[0])

    for member in members:
        kind, nbytes = member.kind, member.nbytes
        if keep_order:
            for other in [k for k in filling if k != kind]:
                close(other)
        cap = first_bucket_bytes if not buckets else bucket_bytes
        if alone_bytes is not None and nbytes >= alone_bytes and member.host:
            if large_alone:
                if keep_order and kind in filling:
                    close(kind)
                buckets.append([member])
                continue
            kind = (kind, "large")
            cap = large_bucket_bytes or cap
        current = filling.get(kind)
        if current is not None and current[1] + nbytes > cap:
            close(kind)
            current = None
        if current is None:
            current = filling[kind] = [[], 0]
        current[0].append(member)
        current[1] += nbytes
    for kind in list(filling):
        close(kind)
    return buckets


def split_in_groups(members, num_groups):
    """Horovod's groups=<int>: the members in num_groups consecutive groups of near-equal count."""
    num_groups = min(int(num_groups), len(members))
    base, extra = divmod(len(members), num_groups) if num_groups else (0, 0)
    groups, start = [], 0
    for i in range(num_groups):
        end = start + base + (1 if i < extra else 0)
        groups.append(members[start:end])
        start = end
    return groups


def explicit_groups(members, groups):
    """Horovod's groups=: an int k (k groups of near-equal count) or lists of member keys, one bucket each (members
    in no list get a bucket each). Returns lists of members, or None for no grouping (groups None or 0)."""
    if groups is None or (isinstance(groups, int) and not isinstance(groups, bool) and groups == 0):
        return None
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups < 0:
            raise ValueError(f"groups must be a non-negative int or a list of lists of parameters, got {groups}")
        return split_in_groups(members, groups)
    by_key = {id(m.key): m for m in members}
    chosen, seen = [], set()
    for group in groups:
        group = list(group)
        picked = [by_key[id(key)] for key in group if id(key) in by_key and id(key) not in seen]
        if len(picked) != len(group):
            raise ValueError("groups: every parameter must be a trainable parameter of this optimizer and appear in "
                             "one group only")
        seen.update(id(m.key) for m in picked)
        if picked:
            chosen.append(picked)
    return chosen + [[m] for m in members if id(m.key) not in seen]

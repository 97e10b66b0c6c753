"""`ringtrain-run`'s command line: the options of a plain job and of an elastic one, checked together."""
import argparse
import os


def parse_args(argv, prog):
    parser = argparse.ArgumentParser(
        prog=prog, description="Run a command on N ranks with mpiexec; name failed ranks; forward Ctrl-C/SIGTERM.",
        usage=f"{prog} -np N [--hostfile FILE] [-x VAR[=value]] ... command [args ...]")
    parser.add_argument("-np", "-n", dest="num_ranks", type=int,
                        help="number of ranks (inside a Slurm allocation: SLURM_NTASKS by default)")
    parser.add_argument("--hostfile", "-f", dest="hostfile", help="hostfile for mpiexec (one host per line)")
    parser.add_argument("-x", dest="exports", action="append", default=[], metavar="VAR[=value]",
                        help="pass an environment variable to every rank (repeatable)")
    parser.add_argument("--grace", type=float, default=10.0, metavar="SECONDS",
                        help="after Ctrl-C/SIGTERM or a failed rank, how long the other ranks get before they are "
                             "stopped and then killed (default 10)")
    parser.add_argument("--mpiexec", help="mpiexec to use (default: the one beside this Python, else PATH)")
    parser.add_argument("--no-rank-wrapper", dest="wrap_ranks", action="store_false",
                        help="start the command directly (failed ranks are then named only as far as mpiexec does)")
    parser.add_argument("--no-abort-on-exception", dest="abort_on_error", action="store_false",
                        help="run python scripts as given instead of under `python -m mpi4py`, whose MPI_Abort ends "
                             "the job when a rank raises (without it, such a job can hang in MPI_Finalize)")
    parser.add_argument("-H", "--hosts", dest="hosts", metavar="HOST:SLOTS,...",
                        help="hosts and their slots, e.g. localhost:4 (elastic jobs: the static host list)")
    elastic = parser.add_argument_group(
        "elastic training (any of --min-np, --max-np, --host-discovery-script makes the job elastic: each worker "
        "is its own MPI job, and the world is re-formed when workers die or join; see ringtrain.elastic)")
    elastic.add_argument("--min-np", type=int, help="fewest workers to train with (default: -np)")
    elastic.add_argument("--max-np", type=int, help="most workers to train with (default: every free slot)")
    elastic.add_argument("--host-discovery-script", metavar="SCRIPT",
                         help="executable printing one 'hostname:slots' (or 'hostname') line per available host")
    elastic.add_argument("--slots", type=int, default=1,
                         help="slots of a host the discovery script lists without ':slots' (default 1)")
    elastic.add_argument("--reset-limit", type=int,
                         help="most re-formations of the world before the job fails (default: no limit)")
    elastic.add_argument("--elastic-timeout", type=float, default=600.0, metavar="SECONDS",
                         help="how long to wait with fewer than --min-np workers before failing (default 600)")
    elastic.add_argument("--blacklist-cooldown-range", type=float, nargs=2, metavar=("MIN", "MAX"),
                         help="a failing host is left out MIN * 2^(failures-1) seconds, at most MAX (default: for "
                              "good)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program each rank runs")
    args = parser.parse_args(argv)
    if args.num_ranks is not None and args.num_ranks < 1:
        parser.error(f"-np must be at least 1, got {args.num_ranks}")
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command given, e.g. `ringtrain-run -np 2 python train.py`")
    if args.hostfile and not os.path.isfile(args.hostfile):
        parser.error(f"hostfile {args.hostfile!r} does not exist")
    args.elastic = any(v is not None for v in (args.min_np, args.max_np, args.host_discovery_script))
    if args.elastic:
        _check_elastic_args(parser, args)
    return args


def _check_elastic_args(parser, args):
    if args.num_ranks is None:
        parser.error("an elastic job needs -np (the workers to start with)")
    min_np = args.min_np if args.min_np is not None else args.num_ranks
    if not 1 <= min_np <= args.num_ranks or (args.max_np is not None and args.num_ranks > args.max_np):
        parser.error(f"need 1 <= --min-np ({min_np}) <= -np ({args.num_ranks}) <= --max-np ({args.max_np})")
    if args.hosts and args.host_discovery_script:
        parser.error("give -H or --host-discovery-script, not both")
    if args.host_discovery_script and not os.access(args.host_discovery_script, os.X_OK):
        parser.error(f"--host-discovery-script {args.host_discovery_script!r} is not an executable file")
    if args.blacklist_cooldown_range and not 0 <= args.blacklist_cooldown_range[0] <= args.blacklist_cooldown_range[1]:
        parser.error("--blacklist-cooldown-range MIN MAX needs 0 <= MIN <= MAX")
    if args.hostfile:
        parser.error("an elastic job takes its hosts from -H or --host-discovery-script, not --hostfile")

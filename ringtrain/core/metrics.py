"""OpenMetrics for a cluster's monitoring, through prometheus-client: an HTTP endpoint (RINGTRAIN_METRICS_PORT) and/or
a text file (RINGTRAIN_METRICS_FILE) per rank.

Every rank serves its own numbers, on port RINGTRAIN_METRICS_PORT + local rank (so the ranks of one host do not
collide) and in its own file. Rank 0 does not gather the others': collecting would add messages to the training
job (and end with rank 0), while Prometheus already scrapes many targets and sums or maxes them in a query; every
series carries a `rank` label. The straggler series are the exception that needs no gathering: every rank holds
every rank's wait totals (they travel in the agreement's slots), so each exports the same values -- scrape one.

Nothing is counted on the way of a collective for these: a scrape reads what the engine keeps anyway (its
statistics, the straggler rows, its response cache, its failure counts) at the moment of the scrape.
"""
import logging
import os
import threading

from ..errors import RingtrainError

log = logging.getLogger("ringtrain")

FILE_PERIOD_S = 5.0          # how often the text file is rewritten

# elastic recoveries in this process (ringtrain.elastic reports each; the engine of a new world starts at zero)
_elastic = {"resets": 0, "last_recovery_s": 0.0}

_BUS_FACTOR = {             # bus bandwidth = algorithm bandwidth * factor(N) (nccl-tests' rule)
    "allreduce": lambda n: 2 * (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reducescatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def note_elastic_reset(recovery_s):
    """ringtrain.elastic: the world was re-formed, `recovery_s` seconds after the failure."""
    _elastic["resets"] += 1
    _elastic["last_recovery_s"] = float(recovery_s)


class _Collector:
    """Reads the engines when scraped. engines() -> [(process set id, engine)], the world's first."""

    def __init__(self, engines, rank):
        self.engines, self.rank = engines, str(rank)

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        rank = self.rank
        labels = ["rank", "process_set"]
        count = CounterMetricFamily("ringtrain_collectives", "Collectives this rank ran, by kind",
                                    labels=labels + ["kind"])
        nbytes = CounterMetricFamily("ringtrain_collective_bytes", "Bytes of this rank's collectives' inputs",
                                     labels=labels + ["kind"])
        seconds = CounterMetricFamily("ringtrain_collective_seconds", "Time in this rank's collectives",
                                      labels=labels + ["kind"])
        busbw = GaugeMetricFamily("ringtrain_collective_bus_bandwidth_bytes_per_second",
                                  "Bus bandwidth of this rank's collectives since the start (nccl-tests' busbw)",
                                  labels=labels + ["kind"])
        waited = CounterMetricFamily("ringtrain_waited_seconds", "Time this rank waited for each rank in agreement "
                                     "cycles", labels=labels + ["for_rank"])
        others = CounterMetricFamily("ringtrain_straggler_waited_seconds", "Time the other ranks waited for each "
                                     "rank in agreement cycles (the same on every rank)", labels=labels + ["for_rank"])
        share = GaugeMetricFamily("ringtrain_straggler_share", "Share of the last straggler window the other ranks "
                                  "spent waiting for each rank", labels=labels + ["for_rank"])
        cache_new = CounterMetricFamily("ringtrain_response_cache_assigned", "Collectives given a cache id (first "
                                        "sightings of a name and metadata)", labels=labels)
        cache_hits = CounterMetricFamily("ringtrain_response_cache_hits", "Collectives agreed by cache id (all "
                                         "collectives less first sightings)", labels=labels)
        cache_evicted = CounterMetricFamily("ringtrain_response_cache_evictions", "Cache entries evicted (least "
                                            "recently used first)", labels=labels)
        stalls = CounterMetricFamily("ringtrain_stalls", "Stalls the ranks agreed on (each ended collectives with "
                                     "StallError)", labels=labels)
        mismatches = CounterMetricFamily("ringtrain_mismatches", "Collectives whose shape, dtype, op or root differed "
                                         "across ranks", labels=labels)
        dumps = CounterMetricFamily("ringtrain_flight_recorder_dumps", "Flight recorder files this rank wrote",
                                    labels=labels)
        for set_id, engine in self.engines():
            ps = str(set_id)
            size = engine.size
            total = 0
            engine.fast.drain()
            for kind, s in engine.stats.local().items():
                key = [rank, ps, kind]
                count.add_metric(key, s["count"])
                nbytes.add_metric(key, s["bytes"])
                seconds.add_metric(key, s["seconds"])
                factor = _BUS_FACTOR.get(kind, lambda n: 1.0)(size) if size > 1 else 0.0
                busbw.add_metric(key, s["bytes"] / s["seconds"] * factor if s["seconds"] > 0 else 0.0)
                total += s["count"]
            observer = engine.observer
            stragglers = observer.stragglers
            if stragglers is not None:
                rows = stragglers.exchange.wait_rows()
                window = stragglers.last_window
                me = engine.rank
                for p in range(size):
                    waited.add_metric([rank, ps, str(p)], rows[me][p][0] * 1e-6)
                    others.add_metric([rank, ps, str(p)], sum(rows[q][p][0] for q in range(size) if q != p) * 1e-6)
                    if window is not None:
                        share.add_metric([rank, ps, str(p)], window["ranks"][p]["share"])
            cache = engine.agreement.cache
            cache_new.add_metric([rank, ps], cache.assigned)
            cache_hits.add_metric([rank, ps], max(total - cache.assigned, 0))
            cache_evicted.add_metric([rank, ps], cache.evicted)
            stalls.add_metric([rank, ps], observer.counts["stalls"])
            mismatches.add_metric([rank, ps], observer.counts["mismatches"])
            dumps.add_metric([rank, ps], observer.recorder.dumps)
        yield from (count, nbytes, seconds, busbw, waited, others, share, cache_new, cache_hits, cache_evicted,
                    stalls, mismatches, dumps)
        resets = CounterMetricFamily("ringtrain_elastic_resets", "Worlds this process re-formed after a failure or a "
                                     "change of hosts", labels=["rank"])
        resets.add_metric([rank], _elastic["resets"])
        recovery = GaugeMetricFamily("ringtrain_elastic_last_recovery_seconds", "From the failure to the re-formed "
                                     "world, the last time", labels=["rank"])
        recovery.add_metric([rank], _elastic["last_recovery_s"])
        yield resets
        yield recovery


class Exporter:
    """This rank's endpoint and/or text file. start() at init, stop() at shutdown (the file's last write)."""

    def __init__(self, engines, rank, local_rank, port=0, path=""):
        try:
            from prometheus_client import CollectorRegistry
        except ImportError:
            raise RingtrainError("RINGTRAIN_METRICS_PORT / RINGTRAIN_METRICS_FILE need prometheus-client: "
                                 "pip install 'ringtrain[metrics]'") from None
        self.rank = rank
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(engines, rank))
        self.port = port + local_rank if port else 0
        self.path = metrics_file(path, rank) if path else ""
        self._server = None
        self._stop = threading.Event()
        self._writer = None

    def start(self):
        from prometheus_client import start_http_server
        if self.port:
            try:
                self._server, _ = start_http_server(self.port, registry=self.registry)
            except OSError as e:
                raise RingtrainError(f"RINGTRAIN_METRICS_PORT: rank {self.rank} cannot serve metrics on port "
                                     f"{self.port} (the port + its local rank): {e}") from None
        if self.path:
            self.write()
            self._writer = threading.Thread(target=self._write_every, name="ringtrain-metrics", daemon=True)
            self._writer.start()
        return self

    def write(self):
        from prometheus_client import write_to_textfile
        try:
            write_to_textfile(self.path, self.registry)
        except OSError as e:
            log.warning("ringtrain: could not write metrics to %s: %s", self.path, e)

    def _write_every(self):
        while not self._stop.wait(FILE_PERIOD_S):
            self.write()

    def stop(self):
        """Last file write, then the endpoint and the writer stop (call before the engines are freed)."""
        self._stop.set()
        if self.path:
            self.write()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def metrics_file(path, rank):
    """RINGTRAIN_METRICS_FILE for this rank: "{rank}" in it is replaced, else rank r > 0 writes name.rank<r>.ext."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    if rank == 0:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"

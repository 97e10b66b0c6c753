"""Two elastic worlds one after the other in this process, on one metrics port: each world's endpoint serves its own
counts, and the process's elastic counters go on (argv[1]: the port). Prints "OK world <n>" per world."""
import sys
import urllib.request

import numpy as np

import ringtrain as rt
from ringtrain.core import metrics, state

port = int(sys.argv[1])
for world in range(2):
    rt.init(metrics_port=port, elastic=True)     # as an elastic worker: abandon() ends no process
    rt.allreduce(np.ones(4, np.float32), name=f"world{world}")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    assert 'ringtrain_collectives_total{kind="allreduce",process_set="0",rank="0"} 1.0' in text, text
    assert f"ringtrain_elastic_resets_total{{rank=\"0\"}} {float(world)}" in text, text
    state.abandon("the next world")
    metrics.note_elastic_reset(0.25)
    print(f"OK world {world}", flush=True)

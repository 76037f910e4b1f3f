"""A client process that fetches random experts flat out and checks every record against the model file.

Run by the tests as a separate process: `python hammer.py MODEL SOCKET SEED`, until its standard input closes
(a test ends it once the daemon shows the state it waits for, however long the machine takes). Prints `{"ready": true}`, then `{"attached": bool}` each time its client attaches or detaches
(so that a test can wait for either), then one JSON line of counts, among them the file reads it made while detached.
"""

import json
import random
import select
import sys

from moe_l2.client.connection import L2Client
from moe_l2.client.pool import ExpertPool
from moe_l2.model import ModelFiles


def stdin_closed() -> bool:
    return bool(select.select([sys.stdin], [], [], 0)[0]) and not sys.stdin.readline()


def main(model: str, socket: str, seed: int) -> None:
    files = ModelFiles.open(model)
    truth = [[files.read_record(layer, e) for e in range(files.n_experts)] for layer in range(files.n_layers)]
    client = L2Client(files, socket, wait_s=5, heartbeat_s=0.2, timeout_s=0.5)
    pool = ExpertPool(files, capacity=files.top_k, client=client)
    rng = random.Random(seed)
    result = {"fetches": 0, "checked": 0, "mismatches": 0, "l2_hits": 0, "l3_reads": 0, "l0_hits": 0,
              "l3_reads_detached": 0}
    print(json.dumps({"ready": True}), flush=True)
    attached = None
    while not stdin_closed():
        if client.attached != attached:
            attached = client.attached
            print(json.dumps({"attached": attached}), flush=True)
        layer = rng.randrange(files.n_layers)
        batch = rng.sample(range(files.n_experts), files.top_k)
        counts = pool.fetch(layer, batch)
        result["fetches"] += 1
        for name in ("l0_hits", "l2_hits", "l3_reads"):
            result[name] += getattr(counts, name)
        if not attached:
            result["l3_reads_detached"] += counts.l3_reads
        for expert in batch:
            result["checked"] += 1
            if pool.layers[layer].record(expert) != truth[layer][expert]:
                result["mismatches"] += 1
    result["attaches"] = client.attaches
    pool.close()
    client.close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))

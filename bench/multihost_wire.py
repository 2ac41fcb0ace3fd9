"""The cost per pass of sending a multi-process server's pass inputs to the other process, by the
two channels docs/serve.md ("Multi-host") weighs: JAX's `multihost_utils.broadcast_one_to_all`
of the fixed-shape int32 array (a gloo collective on CPU) and scaletui's TCP link (link.py).

    python bench/multihost_wire.py [--max-seq-len 2048] [--passes 300]

Starts itself as 2 processes (jax.distributed on localhost, 1 CPU device each). Each pass packs
4 new requests of 100 tokens and a cancel (wire.py). Printed per channel: median and p99
microseconds per pass on process 0 for pack + send + unpack; for the link also the round trip
of a pass and the follower's acknowledgement (an upper bound on its delivery)."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import numpy as np
from _smoke import shrink


def _stats(us: list[float]) -> str:
    a = np.asarray(us)
    return f"median {np.median(a):7.1f} us, p99 {np.percentile(a, 99):7.1f} us"


def run(pid: int, port: int, max_seq_len: int, passes: int) -> None:
    from scaletui.xla_env import set_host_devices

    set_host_devices(1)
    os.environ["JAX_PLATFORMS"] = "cpu"
    from scaletui.serve.engine.engine_api import SamplingParams
    from scaletui.serve.multihost import launch, link, wire

    cluster = launch.Cluster(f"127.0.0.1:{port}", 2, pid)
    launch.initialize(cluster)
    from jax.experimental import multihost_utils

    shape = wire.WireShape.for_server(max_seq_len)
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=64)
    events = [wire.Arrival(i, tuple(range(100)), params) for i in range(4)]
    events.append(wire.Cancel(1, "abort"))
    array, _ = wire.pack(shape, wire.RUN, 0, events)

    # JAX's broadcast (a compiled collective): process 0's array to both
    times = []
    for i in range(passes + 20):
        t0 = time.perf_counter()
        mine = wire.pack(shape, wire.RUN, i, events)[0] if pid == 0 else np.zeros_like(array)
        got = wire.unpack(shape, np.asarray(multihost_utils.broadcast_one_to_all(mine)))
        if i >= 20:
            times.append((time.perf_counter() - t0) * 1e6)
    assert len(got.events) == 5
    if pid == 0:
        print(f"broadcast_one_to_all ({shape.size * 4} B): {_stats(times)}", flush=True)

    # the TCP link: process 0 sends, the follower acknowledges every pass
    if pid == 0:
        chan = link.open_leader("127.0.0.1", 1, launch._port_to_all, 60.0)
        send, trip = [], []
        for i in range(passes + 20):
            t0 = time.perf_counter()
            a, _ = wire.pack(shape, wire.RUN, i, events)
            chan.send(a)
            wire.unpack(shape, a)
            t1 = time.perf_counter()
            while chan.finished[1] < i:
                pass
            if i >= 20:
                send.append((t1 - t0) * 1e6)
                trip.append((time.perf_counter() - t0) * 1e6)
        print(f"TCP link, pack + send + unpack: {_stats(send)}", flush=True)
        print(f"TCP link, round trip with ack:  {_stats(trip)}", flush=True)
        time.sleep(1.0)  # the follower exits first: JAX's agent there need not see us go
        chan.close()
    else:
        chan = link.open_follower("127.0.0.1", 1, launch._port_to_all(0), shape.size * 4)
        for _ in range(passes + 20):
            got = wire.unpack(shape, chan.recv(60.0))
            chan.finished(got.number)
    os._exit(0)  # skip jax.distributed's shutdown barrier


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--passes", type=int, default=300)
    p.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help="the JAX coordinator's port (0: a free one)")
    shrink(p, max_seq_len=256, passes=20)  # a smoke run (bench/_smoke.py)
    args = p.parse_args()
    if args.process_id is not None:
        return run(args.process_id, args.port, args.max_seq_len, args.passes)
    if not args.port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.port = s.getsockname()[1]
    argv = [sys.executable, __file__, "--max-seq-len", str(args.max_seq_len)]
    argv += ["--passes", str(args.passes), "--port", str(args.port)]
    procs = [subprocess.Popen([*argv, "--process-id", str(i)]) for i in (0, 1)]
    sys.exit(max(p.wait() for p in procs))


if __name__ == "__main__":
    main()

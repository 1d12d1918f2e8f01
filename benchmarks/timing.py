"""Device timing shared by the codec benchmarks (codec_gpu.py for BF16, fp8_codec_gpu.py for FP8).

Both time the same things the same way -- bulk encode/decode per launch and replayed from CUDA
graphs, against a device copy of the same inputs -- so that their numbers compare; one copy of the
timing keeps them so.  Without CUDA (numba's simulator) the times are host times of a dry run.
"""
from __future__ import annotations

import statistics
import time

import torch


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gpu_time_us(fn, reps):
    """Median device time of ``fn(i)`` in microseconds (CUDA events), or host time in the simulator."""
    if not torch.cuda.is_available():
        t = time.perf_counter()
        for i in range(reps):
            fn(i)
        return (time.perf_counter() - t) / reps * 1e6
    for i in range(3):
        fn(i)
    times = []
    for i in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i)
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1000 for a, b in times)


def graph_time_us(fn, sets, reps):
    """Median device time of ``fn(s)`` replayed from CUDA graphs, one graph per rotation set.

    The plain timings include the host's launch cost when a launch's kernel is shorter than it
    (about 20-35 us of Python per call: codec_gpu.py's 3 x 64 shape); a graph replay costs ~2.4 us of host time.
    """
    graphs = []
    for s in range(sets):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                     # warm-up off the capture (torch's recipe)
            fn(s)
        torch.cuda.current_stream().wait_stream(side)
        sync()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(s)
        graphs.append(g)
    t = gpu_time_us(lambda i: graphs[i % sets].replay(), reps)
    sync()
    return t


def copy_bandwidth(data, reps):
    """Median time (us) of a device copy (``Tensor.copy_``) of the K and V input tiles of one rotation
    set, rotating over the sets in ``data`` (``[set][kind] = (tiles, bases, bases)``) as the codec
    timings do, and the bandwidth it reaches in TB/s (bytes read + written): the floors' yardstick,
    measured in the same run on the same tensors."""
    sets = len(data)
    src = [[bits for bits, _, _ in kv] for kv in data]
    dst = [[torch.empty_like(b) for b in kv] for kv in src]

    def copy_all(i):
        for d, s in zip(dst[i % sets], src[i % sets]):
            d.copy_(s)

    t = gpu_time_us(copy_all, reps)
    return t, 2 * sum(b.nbytes for b in src[0]) / t / 1e6

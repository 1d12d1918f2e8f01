"""The epoch adaptation rule on the GPU: what :meth:`gaac.epochs.Adapter.assign` decides, for many blocks at once.

A prefill finalizes thousands of blocks per (kind, layer); the rule looks at them a check (8 blocks) at a
time, and on the host each check costs milliseconds.  The rule splits into a part that does not depend on
its own decisions and a short chain that does:

* the exponent histogram and the candidate windows of every check depend only on the blocks, so
  :func:`candidates_kernel` runs them per channel, a thread block per 16 channels and a thread per four
  histogram bins, looping over the checks;
* whether a check appends its candidate depends on the epoch current at that check, the last one
  appended; :func:`chain_kernel` walks the checks in order, a thread block per (kind, layer), and for
  each check whose candidate differs from the current epoch counts, over the check's 8 blocks, the escape
  bytes under both.

Both read the blocks where they lie (a strided view of the input; the adapter's pending blocks from a
small array), the adapter's histogram goes to the device and back, and one copy to the host brings the
decisions.  The results are the host rule's, bit for bit (``tests/test_epochs_gpu.py`` and the simulator's
``tests/test_epochs.py`` compare them).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from .. import epochs as E
from .. import layout as L
from .bitops import SIMULATOR

BINS = 256                   # exponent values of a BF16 element
CHANNELS_PER_BLOCK = 16      # channels of one head per thread block of the candidates kernel
BINS_PER_THREAD = 4          # histogram bins a thread of the candidates kernel owns
MAX_CHANNELS = 8192          # kv_heads * head_dim the chain kernel's shared bases hold
CHAIN_THREADS = 1024
COST_3BIT = L.ESCAPE_BYTES[L.MODE_3BIT]
COST_4BIT = L.ESCAPE_BYTES[L.MODE_4BIT]
COST_RAW = L.ESCAPE_BYTES[L.MODE_RAW]


@cuda.jit(device=True, inline=True)
def exponent(xa, xb, ja, rec, r0, job, b, h, t, d):
    """The exponent of element (head h, token t, channel d) of job ``job``'s logical block ``b``: its pending
    blocks first (``rec``), then its new blocks (``xa`` for the first ``ja`` jobs, ``xb`` for the rest)."""
    r = r0[job]
    if b < r:
        v = rec[job, b, h, t, d]
    elif job < ja:
        v = xa[job, b - r, h, t, d]
    else:
        v = xb[job - ja, b - r, h, t, d]
    return (np.int32(v) >> 7) & 0xFF


@cuda.jit(device=True, inline=True)
def pair(xa, xb, ja, rec, r0, job, b, h, t, w):
    """Word ``w`` of (head h, token t) of job ``job``'s logical block ``b``: elements 2w (low half) and 2w + 1,
    from the int32 views of the blocks (as :func:`exponent`)."""
    r = r0[job]
    if b < r:
        return rec[job, b, h, t, w]
    if job < ja:
        return xa[job, b - r, h, t, w]
    return xb[job - ja, b - r, h, t, w]


@functools.lru_cache(maxsize=None)
def candidates_kernel(cpb: int, every: int, shift: int):
    """Per job and channel: the decayed histogram after each check of ``every`` blocks (decay shift
    ``shift``) and the check's best windows (``cpb`` channels of one head per thread block)."""
    bpt = BINS_PER_THREAD
    cells, pairs = cpb * BINS, 2 * cpb                  # shared array sizes: compile-time constants
    tpc = BINS // bpt                                   # threads per channel
    w3, w4 = L.WINDOW_3BIT, L.WINDOW_4BIT
    tokens = every * L.BLOCK_TOKENS

    # 1024 threads a block: at most 64 registers a thread
    jit = cuda.jit if SIMULATOR else cuda.jit(max_registers=64)

    @jit
    def kernel(xa, xb, ja, rec, r0, checks, hist, cand, head_dim):
        job = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        c = tid // tpc
        q = tid % tpc
        ch0 = cuda.blockIdx.y * cpb
        ch = ch0 + c
        h = ch0 // head_dim
        d0 = ch0 % head_dim
        cnt = cuda.shared.array(cells, np.int32)
        hs = cuda.shared.array(cells, np.int32)
        best = cuda.shared.array(pairs, np.int32)
        base = c * BINS + q * bpt
        h0 = hist[job, ch, q * bpt]
        h1 = hist[job, ch, q * bpt + 1]
        h2 = hist[job, ch, q * bpt + 2]
        h3 = hist[job, ch, q * bpt + 3]
        cnt[base] = 0
        cnt[base + 1] = 0
        cnt[base + 2] = 0
        cnt[base + 3] = 0
        if q == 0:
            best[2 * c] = -1
            best[2 * c + 1] = -1
        cuda.syncthreads()
        for j in range(checks[job]):
            # the check's exponents into the shared counts
            i = tid
            while i < tokens * cpb:
                tok = i // cpb
                b = j * every + tok // L.BLOCK_TOKENS
                e = exponent(xa, xb, ja, rec, r0, job, b, h, tok % L.BLOCK_TOKENS, d0 + i % cpb)
                cuda.atomic.add(cnt, (i % cpb) * BINS + e, 1)
                i += nthreads
            cuda.syncthreads()
            # decay, then add: each thread its own bins
            h0 = h0 - (h0 >> shift) + cnt[base]
            h1 = h1 - (h1 >> shift) + cnt[base + 1]
            h2 = h2 - (h2 >> shift) + cnt[base + 2]
            h3 = h3 - (h3 >> shift) + cnt[base + 3]
            cnt[base] = 0
            cnt[base + 1] = 0
            cnt[base + 2] = 0
            cnt[base + 3] = 0
            hs[base] = h0
            hs[base + 1] = h1
            hs[base + 2] = h2
            hs[base + 3] = h3
            cuda.syncthreads()
            # the windows starting at this thread's bins; the largest count wins, the smallest start on ties
            k3 = -1
            k4 = -1
            s = q * bpt
            a3 = 0
            a4 = 0
            for u in range(w4):
                if s + u < BINS:
                    v = hs[c * BINS + s + u]
                    a4 += v
                    if u < w3:
                        a3 += v
            for s in range(q * bpt, q * bpt + bpt):
                if s > q * bpt:          # slide both windows one bin right
                    a3 += (hs[c * BINS + s + w3 - 1] if s + w3 - 1 < BINS else 0) - hs[c * BINS + s - 1]
                    a4 += (hs[c * BINS + s + w4 - 1] if s + w4 - 1 < BINS else 0) - hs[c * BINS + s - 1]
                if s <= BINS - w3:
                    k3 = max(k3, a3 * BINS + (BINS - 1 - s))
                if s <= BINS - w4:
                    k4 = max(k4, a4 * BINS + (BINS - 1 - s))
            # a window covering nothing loses to any that covers something, and with none covering anything
            # the answer is start 0, which the reset value -1 gives: so only covering windows compete
            if k3 >= BINS:
                cuda.atomic.max(best, 2 * c, k3)
            if k4 >= BINS:
                cuda.atomic.max(best, 2 * c + 1, k4)
            cuda.syncthreads()
            if q == 0:
                cand[job, j, 0, ch] = BINS - 1 - (best[2 * c] & (BINS - 1))
                cand[job, j, 1, ch] = BINS - 1 - (best[2 * c + 1] & (BINS - 1))
                best[2 * c] = -1
                best[2 * c + 1] = -1
        hist[job, ch, q * bpt] = h0
        hist[job, ch, q * bpt + 1] = h1
        hist[job, ch, q * bpt + 2] = h2
        hist[job, ch, q * bpt + 3] = h3

    return kernel


@cuda.jit(device=True, inline=True)
def group_cost(e, b3, b4, fits3, fits4):
    """Fold one element's exponent into its group's mode: returns the updated (fits 3-bit, fits 4-bit)."""
    d3 = e - b3
    d4 = e - b4
    return fits3 and 0 <= d3 < L.WINDOW_3BIT, fits4 and 0 <= d4 < L.WINDOW_4BIT


@functools.lru_cache(maxsize=None)
def chain_kernel(every: int):
    """Per job, in check order (a check every ``every`` blocks): whether it appends its candidate."""
    tokens = every * L.BLOCK_TOKENS
    group = L.GROUP_SIZE

    @cuda.jit
    def kernel(xa, xb, ja, rec, r0, checks, cand, cur, finalized, n_epochs, warmup, max_epochs, payback,
               table_bytes, kv_heads, head_dim, accept):
        job = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        channels = kv_heads * head_dim
        c3 = cuda.shared.array(MAX_CHANNELS, np.uint8)       # the current epoch's bases
        c4 = cuda.shared.array(MAX_CHANNELS, np.uint8)
        n3 = cuda.shared.array(MAX_CHANNELS, np.uint8)       # the check's candidate
        n4 = cuda.shared.array(MAX_CHANNELS, np.uint8)
        part = cuda.shared.array(CHAIN_THREADS, np.int32)
        flag = cuda.shared.array(1, np.int32)
        ch = tid
        while ch < channels:
            c3[ch] = cur[job, 0, ch]
            c4[ch] = cur[job, 1, ch]
            ch += nthreads
        n_ep = n_epochs[job]
        groups = tokens * channels // group
        per_head = L.BLOCK_TOKENS * head_dim // group
        cuda.syncthreads()
        for j in range(checks[job]):
            accept[job, j] = 0
            if finalized[job] + (j + 1) * every < warmup or n_ep >= max_epochs:
                continue
            differs = 0
            ch = tid
            while ch < channels:
                n3[ch] = cand[job, j, 0, ch]
                n4[ch] = cand[job, j, 1, ch]
                if n3[ch] != c3[ch] or n4[ch] != c4[ch]:
                    differs = 1
                ch += nthreads
            if cuda.syncthreads_or(differs) == 0:
                continue
            # escape bytes saved on the check's blocks: current epoch's minus the candidate's
            saved = 0
            g = tid
            while g < groups:
                b = j * every + g // (kv_heads * per_head)
                rest = g % (kv_heads * per_head)
                h = rest // per_head
                t = (rest % per_head) // (head_dim // group)
                d = (rest % (head_dim // group)) * group
                cur3 = True
                cur4 = True
                new3 = True
                new4 = True
                for u in range(group // 2):
                    word = pair(xa, xb, ja, rec, r0, job, b, h, t, d // 2 + u)
                    c = h * head_dim + d + 2 * u
                    e = (word >> 7) & 0xFF
                    cur3, cur4 = group_cost(e, c3[c], c4[c], cur3, cur4)
                    new3, new4 = group_cost(e, n3[c], n4[c], new3, new4)
                    e = (word >> 23) & 0xFF
                    cur3, cur4 = group_cost(e, c3[c + 1], c4[c + 1], cur3, cur4)
                    new3, new4 = group_cost(e, n3[c + 1], n4[c + 1], new3, new4)
                saved += (COST_3BIT if cur3 else (COST_4BIT if cur4 else COST_RAW))
                saved -= (COST_3BIT if new3 else (COST_4BIT if new4 else COST_RAW))
                g += nthreads
            part[tid] = saved
            cuda.syncthreads()
            if tid < 32:
                s = 0
                i = tid
                while i < nthreads:
                    s += part[i]
                    i += 32
                part[tid] = s
            cuda.syncthreads()
            if tid == 0:
                s = 0
                for i in range(min(32, nthreads)):
                    s += part[i]
                flag[0] = 1 if np.int64(s) * payback >= table_bytes else 0
            cuda.syncthreads()
            if flag[0]:
                if tid == 0:
                    accept[job, j] = 1
                n_ep += 1
                ch = tid
                while ch < channels:
                    c3[ch] = n3[ch]
                    c4[ch] = n4[ch]
                    ch += nthreads
            cuda.syncthreads()

    return kernel


def _stacked(tensors: list):
    """``tensors`` (equal shapes and strides) as one tensor with a leading axis: a view of their common
    storage where they lie at equal distances (a prefill's layers), else a copy."""
    import torch

    first = tensors[0]
    if len(tensors) > 1:
        size = first.element_size()
        gaps = {(b.data_ptr() - a.data_ptr()) for a, b in zip(tensors, tensors[1:])}
        same = all(t.shape == first.shape and t.stride() == first.stride() and t.dtype == first.dtype
                   and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for t in tensors)
        if same and len(gaps) == 1:
            gap = gaps.pop()
            if gap > 0 and gap % size == 0:
                return torch.as_strided(first, (len(tensors),) + tuple(first.shape),
                                        (gap // size,) + tuple(first.stride()))
        return torch.stack(tensors)
    return first[None]


def assign(jobs: list) -> list:
    """Run the adaptation rule on the GPU for each ``(adapter, blocks)`` of ``jobs``, as
    ``adapter.assign(blocks)`` would on the host.

    ``blocks`` are int16 ``[n, kv_heads, 16, head_dim]`` on the GPU (a view is fine), the same ``n`` and
    shape in every job; each adapter has its own :class:`~gaac.calibration.Calibration` (epochs are
    appended to it).  Returns the epoch each job's blocks are coded with (``int64 [n]`` each); afterwards
    every adapter holds the state :meth:`~gaac.epochs.Adapter.assign` leaves.  In the simulator the
    blocks are CPU tensors.  One launch of each kernel serves all jobs; one copy to the host brings back
    the decisions.
    """
    if not jobs:
        return []
    batch = Batch(jobs)
    batch.candidates()
    batch.chain()
    return batch.finish()


class Batch:
    """One :func:`assign`, in its three stages (so that a benchmark can time each): the candidates kernel,
    the chain kernel, and :meth:`finish`, which waits for the decisions and applies them to the adapters."""

    def __init__(self, jobs: list):
        import torch

        # K jobs first, then V: each kind's blocks are one strided view where a prefill's layers allow
        self.order = sorted(range(len(jobs)), key=lambda i: jobs[i][0].kind)
        self.jobs = jobs = [jobs[i] for i in self.order]
        first_adapter, first = jobs[0]
        n, kv_heads, _, head_dim = first.shape
        channels = kv_heads * head_dim
        self.cpb = cpb = 1 if SIMULATOR else CHANNELS_PER_BLOCK
        if channels > MAX_CHANNELS or head_dim % cpb:
            raise ValueError(f"kv_heads * head_dim = {channels} (at most {MAX_CHANNELS}), head_dim {head_dim} "
                             f"(a multiple of {cpb})")
        if any(b.shape != first.shape for _, b in jobs):
            raise ValueError("every job's blocks must have the same shape")
        self.n, self.kv_heads, self.head_dim, self.channels = n, kv_heads, head_dim, channels
        self.device = device = first.device
        n_jobs = len(jobs)
        ja = sum(1 for a, _ in jobs if a.kind == jobs[0][0].kind)
        self.r0 = r0 = np.array([len(a._recent) for a, _ in jobs], dtype=np.int32)
        self.every = every = E.ADAPT_EVERY
        self.checks = checks = (r0 + n) // every
        rec_np = np.zeros((n_jobs, max(1, int(r0.max())), kv_heads, L.BLOCK_TOKENS, head_dim), dtype=np.int16)
        for i, (a, _) in enumerate(jobs):
            for b, block in enumerate(a._recent):
                rec_np[i, b] = np.asarray(block).view(np.int16)
        fresh = all(a.finalized == 0 for a, _ in jobs)           # a new cache's prefill: empty histograms
        cur_np = np.empty((n_jobs, 2, channels), dtype=np.int32)
        for i, (a, _) in enumerate(jobs):
            b3, b4 = a.calibration.bases(a.layer, a.kind, a.epoch)
            cur_np[i, 0], cur_np[i, 1] = np.asarray(b3).reshape(-1), np.asarray(b4).reshape(-1)
        finalized = np.array([a.finalized - len(a._recent) for a, _ in jobs], dtype=np.int32)
        n_epochs = np.array([a.epoch + 1 for a, _ in jobs], dtype=np.int32)
        xa = _stacked([b for _, b in jobs[:ja]])
        xb = _stacked([b for _, b in jobs[ja:]]) if ja < n_jobs else xa

        def dev(a):
            t = torch.from_numpy(np.ascontiguousarray(a))
            return t if device.type != "cuda" else t.to(device)

        rec, cur, r0_d, checks_d = dev(rec_np), dev(cur_np), dev(r0), dev(checks.astype(np.int32))
        self.hist = (torch.zeros((n_jobs, channels, BINS), dtype=torch.int32, device=device) if fresh else
                     dev(np.stack([a.hist.reshape(channels, BINS) for a, _ in jobs]).astype(np.int32)))
        m = max(1, int(checks.max()))
        self.cand = torch.zeros((n_jobs, m, 2, channels), dtype=torch.uint8, device=device)
        self.accept = torch.zeros((n_jobs, m), dtype=torch.int32, device=device)
        self.args1 = (xa, xb, ja, rec, r0_d, checks_d, self.hist, self.cand, head_dim)
        words = [x.view(torch.int32) for x in (xa, xb, rec)]      # the chain reads two elements a load
        self.args2 = (words[0], words[1], ja, words[2], r0_d, checks_d, self.cand, cur, dev(finalized), dev(n_epochs), E.WARMUP_BLOCKS,
                      E.MAX_EPOCHS, E.PAYBACK_CHECKS, E.epoch_table_bytes(first_adapter.calibration), kv_heads,
                      head_dim, self.accept)

    def _launch(self, kernel, grid, block, args) -> None:
        import torch

        if int(self.checks.max()) == 0:
            return
        if SIMULATOR:
            kernel[grid, block](*(a.numpy() if isinstance(a, torch.Tensor) else a for a in args))
        else:
            kernel[grid, block, cuda.external_stream(torch.cuda.current_stream(self.device).cuda_stream)](*args)

    def candidates(self) -> None:
        """Launch the candidates kernel: every check's windows, and the histograms after the last check."""
        self._launch(candidates_kernel(self.cpb, self.every, E.DECAY_SHIFT), (len(self.jobs), self.channels // self.cpb),
                     self.cpb * BINS // BINS_PER_THREAD, self.args1)

    def chain(self) -> None:
        """Launch the chain kernel: which checks append their candidate."""
        self._launch(chain_kernel(self.every), len(self.jobs), 64 if SIMULATOR else CHAIN_THREADS, self.args2)

    def finish(self) -> list:
        """Wait for the decisions; append the epochs, update the adapters, return each job's block epochs."""
        import torch

        jobs, n, checks, r0, every = self.jobs, self.n, self.checks, self.r0, self.every
        kv_heads, head_dim = self.kv_heads, self.head_dim
        accept_h = self.accept.cpu().numpy()
        picked_all = [np.flatnonzero(accept_h[i, :checks[i]]) for i in range(len(jobs))]
        hist_h = self.hist.cpu().numpy()
        wanted = [(i, j) for i in range(len(jobs)) for j in picked_all[i]]
        tables = {}
        if wanted:
            idx = torch.tensor(wanted, dtype=torch.int64, device=self.device)
            got = self.cand[idx[:, 0], idx[:, 1]].cpu().numpy().astype(np.uint8)
            tables = {w: got[t] for t, w in enumerate(wanted)}
        out = [None] * len(jobs)
        for i, (a, blocks) in enumerate(jobs):
            picked = picked_all[i]
            # logical block r0 + b belongs to check (r0 + b) // every and is coded with the epoch current before it
            check_of = (r0[i] + np.arange(n)) // every
            epochs = a.epoch + np.searchsorted(picked, check_of, side="left").astype(np.int64)
            for j in picked:
                b3, b4 = tables[(i, j)]
                a.calibration.add_epoch(a.layer, a.kind, b3.reshape(kv_heads, head_dim),
                                        b4.reshape(kv_heads, head_dim))
            a.hist = hist_h[i].reshape(kv_heads, head_dim, BINS).astype(np.int64)
            a.finalized += n
            left = int((r0[i] + n) % every)
            if checks[i] == 0:
                a._recent = list(a._recent) + list(blocks.cpu().numpy().view(np.uint16))
            else:
                a._recent = list(blocks[n - left:].cpu().numpy().view(np.uint16)) if left else []
            out[self.order[i]] = epochs
        return out

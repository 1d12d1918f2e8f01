"""The epoch adaptation rule on the GPU: what :meth:`gaac.epochs.Adapter.assign` decides, for many blocks at once.

A prefill finalizes thousands of blocks per (kind, layer); the rule looks at them a check (8 blocks) at a
time, and on the host each check costs milliseconds.  The rule splits into a part that does not depend on
its own decisions and a short chain that does:

* the exponent histogram and the candidate windows of every check depend only on the blocks, so
  :func:`candidates_kernel` runs them per channel, a warp per channel and a lane per 8 histogram bins,
  looping over the checks;
* whether a check appends its candidate depends on the epoch current at that check, the last one
  appended.  :func:`costs_kernel` counts, for every check at once, the escape bytes its candidate saves
  against the epoch current when the batch starts; :func:`chain_kernel` walks the checks in order, a thread
  block per (kind, layer), deciding from those counts until the batch appends an epoch, and after that
  counting itself, over the check's 8 blocks, in the groups of channels where candidate and current
  epoch differ.

Both read the blocks where they lie (a strided view of the input; the adapter's pending blocks from a
small array); the adapters' histograms stay on the device until the host rule needs one, and one copy to
the host brings the decisions.  The results are the host rule's, bit for bit (``tests/test_epochs_gpu.py``
and, in the simulator, ``tests/test_epochs_device.py`` compare them).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from .. import epochs as E
from .. import layout as L
from .primitives import SIMULATOR, WARP, syncwarp

BINS = 256                   # exponent values of a BF16 element
CHANNELS_PER_BLOCK = 8       # channels of one head (a warp each) per thread block of the candidates kernel
CANDIDATE_REGISTERS = None   # a register cap for the candidates kernel (None: the compiler's choice)
MAX_CHANNELS = 8192          # kv_heads * head_dim the chain kernel's shared bases hold
MAX_GROUPS = MAX_CHANNELS // L.GROUP_SIZE
CHAIN_THREADS = 1024
# a block of CHAIN_THREADS threads fits an SM only at 64 registers a thread or fewer
block_jit = cuda.jit if SIMULATOR else cuda.jit(max_registers=65536 // CHAIN_THREADS)
COST_3BIT = L.ESCAPE_BYTES[L.MODE_3BIT]
COST_4BIT = L.ESCAPE_BYTES[L.MODE_4BIT]
COST_RAW = L.ESCAPE_BYTES[L.MODE_RAW]


@cuda.jit(device=True, inline=True)
def element(src, at, rec, job, r, b, h, t, x):
    """Entry ``x`` of (head h, token t) of job ``job``'s logical block ``b``: its ``r`` pending blocks first
    (``rec``), then its new blocks (``src[at]``, the job's own source array).  An element of the int16 views,
    two elements of the int32 views."""
    return rec[job, b, h, t, x] if b < r else src[at, b - r, h, t, x]


@cuda.jit(device=True, inline=True)
def exponent(src, at, rec, job, r, b, h, t, d):
    """The exponent of element (head h, token t, channel d) of job ``job``'s logical block ``b``."""
    return (np.int32(element(src, at, rec, job, r, b, h, t, d)) >> 7) & 0xFF


@functools.lru_cache(maxsize=None)
def candidates_kernel(wpb: int, every: int, shift: int, registers: int | None = None):
    """Per job and channel: the decayed histogram after each check of ``every`` blocks (decay shift
    ``shift``) and the check's best windows.

    A warp per channel (``wpb`` channels of one head per thread block), a lane per 8 histogram bins; the
    warps of a block never wait for each other.  The shared counts and histogram
    are skewed (bin ``b`` at ``b + b // 8``) so that the lanes' 8-bin runs fall in distinct banks.  The next
    check's exponents are loaded before this check's histogram work, to hide the loads' latency."""
    w3, w4 = L.WINDOW_3BIT, L.WINDOW_4BIT
    tokens = every * L.BLOCK_TOKENS
    per_lane = tokens // WARP                         # exponents a lane counts per check
    run = BINS // WARP                                # bins a lane owns: 8
    stride = BINS + BINS // run                       # one channel's skewed shared row
    cells, pairs = wpb * stride, 2 * wpb              # shared array sizes: compile-time constants
    jit = cuda.jit if SIMULATOR or registers is None else cuda.jit(max_registers=registers)

    @jit
    def kernel(xa, xb, ja, rec, r0, checks, hist, cand, head_dim):
        job = cuda.blockIdx.x
        warp = cuda.threadIdx.x // WARP
        lane = cuda.threadIdx.x % WARP
        ch = cuda.blockIdx.y * wpb + warp
        h = ch // head_dim
        d = ch % head_dim
        cnt = cuda.shared.array(cells, np.int32)
        hs = cuda.shared.array(cells, np.int32)
        best = cuda.shared.array(pairs, np.int32)
        row = warp * stride
        base = row + lane * (run + 1)
        ex = cuda.local.array(per_lane, np.int32)
        for k in range(run):
            hs[base + k] = hist[job, ch, lane * run + k]
            cnt[base + k] = 0
        if lane == 0:
            best[2 * warp] = -1
            best[2 * warp + 1] = -1
        n_checks = checks[job]
        # this block's job reads one source: its own blocks (xa or xb) after its pending ones (rec)
        src = xa if job < ja else xb
        at = job if job < ja else job - ja
        r = r0[job]
        if n_checks > 0:
            for k in range(per_lane):
                i = lane + k * WARP
                ex[k] = exponent(src, at, rec, job, r, i // L.BLOCK_TOKENS, h, i % L.BLOCK_TOKENS, d)
        syncwarp()
        for j in range(n_checks):
            for k in range(per_lane):
                e = ex[k]
                cuda.atomic.add(cnt, row + e + e // run, 1)
            if j + 1 < n_checks:                      # the next check's exponents, in flight meanwhile
                for k in range(per_lane):
                    i = lane + k * WARP
                    ex[k] = exponent(src, at, rec, job, r, (j + 1) * every + i // L.BLOCK_TOKENS, h,
                                     i % L.BLOCK_TOKENS, d)
            syncwarp()
            # decay, then add: each lane its own bins
            for k in range(run):
                v = hs[base + k]
                hs[base + k] = v - (v >> shift) + cnt[base + k]
                cnt[base + k] = 0
            syncwarp()
            # the windows starting at this lane's bins, which end in the next two lanes' bins
            a3 = 0
            for k in range(run):
                a3 += hs[base + k]
            a4 = a3
            if lane + 1 < WARP:
                for k in range(run):
                    a4 += hs[base + run + 1 + k]
            k3 = -1
            k4 = -1
            for k in range(run):
                s = lane * run + k
                if s <= BINS - w3:
                    k3 = max(k3, a3 * BINS + (BINS - 1 - s))
                if s <= BINS - w4:
                    k4 = max(k4, a4 * BINS + (BINS - 1 - s))
                first = hs[base + k]
                a3 += (hs[base + run + 1 + k] if lane + 1 < WARP else 0) - first
                a4 += (hs[base + 2 * (run + 1) + k] if lane + 2 < WARP else 0) - first
            # a window covering nothing loses to any that covers something, and with none covering anything
            # the answer is start 0, which the reset value -1 gives: so only covering windows compete
            if k3 >= BINS:
                cuda.atomic.max(best, 2 * warp, k3)
            if k4 >= BINS:
                cuda.atomic.max(best, 2 * warp + 1, k4)
            syncwarp()
            if lane == 0:
                cand[job, j, 0, ch] = BINS - 1 - (best[2 * warp] & (BINS - 1))
                cand[job, j, 1, ch] = BINS - 1 - (best[2 * warp + 1] & (BINS - 1))
                best[2 * warp] = -1
                best[2 * warp + 1] = -1
        syncwarp()
        for k in range(run):
            hist[job, ch, lane * run + k] = hs[base + k]

    return kernel


@cuda.jit(device=True, inline=True)
def outside(e, b3, b4):
    """Bit 0: exponent ``e`` is outside the 3-bit window from ``b3``; bit 1: outside the 4-bit one from ``b4``
    (a difference is in ``0 .. w - 1`` exactly when its bits above the window's are all zero)."""
    return (1 if (e - b3) & -L.WINDOW_3BIT else 0) | (2 if (e - b4) & -L.WINDOW_4BIT else 0)


@cuda.jit(device=True, inline=True)
def group_bytes(out):
    """Escape bytes of a group whose elements' :func:`outside` bits OR to ``out``: none where all fit the
    3-bit window, one where all fit the 4-bit window, five for a raw group."""
    if out & 1 == 0:
        return COST_3BIT
    if out & 2 == 0:
        return COST_4BIT
    return COST_RAW


@cuda.jit(device=True, inline=True)
def group_saving(src, at, rec, job, r, i, n_groups, j, every, head_dim, c3, c4, n3, n4):
    """Escape bytes that bases (n3, n4) save against bases (c3, c4) on item ``i`` of check ``j``: one group of
    8 channels (``i % n_groups``) of one token (``i // n_groups``), read two elements a load from the int32
    views of the blocks."""
    g = i % n_groups
    tok = i // n_groups
    b = j * every + tok // L.BLOCK_TOKENS
    t = tok % L.BLOCK_TOKENS
    h = (g * L.GROUP_SIZE) // head_dim
    w = ((g * L.GROUP_SIZE) % head_dim) // 2
    out_cur = 0
    out_new = 0
    for u in range(L.GROUP_SIZE // 2):
        word = element(src, at, rec, job, r, b, h, t, w + u)
        c = g * L.GROUP_SIZE + 2 * u
        e = (word >> 7) & 0xFF
        out_cur |= outside(e, c3[c], c4[c])
        out_new |= outside(e, n3[c], n4[c])
        e = (word >> 23) & 0xFF
        out_cur |= outside(e, c3[c + 1], c4[c + 1])
        out_new |= outside(e, n3[c + 1], n4[c + 1])
    return group_bytes(out_cur) - group_bytes(out_new)


@cuda.jit(device=True, inline=True)
def block_sum(part, value):
    """The sum of every thread's ``value`` (returned in thread 0); ``part`` holds one int32 a thread."""
    tid = cuda.threadIdx.x
    nthreads = cuda.blockDim.x
    part[tid] = value
    cuda.syncthreads()
    if tid < WARP:
        s = 0
        k = tid
        while k < nthreads:
            s += part[k]
            k += WARP
        part[tid] = s
    cuda.syncthreads()
    s = 0
    if tid == 0:
        for k in range(min(WARP, nthreads)):
            s += part[k]
    return s


@functools.lru_cache(maxsize=None)
def costs_kernel(every: int):
    """Per job and check, all at once: the escape bytes the check's candidate saves on the check's blocks
    against the epoch current when the batch starts, and whether the two differ at all.  While no check
    of the batch has appended an epoch, these decide the chain's checks without reading the blocks again."""
    tokens = every * L.BLOCK_TOKENS
    group = L.GROUP_SIZE

    @block_jit
    def kernel(xa, xb, ja, rec, r0, checks, cand, cur, kv_heads, head_dim, saved0, differs0):
        job = cuda.blockIdx.x
        j = cuda.blockIdx.y
        if j >= checks[job]:
            return
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        channels = kv_heads * head_dim
        n_groups = channels // group
        c3 = cuda.shared.array(MAX_CHANNELS, np.uint8)
        c4 = cuda.shared.array(MAX_CHANNELS, np.uint8)
        n3 = cuda.shared.array(MAX_CHANNELS, np.uint8)
        n4 = cuda.shared.array(MAX_CHANNELS, np.uint8)
        part = cuda.shared.array(CHAIN_THREADS, np.int32)
        dif = 0
        c = tid
        while c < channels:
            c3[c] = cur[job, 0, c]
            c4[c] = cur[job, 1, c]
            n3[c] = cand[job, j, 0, c]
            n4[c] = cand[job, j, 1, c]
            if n3[c] != c3[c] or n4[c] != c4[c]:
                dif = 1
            c += nthreads
        any_differs = cuda.syncthreads_or(dif)
        src = xa if job < ja else xb
        at = job if job < ja else job - ja
        r = r0[job]
        saved = 0
        if any_differs:
            i = tid
            while i < tokens * n_groups:
                saved += group_saving(src, at, rec, job, r, i, n_groups, j, every, head_dim, c3, c4, n3, n4)
                i += nthreads
        s = block_sum(part, saved)
        if tid == 0:
            saved0[job, j] = s
            differs0[job, j] = 1 if any_differs else 0

    return kernel


@functools.lru_cache(maxsize=None)
def chain_kernel(every: int):
    """Per job, in check order (a check every ``every`` blocks): whether it appends its candidate.

    Until the batch appends an epoch, :func:`costs_kernel`'s answers decide.  After that, a check whose
    candidate equals the current epoch is decided at once; otherwise only the groups of 8 channels in which
    the two differ can save or cost escape bytes, so only those groups of the check's blocks are read (two
    elements a load)."""
    tokens = every * L.BLOCK_TOKENS
    group = L.GROUP_SIZE

    @block_jit
    def kernel(xa, xb, ja, rec, r0, checks, cand, cur, finalized, n_epochs, warmup, max_epochs, payback,
               table_bytes, kv_heads, head_dim, saved0, differs0, accept):
        job = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        channels = kv_heads * head_dim
        n_groups = channels // group                          # groups of channels of one token
        c3 = cuda.shared.array(MAX_CHANNELS, np.uint8)       # the current epoch's bases
        c4 = cuda.shared.array(MAX_CHANNELS, np.uint8)
        n3 = cuda.shared.array(MAX_CHANNELS, np.uint8)       # the check's candidate
        n4 = cuda.shared.array(MAX_CHANNELS, np.uint8)
        differ = cuda.shared.array(MAX_GROUPS, np.uint8)
        part = cuda.shared.array(CHAIN_THREADS, np.int32)
        flag = cuda.shared.array(1, np.int32)
        ch = tid
        while ch < channels:
            c3[ch] = cur[job, 0, ch]
            c4[ch] = cur[job, 1, ch]
            ch += nthreads
        n_ep = n_epochs[job]
        src = xa if job < ja else xb
        at = job if job < ja else job - ja
        r = r0[job]
        cuda.syncthreads()
        first = n_ep
        for j in range(checks[job]):                 # accept is zeros: only appending checks are written
            if finalized[job] + (j + 1) * every < warmup or n_ep >= max_epochs:
                continue
            if n_ep == first:          # still the batch's first epoch: the costs kernel has decided
                if differs0[job, j] and np.int64(saved0[job, j]) * payback >= table_bytes:
                    if tid == 0:
                        accept[job, j] = 1
                    n_ep += 1
                    ch = tid
                    while ch < channels:
                        c3[ch] = cand[job, j, 0, ch]
                        c4[ch] = cand[job, j, 1, ch]
                        ch += nthreads
                    cuda.syncthreads()
                continue
            any_differs = 0
            g = tid
            while g < n_groups:
                dif = 0
                for u in range(group):
                    c = g * group + u
                    x3 = cand[job, j, 0, c]
                    x4 = cand[job, j, 1, c]
                    n3[c] = x3
                    n4[c] = x4
                    if x3 != c3[c] or x4 != c4[c]:
                        dif = 1
                differ[g] = dif
                any_differs |= dif
                g += nthreads
            if cuda.syncthreads_or(any_differs) == 0:
                continue
            # escape bytes saved on the check's blocks: the current epoch's minus the candidate's
            saved = 0
            i = tid
            while i < tokens * n_groups:
                if differ[i % n_groups]:
                    saved += group_saving(src, at, rec, job, r, i, n_groups, j, every, head_dim, c3, c4, n3, n4)
                i += nthreads
            s = block_sum(part, saved)
            if tid == 0:
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


def supported(kv_heads: int, head_dim: int) -> bool:
    """Whether the GPU rule takes blocks of this shape with the rule's current check size (else the host
    rule runs): at most ``MAX_CHANNELS`` channels, whole thread blocks of channels, whole warps of tokens."""
    return (kv_heads * head_dim <= MAX_CHANNELS and head_dim % CHANNELS_PER_BLOCK == 0
            and head_dim % L.GROUP_SIZE == 0 and E.ADAPT_EVERY * L.BLOCK_TOKENS % WARP == 0)


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
        self.cpb = 1 if SIMULATOR else CHANNELS_PER_BLOCK
        if not supported(kv_heads, head_dim):
            raise ValueError(f"kv_heads * head_dim = {channels} (at most {MAX_CHANNELS}), head_dim {head_dim} "
                             f"(a multiple of {CHANNELS_PER_BLOCK}), checks of {E.ADAPT_EVERY} blocks (whole warps "
                             "of tokens): the GPU rule does not take these; the host rule does")
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
                     torch.stack([a.hist_on_device(device).reshape(channels, BINS) for a, _ in jobs]))
        self.m = m = max(1, int(checks.max()))
        self.cand = torch.zeros((n_jobs, m, 2, channels), dtype=torch.uint8, device=device)
        self.accept = torch.zeros((n_jobs, m), dtype=torch.int32, device=device)
        self.saved0 = torch.zeros((n_jobs, m), dtype=torch.int32, device=device)
        self.differs0 = torch.zeros((n_jobs, m), dtype=torch.int32, device=device)
        self.args1 = (xa, xb, ja, rec, r0_d, checks_d, self.hist, self.cand, head_dim)
        words = [x.view(torch.int32) for x in (xa, xb, rec)]      # the chain reads two elements a load
        self.args0 = (words[0], words[1], ja, words[2], r0_d, checks_d, self.cand, cur, kv_heads, head_dim,
                      self.saved0, self.differs0)
        self.args2 = (words[0], words[1], ja, words[2], r0_d, checks_d, self.cand, cur, dev(finalized),
                      dev(n_epochs), E.WARMUP_BLOCKS, E.MAX_EPOCHS, E.PAYBACK_CHECKS,
                      E.epoch_table_bytes(first_adapter.calibration), kv_heads, head_dim, self.saved0,
                      self.differs0, self.accept)

    def _launch(self, kernel, grid, block, args) -> None:
        import torch

        if not self.checks.any():
            return
        if SIMULATOR:
            kernel[grid, block](*(a.numpy() if isinstance(a, torch.Tensor) else a for a in args))
        else:
            kernel[grid, block, cuda.external_stream(torch.cuda.current_stream(self.device).cuda_stream)](*args)

    def candidates(self) -> None:
        """Launch the candidates kernel: every check's windows, and the histograms after the last check."""
        kernel = candidates_kernel(self.cpb, self.every, E.DECAY_SHIFT, CANDIDATE_REGISTERS)
        self._launch(kernel, (len(self.jobs), self.channels // self.cpb), self.cpb * WARP, self.args1)

    def chain(self) -> None:
        """Launch the costs kernel and the chain kernel: which checks append their candidate."""
        threads = 64 if SIMULATOR else CHAIN_THREADS
        self._launch(costs_kernel(self.every), (len(self.jobs), self.m), threads, self.args0)
        self._launch(chain_kernel(self.every), len(self.jobs), threads, self.args2)

    def finish(self) -> list:
        """Wait for the decisions; append the epochs, update the adapters, return each job's block epochs."""
        import torch

        jobs, n, checks, r0, every = self.jobs, self.n, self.checks, self.r0, self.every
        kv_heads, head_dim = self.kv_heads, self.head_dim
        accept_h = self.accept.cpu().numpy()
        picked_all = [np.flatnonzero(accept_h[i, :checks[i]]) for i in range(len(jobs))]
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
            # a copy of its own, so that copying the adapter (the cache plans on a copy) copies 1 MB, not all jobs'
            a.keep_hist_on_device(self.hist[i].view(kv_heads, head_dim, BINS).clone())
            a.finalized += n
            left = int((r0[i] + n) % every)
            if checks[i] == 0:
                a._recent = list(a._recent) + list(blocks.cpu().numpy().view(np.uint16))
            else:
                a._recent = list(blocks[n - left:].cpu().numpy().view(np.uint16)) if left else []
            out[self.order[i]] = epochs
        return out

"""The epoch adaptation rule on the GPU: what :meth:`gaac.epochs.Adapter.assign` decides, for many blocks at once.

A prefill finalizes thousands of blocks per (kind, layer); the rule looks at them a check (16 blocks) at a
time, and on the host each check costs milliseconds.  The rule splits into a part that does not depend on
its own decisions and a short chain that does:

* the exponent histogram and the candidate windows of every check depend only on the blocks, and so does
  what a check's candidate saves against the epoch current when the batch starts: :func:`scan_kernel`
  computes all three, a thread block per group of 8 channels and job (a warp per channel, a lane per 8
  histogram bins), looping over the checks;
* whether a check appends its candidate depends on the epoch current at that check, the last one
  appended.  :func:`phase_kernel` finds the checks that append, one per launch (a **phase**): phase 0 from
  the scan's savings, phase ``p`` by judging, all at once over many thread blocks, every check after the one
  phase ``p - 1`` found against that check's candidate, counting over each check's 16 blocks in the groups of
  channels where candidate and current epoch differ.  A batch that appends ``A`` epochs to a job runs ``A + 1``
  phases; a few are launched with the batch, more only where a job is still appending when the host looks.

A prompt's encodes need not wait for the host to learn the decisions: :meth:`Batch.encode_rows` turns the
phases' results into each block's row of a table of bases (the current epoch's, then every check's candidate),
which the in-place encoder reads on the device (:meth:`gaac.cuda.codec.EncodePlan.in_place_by_rows`).

Both kernels read the blocks where they lie (a strided view of the input; the adapter's pending blocks from a
small array); the adapters' histograms stay on the device until the host rule needs one, and one copy to
the host brings the decisions (another for each further round of phases).  The results are the host rule's, bit for bit (``tests/test_epochs_gpu.py``
and, in the simulator, ``tests/test_epochs_device.py`` compare them).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda

from .. import epochs as E
from .. import layout as L
from ..arrays import stacked_view
from .launch import device_index, driver, launch_args
from .primitives import SIMULATOR, WARP, device, gaddr, i32, ldg4_at, popc, syncwarp, u32, u64

BINS = 256                   # exponent values of a BF16 element
SCAN_REGISTERS = 64          # the scan kernel's register cap: 32 warps an SM, no spills
MAX_CHANNELS = 8192          # kv_heads * head_dim the phase kernel's shared bases hold
MAX_GROUPS = MAX_CHANNELS // L.GROUP_SIZE
PHASE_THREADS = 32 if SIMULATOR else 256    # a phase's thread block: one check judged at a time
PHASE_BLOCKS = 4 if SIMULATOR else 1024     # thread blocks a phase deals its jobs' checks to: ~8 an SM
PHASE_CHECKS = 1 << 30 if SIMULATOR else 4  # checks a phase's thread block judges at most, where more blocks
                                            # than PHASE_BLOCKS are needed for that
PHASES = 4                   # phases launched with a batch (after phase 0); more where a job keeps appending
NONE = 1 << 30               # in the phases' results: no check appends
DEVICE_PACKED = 8            # a batch that appends this many epochs or more gives their encoder bases on the device
COST_3BIT = L.ESCAPE_BYTES[L.MODE_3BIT]
COST_4BIT = L.ESCAPE_BYTES[L.MODE_4BIT]
COST_RAW = L.ESCAPE_BYTES[L.MODE_RAW]


@cuda.jit(device=True, inline=True)
def element(src, at, rec, job, r, b, h, t, x):
    """Entry ``x`` of (head h, token t) of job ``job``'s logical block ``b``: its ``r`` pending blocks first
    (``rec``), then its new blocks (``src[at]``, the job's own source array): a word of the int32 views,
    two BF16 elements."""
    return rec[job, b, h, t, x] if b < r else src[at, b - r, h, t, x]


if SIMULATOR:
    @device
    def channels8(x, i0, i1, i2, i3, d0):
        """Elements ``d0 .. d0 + 7`` of ``x[i0, i1, i2, i3]`` (int16, 16-byte aligned) as four words."""
        w = np.ascontiguousarray(np.asarray(x[i0, i1, i2, i3, d0:d0 + 8])).view(np.uint32)
        return u32(w[0]), u32(w[1]), u32(w[2]), u32(w[3])
else:
    @device
    def channels8(x, i0, i1, i2, i3, d0):
        """Elements ``d0 .. d0 + 7`` of ``x[i0, i1, i2, i3]`` (int16, 16-byte aligned) as four words: one load."""
        s = x.strides
        return ldg4_at(x, gaddr(x, i0 * s[0] + i1 * s[1] + i2 * s[2] + i3 * s[3] + d0 * s[4]))


@functools.lru_cache(maxsize=None)
def scan_kernel(every: int, shift: int, registers: int | None = None):
    """Per job and check, for every check at once: the decayed histogram after the check (decay shift
    ``shift``, a check every ``every`` blocks), the check's best windows per channel, and the escape bytes
    those windows save on the check's blocks against the epoch current when the batch starts.

    A thread block is one group of channels (``GROUP_SIZE`` warps, a warp per channel), so that a group's
    escape bytes, which depend on its channels together, are summed inside it.  The grid is (groups, jobs):
    the groups of one job run side by side, and the 16 groups of a head read the same 256-byte rows of each
    block, each 16 bytes of them, so a row comes from DRAM once and the other groups find it in L2 (with
    the jobs side by side instead, a job's groups run far apart and each fetches its rows again).  Per check:

    * the first ``tokens`` threads load the next check's tokens, a token's 8 channels (16 bytes) each, and
      leave their exponents in shared memory for the warps (loads of one channel by a warp would touch a
      line per lane);
    * each warp counts its channel's exponents (a lane 1/32 of the tokens) into shared counts (bin ``b``
      at ``b + b // 8``, so that the lanes' 8-bin runs fall in distinct banks), decays and adds them to its
      bins (8 a lane, in registers), finds the best 8- and 16-wide windows from its own bins and the next
      two lanes' (two lanes of zeros past bin 255 end the windows that run off the end: such a window never
      covers more than the one starting at ``256 - w``, and ties go to the smaller start), and marks, per
      token, the group's elements outside the current windows and outside the candidate windows: four
      exponents a word at once (:func:`outside_bytes`);
    * after the block's barrier the last warp turns the marks into escape bytes saved (population counts of
      the mark planes), and adds the previous check's sum to ``saved0``.

    A lane's marks are one word: byte ``j`` holds its tokens ``j`` and ``4 + j``, bit ``2 * plane + word`` (the
    planes: outside the current 3-bit window, the current 4-bit one, the candidate's 3-bit one, its 4-bit one).
    Arithmetic is 32-bit wherever the values allow it."""
    tokens = every * L.BLOCK_TOKENS
    per_lane = tokens // WARP                         # exponents a lane counts per check
    run = BINS // WARP                                # bins a lane owns: 8
    skew = run + 1                                    # a lane's run in shared memory, one word of padding
    stride = (WARP + 2) * skew                        # one channel's row: 32 lanes' runs, two lanes of zeros
    group = L.GROUP_SIZE
    threads = group * WARP
    last = group - 1                                  # the warp that sums the marks
    # shared array sizes: compile-time constants
    cells, keys, lanes2, staged = group * stride, 4 * group, 2 * WARP, (2, group, tokens)
    # numba widens int32 arithmetic to 64 bits: every result is cast back (two instructions become one),
    # and indices are unsigned (no negative-index wrap-around)
    RUN, SKEW, SHIFT, BINS_, TOP = i32(run), i32(skew), i32(shift), i32(BINS), i32(BINS - 1)
    ZERO, ONE, TWO, MINUS = i32(0), i32(1), i32(2), i32(-1)
    EXTRA4, EXTRAR, PLANE = i32(COST_4BIT - COST_3BIT), i32(COST_RAW - COST_3BIT), i32(0x03030303)
    words = -(-per_lane // 4)                         # a lane's exponents, four a word
    last_bytes = per_lane - 4 * (words - 1)           # tokens in its last word
    assert per_lane <= 8 and tokens <= threads, "a lane packs its tokens' marks, 4 bits each, into one word"
    jit = cuda.jit if SIMULATOR or registers is None else cuda.jit(max_registers=registers)

    @device
    def saved_bytes(w):
        """Escape bytes the candidate windows save over the current ones on a lane's tokens, whose group marks
        are ``w`` (a plane in each byte's bits ``2 * plane`` and ``2 * plane + 1``: outside the current 3- and
        4-bit windows, then the candidate's).  A group costs the 3-bit mode's escape bytes, plus the 4-bit
        mode's extra where it leaves the 3-bit window, or the raw mode's extra where it leaves both: so the sum
        is population counts of the mark planes."""
        o3c = i32(w & PLANE)
        o4c = i32(i32(w >> TWO) & PLANE)
        o3n = i32(i32(w >> i32(4)) & PLANE)
        o4n = i32(i32(w >> i32(6)) & PLANE)
        wide = i32(popc(i32(o3c & i32(~o4c))) - popc(i32(o3n & i32(~o4n))))
        raw = i32(popc(i32(o3c & o4c)) - popc(i32(o3n & o4n)))
        return i32(i32(wide * EXTRA4) + i32(raw * EXTRAR))

    @device
    def publish(acc, flag, q, differs0, saved0, job, check):
        """Check ``check``'s result, complete in ``acc[q]`` and ``flag[q]``: whether the candidate differs from the
        current windows, and the escape bytes it saves (added: other groups of channels add theirs)."""
        if flag[q]:
            differs0[job, check] = 1
            if acc[q] != 0:
                cuda.atomic.add(saved0, (job, check), acc[q])

    @device
    def stage(ex, p, tt, xw0, xw1, xw2, xw3):
        """Token ``tt``'s exponents of the group's 8 channels (its four words) into ``ex[p, :, tt]``."""
        ex[p, 0, tt] = (xw0 >> u32(7)) & u32(0xFF)
        ex[p, 1, tt] = (xw0 >> u32(23)) & u32(0xFF)
        ex[p, 2, tt] = (xw1 >> u32(7)) & u32(0xFF)
        ex[p, 3, tt] = (xw1 >> u32(23)) & u32(0xFF)
        ex[p, 4, tt] = (xw2 >> u32(7)) & u32(0xFF)
        ex[p, 5, tt] = (xw2 >> u32(23)) & u32(0xFF)
        ex[p, 6, tt] = (xw3 >> u32(7)) & u32(0xFF)
        ex[p, 7, tt] = (xw3 >> u32(23)) & u32(0xFF)

    @device
    def token(xa, xb, ja, rec, job, r, lb, h, t, d0):
        """Token ``t`` of job ``job``'s logical block ``lb``, channels ``d0 .. d0 + 7`` of head ``h`` (four
        words): its ``r`` pending blocks (``rec``) first, then its own blocks (``xa``, or ``xb`` past ``ja``)."""
        if lb < r:
            return channels8(rec, job, u32(lb), h, t, d0)
        if job < ja:
            return channels8(xa, job, u32(lb - r), h, t, d0)
        return channels8(xb, job - ja, u32(lb - r), h, t, d0)

    @jit
    def kernel(xa, xb, ja, rec, r0, checks, hist, cand, cur, head_dim, saved0, differs0):
        job = cuda.blockIdx.y
        tid = i32(cuda.threadIdx.x)
        warp = i32(tid // i32(WARP))
        lane = i32(tid % i32(WARP))
        ch = i32(i32(cuda.blockIdx.x) * i32(group) + warp)
        h = u32(ch // i32(head_dim))
        d0 = u32(i32(i32(cuda.blockIdx.x) * i32(group)) % i32(head_dim))   # the group's first channel
        cnt = cuda.shared.array(cells, np.int32)      # this check's counts
        hs = cuda.shared.array(cells, np.int32)       # the decayed histogram, for the neighbours' windows
        best = cuda.shared.array(keys, np.int32)      # [warp][check parity][3-bit, 4-bit]: the best window keys
        mark = cuda.shared.array(lanes2, np.int32)    # [check parity][lane]: the group's marks, 4 bits a token
        acc = cuda.shared.array(3, np.int32)          # [check mod 3]: the group's escape bytes saved
        flag = cuda.shared.array(3, np.int32)         # [check mod 3]: a channel's windows differ from the current
        ex = cuda.shared.array(staged, np.uint8)      # [check parity][channel][token]: the exponents
        hb = cuda.local.array(run, np.int32)          # this lane's bins
        ev = cuda.local.array(per_lane, np.int32)     # this check's exponents of this lane's tokens
        row = i32(warp * i32(stride))
        base = i32(row + i32(lane * SKEW))
        for k in range(run):
            hb[k] = hist[job, u32(ch), u32(i32(lane * RUN) + i32(k))]
            cnt[base + k] = ZERO
            if lane < 2:                              # the two lanes of zeros past bin 255
                hs[i32(row + i32(i32(i32(WARP) + lane) * SKEW) + i32(k))] = ZERO
        if lane < 4:
            best[i32(warp * i32(4) + lane)] = MINUS
        if tid < 2 * WARP:
            mark[tid] = ZERO
        if tid < 3:
            acc[tid] = ZERO
            flag[tid] = ZERO
        c3 = i32(cur[job, 0, u32(ch)])
        c4 = i32(cur[job, 1, u32(ch)])
        # the current windows hold for the whole batch: their bases in every byte, split as outside_bytes takes them
        cl3, ch3 = lows_highs(c3)
        cl4, ch4 = lows_highs(c4)
        n_checks = i32(checks[job])
        r = i32(r0[job])
        loader = tid < tokens                         # the thread that loads token tid of each check
        tt = u32(tid)
        t = u32(tid % i32(L.BLOCK_TOKENS))
        b0 = i32(tid // i32(L.BLOCK_TOKENS))
        xw0 = xw1 = xw2 = xw3 = u32(0)
        if loader and n_checks > 0:
            xw0, xw1, xw2, xw3 = token(xa, xb, ja, rec, job, r, b0, h, t, d0)
            stage(ex, 0, tt, xw0, xw1, xw2, xw3)
        cuda.syncthreads()
        q = ZERO                                      # j % 3
        # shared-memory indices are unsigned 64-bit: no negative-index wrap-around, and constant offsets
        # fold into the instructions' immediates
        baseu, warpu = u64(base), u64(warp)
        row32 = u32(u32(u32(cuda.threadIdx.x) // u32(WARP)) * u32(stride))
        nextu, next2u = u64(base + SKEW), u64(base + i32(2) * SKEW)
        for j in range(n_checks):
            j = i32(j)
            p = i32(j & ONE)
            pu = u64(p)
            q1 = i32(q - ONE) if q > ZERO else TWO    # (j - 1) % 3
            more = j + ONE < n_checks
            if loader and more:                       # the next check's token, in flight meanwhile
                xw0, xw1, xw2, xw3 = token(xa, xb, ja, rec, job, r, i32(i32(i32(j + ONE) * i32(every)) + b0), h, t, d0)
            for k in range(per_lane):
                e = u32(ex[pu, warpu, u64(lane + WARP * k)])
                ev[k] = i32(e)
                cuda.atomic.add(cnt, u32(row32 + u32(e + (e >> u32(3)))), ONE)   # unsigned: no wrap-around
            syncwarp()
            # decay, then add: each lane its own bins
            a3 = ZERO
            for k in range(run):
                v = hb[k]
                v = i32(i32(v - i32(v >> SHIFT)) + cnt[baseu + u64(k)])
                cnt[baseu + u64(k)] = ZERO
                hb[k] = v
                hs[baseu + u64(k)] = v
                a3 = i32(a3 + v)
            syncwarp()
            # the windows starting at this lane's bins, which end in the next two lanes' bins
            a4 = a3
            for k in range(run):
                a4 = i32(a4 + hs[nextu + u64(k)])
            k3 = MINUS
            k4 = MINUS
            for k in range(run):
                s = i32(TOP - i32(i32(lane * RUN) + i32(k)))    # a smaller start wins a tie
                k3 = max(k3, i32(i32(a3 * BINS_) + s))
                k4 = max(k4, i32(i32(a4 * BINS_) + s))
                first = hb[k]
                a3 = i32(a3 + i32(hs[nextu + u64(k)] - first))
                a4 = i32(a4 + i32(hs[next2u + u64(k)] - first))
            at3 = i32(i32(warp * i32(4)) + i32(p * TWO))
            cuda.atomic.max(best, at3, k3)
            cuda.atomic.max(best, at3 + 1, k4)
            syncwarp()
            n3 = i32(TOP - i32(best[at3] & TOP))
            n4 = i32(TOP - i32(best[at3 + 1] & TOP))
            if lane == 0:
                cand[job, u32(j), 0, u32(ch)] = n3
                cand[job, u32(j), 1, u32(ch)] = n4
                other = i32(i32(warp * i32(4)) + i32(i32(ONE - p) * TWO))
                best[other] = MINUS                   # the other parity's keys, read by every lane at j - 1
                best[other + 1] = MINUS
                if n3 != c3 or n4 != c4:
                    flag[q] = ONE
            # the group's marks: per token, which elements fall outside the current and the candidate windows
            nl3, nh3 = lows_highs(n3)
            nl4, nh4 = lows_highs(n4)
            m = u32(0)
            for wi in range(words):
                n = 4 if wi + 1 < words else last_bytes
                w = bytes_word(ev, 4 * wi, n)
                m = u32(m | u32(word_marks(w, wi, cl3, ch3, cl4, ch4, nl3, nh3, nl4, nh4)
                                & u32(0xFFFFFFFF >> (8 * (4 - n)))))
            cuda.atomic.or_(mark, i32(i32(p * i32(WARP)) + lane), i32(m))
            if loader and more:
                stage(ex, ONE - p, tt, xw0, xw1, xw2, xw3)
            cuda.syncthreads()
            if warp == last:
                if lane == 0 and j > 0:               # check j - 1's sum, complete since this barrier
                    publish(acc, flag, q1, differs0, saved0, job, u32(j - ONE))
                    acc[q1] = ZERO
                    flag[q1] = ZERO
                w = mark[i32(i32(p * i32(WARP)) + lane)]
                mark[i32(i32(p * i32(WARP)) + lane)] = ZERO
                saved = saved_bytes(w)
                if saved != 0:
                    cuda.atomic.add(acc, q, saved)
            q = i32(q + ONE) if q < TWO else ZERO
        cuda.syncthreads()
        if tid == 0 and n_checks > 0:
            q = i32(q - ONE) if q > ZERO else TWO     # (n_checks - 1) % 3
            publish(acc, flag, q, differs0, saved0, job, u32(n_checks - ONE))
        for k in range(run):
            hist[job, u32(ch), u32(i32(lane * RUN) + i32(k))] = hb[k]

    return kernel


HIGH = u32(0x80808080)       # each byte's top bit
LOWS = u32(0x7F7F7F7F)       # each byte's other bits
BYTES = 0x01010101           # a byte's value in every byte of a word


@device
def lows_highs(b):
    """Base ``b`` (0 .. 255) in every byte of a word, as :func:`outside_bytes` takes it: the bytes' low 7 bits,
    and the top bits of ``~b``."""
    x = u32(u32(b) * u32(BYTES))
    return u32(x & LOWS), u32(u32(~x) & HIGH)


@device
def outside_bytes(wh, wm, bl, bh, top):
    """Of four exponents, one a byte of ``w`` (``wh = w | HIGH``, ``wm = w & HIGH``), those outside the window
    of ``0x80 - top / BYTES`` exponents from base ``b`` (``bl, bh = lows_highs(b)``): top bit of each byte set.
    The byte-wise difference ``(e - b) mod 256`` (the top bits made so that no byte borrows from the next,
    then put right), then whether any bit of the difference above the window's is set.  Modulo 256 is exact
    here: a base leaves its window inside 0 .. 255 (FORMAT.md 3.2), so ``e - b`` is never ``d - 256`` with
    ``d`` inside the window."""
    d = u32(u32(u32(wh - bl) ^ wm) ^ bh)
    return u32(u32(u32(u32(d & top) + LOWS) | d) & HIGH)


TOP3 = u32(BYTES * (0x80 - L.WINDOW_3BIT))      # the bits above the 3-bit window, in every byte
TOP4 = u32(BYTES * (0x80 - L.WINDOW_4BIT))


@device
def word_marks(w, wi, cl3, ch3, cl4, ch4, nl3, nh3, nl4, nh4):
    """The marks of the four exponents of word ``w`` (one a byte), the ``wi``-th word of a lane's: for each byte, the
    planes outside the current 3- and 4-bit windows (``cl3, ch3``, ``cl4, ch4`` from :func:`lows_highs`), then
    the candidate's (``nl3, nh3``, ``nl4, nh4``), plane ``p`` at bit ``2 * p + wi`` of the byte."""
    wh, wm = u32(w | HIGH), u32(w & HIGH)
    o3c = outside_bytes(wh, wm, cl3, ch3, TOP3)
    o4c = outside_bytes(wh, wm, cl4, ch4, TOP4)
    o3n = outside_bytes(wh, wm, nl3, nh3, TOP3)
    o4n = outside_bytes(wh, wm, nl4, nh4, TOP4)
    return u32(u32(u32(o3c >> u32(7 - wi)) | u32(o4c >> u32(5 - wi)))
               | u32(u32(o3n >> u32(3 - wi)) | u32(o4n >> u32(1 - wi))))


@device
def bytes_word(ev, start, n):
    """Exponents ``ev[start .. start + n - 1]`` (``n <= 4``) as the bytes of one word, the first lowest."""
    w = u32(0)
    for y in range(n):
        w = u32(w | u32(u32(ev[start + y]) << u32(8 * y)))
    return w


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
def group_saving(src, at, rec, job, r, g, tok, j, every, head_dim, c3, c4, n3, n4):
    """Escape bytes that bases (n3, n4) save against bases (c3, c4) on one group of 8 channels (``g``) of one
    token (``tok``) of check ``j``, read two elements a load from the int32 views of the blocks."""
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
def phase_kernel(every: int):
    """Phase ``p`` of the chain (a check every ``every`` blocks): per job, the ``p``-th check of the batch that
    appends its candidate, into ``nxt[p, job]`` (:data:`NONE` where no check does).

    Phase 0 reads :func:`scan_kernel`'s savings against the batch's first epoch.  Phase ``p > 0`` starts from
    the check phase ``p - 1`` found, ``a = nxt[p - 1, job]``, whose candidate is then the current epoch, and
    judges every later check against it at once: a job's checks are dealt out to ``gridDim.y`` thread
    blocks, each taking its checks in order; a check whose candidate equals the current epoch saves nothing;
    otherwise only the groups of 8 channels in which the two differ can save or cost escape bytes, so only
    those groups of the check's blocks are read.  The first check that saves enough is the phase's: an
    atomic minimum, and a block stops at a check past the one found so far (the minimum only shrinks).
    The host rule's decisions, in as many launches as epochs appended, instead of one thread block walking
    every check in turn."""
    tokens = every * L.BLOCK_TOKENS
    group = L.GROUP_SIZE

    @cuda.jit
    def kernel(xa, xb, ja, rec, r0, checks, cand, finalized, n_epochs, warmup, max_epochs, payback, table_bytes,
               kv_heads, head_dim, saved0, differs0, nxt, p):
        job = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        nthreads = cuda.blockDim.x
        blocks = cuda.gridDim.y
        n_checks = checks[job]
        if n_epochs[job] + p >= max_epochs:         # the cap: nothing more is appended
            return
        if p == 0:                                  # against the batch's first epoch: the scan has decided
            j = cuda.blockIdx.y * nthreads + tid
            while j < n_checks:
                if (finalized[job] + (j + 1) * every >= warmup and differs0[job, j] != 0
                        and np.int64(saved0[job, j]) * payback >= table_bytes):
                    cuda.atomic.min(nxt, (0, job), j)
                    break
                j += blocks * nthreads
            return
        a = nxt[p - 1, job]
        if a >= n_checks - 1:                       # no epoch appended by the last phase, or no check after it
            return
        channels = kv_heads * head_dim
        n_groups = channels // group
        c3 = cuda.shared.array(MAX_CHANNELS, np.uint8)       # the current epoch's bases: check a's candidate
        c4 = cuda.shared.array(MAX_CHANNELS, np.uint8)
        n3 = cuda.shared.array(MAX_CHANNELS, np.uint8)       # the check's candidate
        n4 = cuda.shared.array(MAX_CHANNELS, np.uint8)
        diffs = cuda.shared.array(MAX_GROUPS, np.int32)      # the groups in which the two differ
        part = cuda.shared.array(PHASE_THREADS, np.int32)
        state = cuda.shared.array(3, np.int32)               # [past the check found, groups that differ, appends]
        ch = tid
        while ch < channels:
            c3[ch] = cand[job, a, 0, ch]
            c4[ch] = cand[job, a, 1, ch]
            ch += nthreads
        src = xa if job < ja else xb
        at = job if job < ja else job - ja
        r = r0[job]
        j = a + 1 + cuda.blockIdx.y
        while j < n_checks:
            if tid == 0:
                # an atomic read: the minimum other blocks have written so far, not a cached copy
                state[0] = 1 if cuda.atomic.add(nxt, (p, job), 0) < j else 0
                state[1] = 0
            ch = tid
            while ch < channels:
                n3[ch] = cand[job, j, 0, ch]
                n4[ch] = cand[job, j, 1, ch]
                ch += nthreads
            cuda.syncthreads()
            if state[0] != 0:
                break
            g = tid
            while g < n_groups:
                for u in range(group):
                    c = g * group + u
                    if n3[c] != c3[c] or n4[c] != c4[c]:
                        diffs[cuda.atomic.add(state, 1, 1)] = g
                        break
                g += nthreads
            cuda.syncthreads()
            nd = state[1]
            if nd != 0:
                # escape bytes saved on the check's blocks: the current epoch's minus the candidate's (a sum of
                # integers: the order the groups were listed in does not matter)
                saved = 0
                i = tid
                while i < tokens * nd:
                    saved += group_saving(src, at, rec, job, r, diffs[i % nd], i // nd, j, every, head_dim,
                                          c3, c4, n3, n4)
                    i += nthreads
                s = block_sum(part, saved)
                if tid == 0:
                    state[2] = 1 if np.int64(s) * payback >= table_bytes else 0
                cuda.syncthreads()
                if state[2] != 0:
                    if tid == 0:
                        cuda.atomic.min(nxt, (p, job), j)
                    break
            cuda.syncthreads()                      # every thread is done with the state and the candidate
            j += blocks

    return kernel


def supported(kv_heads: int, head_dim: int) -> bool:
    """Whether the GPU rule takes blocks of this shape with the rule's current check size (else the host
    rule runs): at most ``MAX_CHANNELS`` channels, whole thread blocks of channels, whole warps of tokens."""
    return (kv_heads * head_dim <= MAX_CHANNELS and head_dim % L.GROUP_SIZE == 0
            and E.ADAPT_EVERY * L.BLOCK_TOKENS % WARP == 0 and E.ADAPT_EVERY * L.BLOCK_TOKENS <= 8 * WARP)


def _stacked(tensors: list):
    """``tensors`` (equal shapes and strides) as one tensor with a leading axis: a view of their common
    storage where they lie at equal distances (a prefill's layers), else a copy."""
    import torch

    view = stacked_view(tensors)
    return view if view is not None else torch.stack(tensors)


def _aligned(x):
    """``x`` (int16 blocks, any strides) where every run of 8 channels starts on 16 bytes, as the scan
    kernel loads them: ``x`` itself where it does, else a contiguous copy."""
    import torch

    size = x.element_size()
    if (x.stride(-1) == 1 and x.data_ptr() % 16 == 0
            and all(st * size % 16 == 0 for st, n in zip(x.stride()[:-1], x.shape[:-1]) if n > 1)):
        return x
    return x.clone(memory_format=torch.contiguous_format)


_STAGING = {}        # device index -> [(pinned int32 host buffer, event of the last copy out of it)], oldest first
_STAGING_BUFFERS = 4     # pinned buffers kept per device: a batch takes one whose last copy is done
_ALIGN_WORDS = 64    # int32 words: where each part of a batch's zeroed allocation starts (256 bytes)


def _staged(a: np.ndarray, device):
    """Int32 host array ``a`` in a tensor on ``device``: :func:`_upload` on a GPU, ``a`` itself on the CPU."""
    import torch

    return _upload(a, device) if device.type == "cuda" else torch.from_numpy(a)


def _upload(a: np.ndarray, device):
    """Int32 host array ``a`` in a new tensor on ``device`` (a CUDA device), copied on the current stream
    without the host waiting for the device: through pinned buffers kept per device and grown as needed
    (pinning a new host buffer of half a megabyte takes a millisecond or more).  A buffer is reused once its
    last copy is done; where none is (a batch launched behind queued steps, whose copy has not run yet), a
    new one is pinned rather than waiting for the steps, up to :data:`_STAGING_BUFFERS`, after which the
    oldest is waited for."""
    import torch

    kept = _STAGING.setdefault(device_index(device), [])
    free = next((i for i, (_, event) in enumerate(kept) if event.query()), None)
    if free is None and len(kept) >= _STAGING_BUFFERS:
        free = 0
        kept[0][1].synchronize()
    host = kept.pop(free)[0] if free is not None else None
    if host is None or host.numel() < a.size:
        host = torch.empty(max(a.size, 2 * (0 if host is None else host.numel())), dtype=torch.int32, pin_memory=True)
    host[:a.size].numpy()[:] = a
    out = torch.empty(a.size, dtype=torch.int32, device=device)
    out.copy_(host[:a.size], non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    kept.append((host, event))
    return out


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
    batch.scan()
    batch.chain()
    return batch.finish()


class Batch:
    """One :func:`assign`, in its three stages (so that a benchmark can time each): the scan kernel,
    the chain (the first phases, :meth:`chain`), and :meth:`finish`, which waits for the decisions, runs
    the further phases a job still appending needs, and applies the decisions to the adapters.

    ``stream`` (a torch CUDA stream; None: the current one): where the batch's copies and kernels run.  It
    first waits for the current stream (which wrote the blocks), so that the rule runs beside the work the
    caller queues next (the cache's encodes); :meth:`finish` makes the current stream wait for it again.

    ``decide=False``: the checks append nothing (:meth:`gaac.epochs.Adapter.assign`): the scan brings the
    histograms up to date, no phase runs, and :meth:`finish` reads nothing back from the device."""

    def __init__(self, jobs: list, stream=None, decide: bool = True):
        import torch

        self.decide = decide
        self.stream = stream if stream is not None and jobs[0][1].device.type == "cuda" else None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(jobs[0][1].device))
        with self._on_stream():
            self._setup(jobs)

    def _on_stream(self):
        import contextlib

        import torch

        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _setup(self, jobs: list) -> None:
        import torch

        # K jobs first, then V: each kind's blocks are one strided view where a prefill's layers allow
        self.order = sorted(range(len(jobs)), key=lambda i: jobs[i][0].kind)
        self.jobs = jobs = [jobs[i] for i in self.order]
        first_adapter, first = jobs[0]
        n, kv_heads, _, head_dim = first.shape
        channels = kv_heads * head_dim
        if not supported(kv_heads, head_dim):
            raise ValueError(f"kv_heads * head_dim = {channels} (at most {MAX_CHANNELS}), head_dim {head_dim} "
                             f"(a multiple of {L.GROUP_SIZE}), checks of {E.ADAPT_EVERY} blocks (whole warps "
                             "of tokens, at most 8 a lane): the GPU rule does not take these; the host rule does")
        if any(b.shape != first.shape for _, b in jobs):
            raise ValueError("every job's blocks must have the same shape")
        self.n, self.kv_heads, self.head_dim, self.channels = n, kv_heads, head_dim, channels
        self.device = device = first.device
        n_jobs = len(jobs)
        ja = sum(1 for a, _ in jobs if a.kind == jobs[0][0].kind)
        self.r0 = r0 = np.array([len(a._recent) for a, _ in jobs], dtype=np.int32)
        self.every = every = E.ADAPT_EVERY
        self.checks = checks = (r0 + n) // every
        rec_shape = (n_jobs, max(1, int(r0.max())), kv_heads, L.BLOCK_TOKENS, head_dim)
        fresh = all(a.finalized == 0 for a, _ in jobs)           # a new cache's prefill: empty histograms
        self.epoch0 = [a.epoch for a, _ in jobs]                  # each job's epoch when the batch starts
        cur_np = np.empty((n_jobs, 2, channels), dtype=np.int32)
        for i, ((a, _), epoch) in enumerate(zip(jobs, self.epoch0)):
            b3, b4 = a.calibration.bases(a.layer, a.kind, epoch)
            cur_np[i, 0], cur_np[i, 1] = np.asarray(b3).reshape(-1), np.asarray(b4).reshape(-1)
        self.rows_phases = None                                   # the phases encode_rows read (None: not made)
        finalized = np.array([a.finalized - len(a._recent) for a, _ in jobs], dtype=np.int32)
        n_epochs = np.array(self.epoch0, dtype=np.int32) + 1
        xa = _aligned(_stacked([b for _, b in jobs[:ja]]))
        xb = _aligned(_stacked([b for _, b in jobs[ja:]])) if ja < n_jobs else xa

        # the adapters' blocks not yet checked (none in a new cache's prefill): gathered on the device where
        # every adapter kept a copy there (a decode loop's blocks and a batch's leftovers), else copied from
        # the host with the small int32 inputs, in one copy through a pinned buffer kept for the device (the
        # blocks first, so that they start on the allocation's alignment as the scan kernel's 16-byte loads need)
        runs = [a.recent_on(device) if len(a._recent) else [] for a, _ in jobs] if r0.any() else []
        on_device = bool(runs) and all(r is not None for r in runs)
        rec_np = np.zeros(rec_shape if r0.any() and not on_device else (0,), dtype=np.int16)
        if len(rec_np):
            # every job's blocks that stay on the device in one copy to the host (one wait, not one a job)
            values = E.host_values([b for a, _ in jobs for b in a._recent]).view(np.int16)
            for i, (start, n) in enumerate(zip(np.cumsum(r0) - r0, r0)):
                rec_np[i, :n] = values[start:start + n]
        self.m = m = max(1, int(checks.max()))
        # nxt[p, job]: the check that appends the job's p-th epoch of the batch (NONE: none); a phase a row.
        # It starts as NONE everywhere and comes with the small inputs.
        nxt = np.full((E.MAX_EPOCHS + 1, n_jobs), NONE, dtype=np.int32)
        # the histograms of adapters whose rule last ran on the host come in the same copy
        held = [None if fresh else a.hist_if_on(device) for a, _ in jobs]
        host_hists = np.stack([a.hist.astype(np.int32).reshape(channels, BINS) for (a, _), h in zip(jobs, held)
                               if h is None]) if not fresh and any(h is None for h in held) else np.zeros(0, np.int32)
        small = [rec_np.view(np.int32), cur_np, r0, checks.astype(np.int32), finalized, n_epochs, nxt, host_hists]
        flat = np.concatenate([a.reshape(-1) for a in small])
        staged = _staged(flat, device)
        ends = np.cumsum([a.size for a in small])
        rec32, cur, self.r0_d, checks_d, finalized_d, n_epochs_d, self.nxt, uploaded = (
            staged[e - a.size:e].view(a.shape) for a, e in zip(small, ends))
        # what starts at zero, in one allocation: the scan's savings and flags per check (saved0, differs0),
        # each check's candidate bases (cand, from an ALIGN-word boundary), the blocks not yet checked where
        # there are none or they are gathered on the device, a new cache's histograms, and the zeros that pad
        # each job's gathered blocks to the longest run
        block_words = int(np.prod(rec_shape[2:])) // 2
        pad_blocks = rec_shape[1] - int(r0.min()) if on_device else 0
        sizes = [n_jobs * m, n_jobs * m, n_jobs * m * 2 * channels // 4,
                 0 if r0.any() and not on_device else int(np.prod(rec_shape)) // 2,
                 n_jobs * channels * BINS if fresh else 0, pad_blocks * block_words]
        starts = np.concatenate([[0], np.cumsum([-(-n // _ALIGN_WORDS) * _ALIGN_WORDS for n in sizes])])
        zeros = torch.zeros(max(1, int(starts[-1])), dtype=torch.int32, device=device)
        part = [zeros[int(a):int(a) + n] for a, n in zip(starts, sizes)]
        self.saved0, self.differs0 = part[0].view(n_jobs, m), part[1].view(n_jobs, m)
        self.cand = part[2].view(torch.uint8).view(n_jobs, m, 2, channels)
        if r0.any() and not on_device:
            rec = rec32.view(torch.int16).view(rec_shape)
        else:
            rec = part[3].view(torch.int16).view(rec_shape)
        if on_device:       # each job's runs, then zeros up to the longest: one copy on the device
            pad = part[5].view(torch.int16).view(pad_blocks, *rec_shape[2:])
            pieces = []
            for i, job_runs in enumerate(runs):
                pieces += [r if r.dtype == torch.int16 else r.view(torch.int16) for r in job_runs]
                short = rec_shape[1] - int(r0[i])
                if short:
                    pieces.append(pad[:short])
            torch.cat(pieces, out=rec.view(-1, *rec_shape[2:]))
        if fresh:
            self.hist = part[4].view(n_jobs, channels, BINS)
        else:
            up = iter(uploaded)
            self.hist = torch.stack([h.reshape(channels, BINS) if h is not None else next(up) for h in held])
        self.launched = 0                                         # phases launched
        self.own_hist = None                                      # each job's histograms, copied (copy_hists)
        self._check_of = {}                                       # blocks pending -> each block's check
        self.scan_args = (xa, xb, ja, rec, self.r0_d, checks_d, self.hist, self.cand, cur, head_dim, self.saved0,
                      self.differs0)
        words = [x.view(torch.int32) for x in (xa, xb, rec)]      # the phases read two elements a load
        self.phase_args = (words[0], words[1], ja, words[2], self.r0_d, checks_d, self.cand, finalized_d, n_epochs_d,
                           E.WARMUP_BLOCKS, E.MAX_EPOCHS, E.PAYBACK_CHECKS,
                           E.epoch_table_bytes(first_adapter.calibration), kv_heads, head_dim, self.saved0,
                           self.differs0, self.nxt)

    def _launch(self, kernel, grid, block, args) -> None:
        import torch

        if not self.checks.any():
            return
        if SIMULATOR:
            # (the simulator moves whole buffers: a strided view of the blocks, which the kernels only
            # read, goes as a contiguous copy)
            kernel[grid, block](*((a.numpy() if a.is_contiguous() else np.ascontiguousarray(a.numpy()))
                                  if isinstance(a, torch.Tensor) else a for a in args))
        else:
            stream = self.stream if self.stream is not None else torch.cuda.current_stream(self.device)
            if driver() is not None:
                # one compile for a prefill's strided views and a decode loop's contiguous blocks
                launch_args(kernel, grid, block, args, stream.cuda_stream, any_layout=True)
            else:
                kernel[grid, block, cuda.external_stream(stream.cuda_stream)](*args)

    def scan(self) -> None:
        """Launch the scan kernel: every check's windows and what they save, and the histograms after the
        last check."""
        kernel = scan_kernel(self.every, E.DECAY_SHIFT, SCAN_REGISTERS)
        self._launch(kernel, self.scan_grid, L.GROUP_SIZE * WARP, self.scan_args)

    @property
    def scan_grid(self) -> tuple:
        """The scan kernel's grid: (groups of channels, jobs), a job's groups side by side (:func:`scan_kernel`)."""
        return self.channels // L.GROUP_SIZE, len(self.jobs)

    def copy_hists(self) -> list:
        """Each job's histograms in an allocation of its own, which its adapter keeps (so that copying an adapter,
        as the cache plans on copies, copies 1 MB, not every job's), copied on the batch's stream once, after
        :meth:`scan` (only the scan writes the histograms) and before :meth:`finish` has the current stream wait
        for that stream: by :meth:`finish`, or earlier where the caller calls this right after launching the
        batch, as a prompt does, so that the host makes the copies while the GPU scans rather than after the
        decisions."""
        if self.own_hist is None:
            with self._on_stream():
                self.own_hist = [h.view(self.kv_heads, self.head_dim, BINS).clone() for h in self.hist]
        return self.own_hist

    def chain(self) -> None:
        """Launch the first phases of the chain (:func:`phase_kernel`): which checks append their candidate.
        A job appends at most one epoch a check, so no more phases than checks are launched; none where the
        batch does not decide."""
        if not self.decide:
            return
        self._phases(min(PHASES + 1, self.m))

    def _phases(self, count: int) -> None:
        """Launch the next ``count`` phases (at most one a row of :attr:`nxt`)."""
        kernel = phase_kernel(self.every)
        # A phase takes as long as its slowest job's thread block, which judges its checks in turn: a phase
        # after the first appends, where only the jobs still appending work, would otherwise leave most of
        # the GPU idle while a few blocks walk every later check of a long prompt.
        blocks = max(1, min(self.m, max(PHASE_BLOCKS // len(self.jobs), -(-self.m // PHASE_CHECKS))))
        for p in range(self.launched, min(self.launched + count, self.nxt.shape[0])):
            self._launch(kernel, (len(self.jobs), blocks), PHASE_THREADS, self.phase_args + (p,))
            self.launched = p + 1

    def encode_rows(self, current: list) -> list:
        """After :meth:`chain`, per job (in the order given), what an encode needs to code each of the job's
        blocks with the epoch the rule decides for it, read on the device before the decisions reach the host
        (:meth:`gaac.cuda.codec.EncodePlan.in_place_by_rows`): ``(table, rows)``, the table int16
        ``[(1 + m) * P, 2, C]`` of the job's current bases (``current``, per job as given, packed ``[P, 2, C]``)
        and then every check's candidate, packed as :meth:`new_bases` packs them; ``rows`` int32 ``[n]``, each
        block's set of bases in it (0: the current epoch; ``1 + c``: the candidate that check ``c`` appends, the
        last one before the block's check).  Made from the phases launched so far: where a job appends in its
        last one and more checks follow, a later phase may append again, and :meth:`rows_epochs` then differs
        from the decisions for it.  The current stream waits for the rule (the encodes read its results).  The
        tables live until the decisions are taken: ``4 * channels`` bytes a check and job (134 MB for a 128K-token
        prompt of 32 layers of 8 x 128, beside its 17 GB of input)."""
        import torch

        jobs, n, m = self.jobs, self.n, self.m
        c = L.tile_channels(self.head_dim)
        p = self.channels // c
        with self._on_stream():
            nxt = self.nxt[:self.launched].t()                  # [jobs, phases]: the checks each appends at
            check = (self.r0_d[:, None] + torch.arange(n, dtype=torch.int32, device=self.device)[None]) // self.every
            before = (nxt[:, :, None] < check[:, None, :]).sum(1)   # per block: the epochs appended before it
            rows = torch.where(before > 0, nxt.gather(1, (before - 1).clamp(min=0)) + 1, 0).to(torch.int32)
            cand = self.cand.view(len(jobs), m, 2, p, c).transpose(2, 3)
            table = torch.empty((len(jobs), 1 + m, p, 2, c), dtype=torch.int16, device=self.device)
            table[:, 1:].copy_(cand)
            table[:, 0].copy_(torch.stack([current[i] for i in self.order]))
        self.rows_phases = self.launched
        if self.stream is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_stream(self.stream)
            table.record_stream(main)
            rows.record_stream(main)
        out = [None] * len(jobs)
        for i in range(len(jobs)):
            out[self.order[i]] = (table[i].view((1 + m) * p, 2, c), rows[i])
        return out

    def rows_epochs(self, decided: list) -> list:
        """After :meth:`finish`, per job (in the order given), the epochs :meth:`encode_rows` gave its blocks: what
        the phases it read decide (None where it was not made).  Where it read every phase launched, those are
        the decisions, ``decided`` (as :meth:`finish` returns them)."""
        out = [None] * len(self.jobs)
        if self.rows_phases is None:
            return out
        if self.rows_phases == self.launched:
            return list(decided)
        found = self._found[:self.rows_phases]
        for i in range(len(self.jobs)):
            out[self.order[i]] = self._block_epochs(i, self.epoch0[i], found[:, i][found[:, i] != NONE])
        return out

    def _block_epochs(self, i: int, epoch: int, picked: np.ndarray) -> np.ndarray:
        """Job ``i``'s block epochs where its epoch was ``epoch`` and the checks ``picked`` append: logical block
        ``r0 + b`` belongs to check ``(r0 + b) // every``, coded with the epoch current before that check."""
        if not len(picked):          # no epoch appended: every block keeps the current one
            return np.full(self.n, epoch, np.int64)
        r0 = int(self.r0[i])
        check_of = self._check_of.get(r0)           # the same for every job with as many blocks pending
        if check_of is None:
            check_of = self._check_of[r0] = (r0 + np.arange(self.n)) // self.every
        return epoch + np.searchsorted(picked, check_of, side="left").astype(np.int64)

    def _appending(self, last: np.ndarray) -> bool:
        """Whether a further phase can find a check that appends: a job's last phase found one, and checks
        follow it (the kernel itself stops a job at the epoch cap)."""
        return self.launched < self.nxt.shape[0] and bool(np.any(last < self.checks - 1))

    def finish(self) -> list:
        """Wait for the decisions; append the epochs, update the adapters, return each job's block epochs."""
        import torch

        with self._on_stream():
            recent = self._recent_blocks()                        # the adapters' next blocks, on the device
            self.copy_hists()       # where not made already: queued before the waits and the stream wait below
            # waits for the batch's stream (nothing to wait for where the batch does not decide)
            found = self.nxt[:self.launched].cpu().numpy() if self.decide else np.zeros((0, len(self.jobs)), np.int32)
            while len(found) and self._appending(found[-1]):
                self._phases(self.launched)                      # twice as many phases as so far
                found = self.nxt[:self.launched].cpu().numpy()
            self._found = found
            picked = [found[:, i][found[:, i] != NONE] for i in range(len(self.jobs))]
            self._tables(picked)                                  # the candidates picked, read on the same stream
        if self.stream is not None:
            # the rest runs on the current stream, which reads the batch's tensors after the allocator may
            # have given them back to the batch's stream
            main = torch.cuda.current_stream(self.device)
            main.wait_stream(self.stream)
            for t in (self.hist, self.cand, self._gathered[1]):
                if t is not None:
                    t.record_stream(main)
        return self._finish(picked, recent)

    def _tables(self, picked: list) -> dict:
        """The candidate tables of the checks that append one (read once, on the stream this is called on)."""
        import torch

        if getattr(self, "_picked", None) is not None:
            return self._picked
        wanted = [(i, int(j)) for i, js in enumerate(picked) for j in js]
        self._picked, self._gathered = {}, (wanted, None)
        if wanted:
            idx = torch.tensor(wanted, dtype=torch.int64, device=self.device)
            gathered = self.cand[idx[:, 0], idx[:, 1]]
            got = gathered.cpu().numpy().astype(np.uint8)
            self._picked, self._gathered = {w: got[t] for t, w in enumerate(wanted)}, (wanted, gathered)
        return self._picked

    def new_bases(self) -> list:
        """After :meth:`finish`, per job (in the order given), the bases of the epochs it appended as the CUDA
        encoder reads them (``int16 [P, 2, C]`` each: a block's tiles, narrow then wide bases), made on the
        device from the candidates :meth:`finish` gathered for the host, so that the encodes copy none over;
        empty lists where the batch appends fewer than :data:`DEVICE_PACKED` epochs (a join's few: the host
        packs them, as before; the device's packing is what a long prompt that appends in many layers gains
        from).  The rule's windows start within the modes' ranges by construction: a window running off bin
        255 never beats the one ending there, and ties go to the smaller start."""
        import torch

        out = [[] for _ in self.jobs]
        wanted, gathered = self._gathered           # (finish has gathered them)
        if len(wanted) < DEVICE_PACKED or gathered is None:
            return out
        c = L.tile_channels(self.head_dim)
        p = self.channels // c
        packed = gathered.view(len(wanted), 2, p, c).transpose(1, 2).to(torch.int16).contiguous()
        for t, (i, _) in enumerate(wanted):
            out[self.order[i]].append(packed[t])
        return out

    def _finish(self, picked_all: list, recent: list) -> list:
        jobs, n, checks = self.jobs, self.n, self.checks
        kv_heads, head_dim = self.kv_heads, self.head_dim
        tables = self._tables(picked_all)
        out = [None] * len(jobs)
        own_hist = self.copy_hists()            # made by finish, or earlier
        appends = {}            # per calibration (the cache's batches share one): its new epochs, checked together
        for i, (a, blocks) in enumerate(jobs):
            picked = picked_all[i]
            epochs = self._block_epochs(i, a.epoch, picked)
            for j in picked:
                b3, b4 = tables[(i, int(j))]
                appends.setdefault(id(a.calibration), (a.calibration, []))[1].append(
                    (a.layer, a.kind, b3.reshape(kv_heads, head_dim), b4.reshape(kv_heads, head_dim)))
            a.keep_hist_on_device(own_hist[i])
            a.finalized += n
            host, dev = recent[i]
            new = [dev] if dev is not None else []
            if checks[i] == 0:           # no check: the batch's blocks join those the adapter held
                runs = a.recent_on(self.device)
                a.keep_recent([*a._recent, *host], None if runs is None else [*runs, *new])
            else:
                a.keep_recent(host, new)
            out[self.order[i]] = epochs
        for calibration, items in appends.values():
            calibration.add_epochs(items)
        return out

    def _recent_blocks(self) -> list:
        """Per job, the blocks its adapter keeps for its next check: all its blocks where it reaches no check,
        else those after its last check, as (host blocks, the same on the device).  Every job's in one
        device copy of their own (the adapters keep them there for the rule's next batch, not the caller's
        tensors they are views of); the host blocks are :class:`~gaac.epochs.DeviceBlock` of that copy, read
        only by a check of the host rule, so nothing is copied to the host."""
        import torch

        n, every = self.n, self.every
        tails = []
        for i, (_, blocks) in enumerate(self.jobs):
            left = n if self.checks[i] == 0 else int((self.r0[i] + n) % every)
            tails.append(blocks[n - left:] if left else blocks[:0])
        sizes = [t.shape[0] for t in tails]
        if not sum(sizes):
            return [([], None) for _ in tails]
        joined = torch.cat(tails)           # every job's blocks have one shape (_setup): joined on their first axis
        out, at = [], 0
        for size in sizes:
            dev = joined[at:at + size] if size else None
            out.append((E.device_blocks(dev) if size else [], dev))
            at += size
        return out

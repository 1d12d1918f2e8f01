"""The attention kernel's tile decoder in a kernel of its own, for the decoder's bit-exact tests.

It stages and decodes slots exactly as the attention kernel does (:mod:`gaac.cuda.tile_decoder`) and writes
the BF16 tiles out, so that tests compare them with the reference codec's.
"""
from numba import cuda, uint32

from gaac import layout as L
from gaac.cuda.attention import SMEM_ALIGN
from gaac.cuda.primitives import (SCRATCH_WORDS, WARP, cp_commit, cp_wait_fn, i32, lane_id, scratch_init, smem_base,
                                  u32, warp_sync)
from gaac.cuda.tile_decoder import BASE_ROWS, base_row_words, decode_tile_fn, row_bytes, stage_slot_fn, tile_bytes


def decode_check_kernel(channels: int, slot_bytes: int):
    """Stage and decode slots exactly as the attention kernel does and write the BF16 tiles out.

    For the decoder's bit-exact tests against the reference codec: grid = one warp per slot;
    ``slots`` uint8 ``[n*slot_bytes]``, ``bases`` int32 ``[3*C/2]`` (pair-word rows b3, b4, 0 of
    one tile), ``cap``; out ``tiles`` int32 ``[n*16*C/2]`` (BF16 pairs) and ``status`` int32 ``[1]``.
    """
    C = channels
    ROWB = row_bytes(C)
    TB = tile_bytes(C)
    STAGE = -(-slot_bytes // 16) * 16
    PAIRS = C // 2
    RS = base_row_words(C)
    BASE_BYTES = 4 * BASE_ROWS * RS     # the bases first: the reserved tag reads the row after them
    SMEM_WORDS = (BASE_BYTES + STAGE + TB) // 4
    decode = decode_tile_fn(C)[0]
    stage_slot = stage_slot_fn(C, slot_bytes)
    wait_all = cp_wait_fn(0)

    @cuda.jit
    def kernel(slots, bases, cap, tiles, status):
        smem = cuda.shared.array(SMEM_WORDS, uint32, alignment=SMEM_ALIGN)
        scr = cuda.shared.array(SCRATCH_WORDS, uint32)
        scratch_init(scr)
        sb = smem_base(smem)
        n = i32(cuda.blockIdx.x)
        lane = lane_id()
        for i in range(lane, BASE_ROWS * PAIRS, WARP):
            smem[(i // PAIRS) * RS + i % PAIRS] = bases[i]
        stage_slot(smem, u32(sb + BASE_BYTES), n, slots, slot_bytes, lane)
        cp_commit()
        wait_all()
        warp_sync(scr)
        decode(smem, u32(sb + BASE_BYTES), u32(sb + BASE_BYTES + STAGE), u32(sb + C * (lane >> 4)), 4 * RS, cap, status,
               scr)
        warp_sync(scr)
        for i in range(lane, L.BLOCK_TOKENS * PAIRS, WARP):
            tiles[n * L.BLOCK_TOKENS * PAIRS + i] = i32(smem[(BASE_BYTES + STAGE + (i // PAIRS) * ROWB) // 4 + i % PAIRS])
    return kernel

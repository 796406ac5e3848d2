"""numba kernels of :mod:`vllm_hawk.transform.cpu_kernel` (imported on first use only).

Per job (view s, tile k) the kernels read the tile's 64 face rows of 16 elements from the
strided source (element offsets: ``base + blk*sb + head*sh + token*st + dim*sd``) and
write the packed tile at byte ``first[k] + slots[s] * step[k]`` of the output.
"""
import numba
import numpy as np


@numba.njit(cache=True, inline="always")
def _bits32(src, i, src_bf16):
    v = np.uint32(src[i])
    if src_bf16:
        return v << np.uint32(16)
    return v

@numba.njit(cache=True, inline="always")
def _to_bf16(bits):
    if (bits & np.uint32(0x7F800000)) == np.uint32(0x7F800000) and (bits & np.uint32(0x7FFFFF)) != 0:
        return np.uint16(0x7FC0)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return np.uint16(rounded >> np.uint32(16))

@numba.njit(cache=True, parallel=True)
def gather_copy16(src, bases, strides, slots, blk, head, tr, tc, valid, out16, first, step):
    """bf16 source -> bf16 tiles: a 16-element face row is one slice copy when the
    source's dim stride is 1 (FlashAttention rows, CPU-layout V)."""
    n = blk.size
    for job in numba.prange(bases.size * n):
        s, k = job // n, job % n
        base, sb, sh, st, sd = bases[s], strides[s, 0], strides[s, 1], strides[s, 2], strides[s, 3]
        o = (first[k] + slots[s] * step[k]) // 2
        for fr in range(64):
            f, r = fr // 16, fr % 16
            dst = o + fr * 16
            if not valid[k]:
                out16[dst:dst + 16] = 0
                continue
            tok = tr[k] * 32 + (f // 2) * 16 + r
            p = base + blk[k] * sb + head[k] * sh + tok * st + (tc[k] * 32 + (f % 2) * 16) * sd
            if sd == 1:
                out16[dst:dst + 16] = src[p:p + 16]
            else:
                for c in range(16):
                    out16[dst + c] = src[p + c * sd]

@numba.njit(cache=True, parallel=True)
def gather_pack(src, src_bf16, bases, strides, slots, blk, head, tr, tc, valid, out, first, step, target):
    n = blk.size
    for job in numba.prange(bases.size * n):
        s, k = job // n, job % n
        base, sb, sh, st, sd = bases[s], strides[s, 0], strides[s, 1], strides[s, 2], strides[s, 3]
        o = first[k] + slots[s] * step[k]
        row = np.empty(16, dtype=np.uint32)
        for f in range(4):
            for r in range(16):
                fr = f * 16 + r  # face row 0..63
                if valid[k]:
                    tok = tr[k] * 32 + (f // 2) * 16 + r
                    p = base + blk[k] * sb + head[k] * sh + tok * st + (tc[k] * 32 + (f % 2) * 16) * sd
                    for c in range(16):
                        row[c] = _bits32(src, p + c * sd, src_bf16)
                else:
                    for c in range(16):
                        row[c] = 0
                pos = fr * 16
                if target == 0:  # bfloat16 from float32, little-endian
                    for c in range(16):
                        h = _to_bf16(row[c])
                        out[o + 2 * (pos + c)] = np.uint8(h & np.uint16(0xFF))
                        out[o + 2 * (pos + c) + 1] = np.uint8(h >> np.uint16(8))
                elif target == 3:  # float32
                    for c in range(16):
                        for b in range(4):
                            out[o + 4 * (pos + c) + b] = np.uint8((row[c] >> np.uint32(8 * b)) & np.uint32(0xFF))
                else:  # block float: shared exponent, then magnitudes
                    mbits = 7 if target == 1 else 3
                    shift = 24 - mbits
                    shared = np.uint32(0)
                    for c in range(16):
                        e = (row[c] >> np.uint32(23)) & np.uint32(0xFF)
                        if e > shared:
                            shared = e
                    out[o + fr] = np.uint8(shared)
                    for c in range(16):
                        bits = row[c]
                        e = (bits >> np.uint32(23)) & np.uint32(0xFF)
                        code = np.uint32(0)
                        if e != 0:
                            man = (bits & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
                            d = shared - e
                            man = man >> d if d < 32 else np.uint32(0)
                            rest = man & np.uint32((1 << shift) - 1)
                            q = man >> np.uint32(shift)
                            tie = np.uint32(1 << (shift - 1))
                            if rest > tie or (rest == tie and (q & np.uint32(1)) == 1):
                                q += np.uint32(1)
                            lim = np.uint32((1 << mbits) - 1)
                            if q > lim:
                                q = lim
                            if q != 0:
                                code = ((bits >> np.uint32(31)) << np.uint32(mbits)) | q
                        if mbits == 7:
                            out[o + 64 + pos + c] = np.uint8(code)
                        elif c % 2 == 0:
                            out[o + 64 + (pos + c) // 2] = np.uint8(code)
                        else:
                            out[o + 64 + (pos + c) // 2] |= np.uint8(code << np.uint32(4))

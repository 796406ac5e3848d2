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

@numba.njit(cache=True, parallel=True, boundscheck=False)
def gather_copy16(src, bases, strides, slots, blk, head, tr, tc, valid, out16, first, step):
    """bf16 source -> bf16 tiles. Walks the tile's 32 tokens; each token's 32 dims are two
    16-element face rows (faces f and f+1), copied as plain loops LLVM vectorises."""
    n = blk.size
    for job in numba.prange(bases.size * n):
        s, k = job // n, job % n
        st, sd = strides[s, 2], strides[s, 3]
        o = (first[k] + slots[s] * step[k]) // 2
        if not valid[k]:
            for i in range(1024):
                out16[o + i] = 0
            continue
        tile = bases[s] + blk[k] * strides[s, 0] + head[k] * strides[s, 1] + tr[k] * 32 * st + tc[k] * 32 * sd
        for t in range(32):
            p = tile + t * st
            d0 = o + (t // 16) * 512 + (t % 16) * 16  # face (t//16, 0), row t%16
            if sd == 1:
                for c in range(16):
                    out16[d0 + c] = src[p + c]
                for c in range(16):
                    out16[d0 + 256 + c] = src[p + 16 + c]
            else:
                for c in range(16):
                    out16[d0 + c] = src[p + c * sd]
                for c in range(16):
                    out16[d0 + 256 + c] = src[p + (16 + c) * sd]


@numba.njit(cache=True, parallel=True, boundscheck=False)
def gather_copy64(src64, bases, strides, slots, blk, head, tr, tc, valid, out64, first, step):
    """bf16 -> bf16 when every face row is 4 aligned uint64 words in the source (dim
    stride 1, element offsets multiples of 4): offsets and strides here are in uint64
    words (4 bf16 elements)."""
    n = blk.size
    for job in numba.prange(bases.size * n):
        s, k = job // n, job % n
        st = strides[s, 2]
        o = (first[k] + slots[s] * step[k]) // 8
        if not valid[k]:
            for i in range(256):
                out64[o + i] = 0
            continue
        tile = bases[s] + blk[k] * strides[s, 0] + head[k] * strides[s, 1] + tr[k] * 32 * st + tc[k] * 8
        for t in range(32):
            p = tile + t * st
            d0 = o + (t // 16) * 128 + (t % 16) * 4  # face (t//16, 0), row t%16
            for c in range(4):
                out64[d0 + c] = src64[p + c]
            for c in range(4):
                out64[d0 + 64 + c] = src64[p + 4 + c]


@numba.njit(cache=True, inline="always")
def _bfp_code(bits, shared, mbits):
    """One value's sign+magnitude code against its face row's shared exponent (branch-free)."""
    shift = np.uint32(24 - mbits)
    e = (bits >> np.uint32(23)) & np.uint32(0xFF)
    d = min(shared - e, np.uint32(31))
    man = ((bits & np.uint32(0x7FFFFF)) | np.uint32(0x800000)) >> d
    rest = man & ((np.uint32(1) << shift) - np.uint32(1))
    tie = np.uint32(1) << (shift - np.uint32(1))
    q = man >> shift
    up = np.uint32((rest > tie) | ((rest == tie) & ((q & np.uint32(1)) == np.uint32(1))))
    q = min(q + up, (np.uint32(1) << np.uint32(mbits)) - np.uint32(1))
    q = q if e != np.uint32(0) else np.uint32(0)  # zeros and subnormals flush to 0
    sign = (bits >> np.uint32(31)) if q != np.uint32(0) else np.uint32(0)
    return (sign << np.uint32(mbits)) | q


@numba.njit(cache=True, parallel=True, boundscheck=False)
def gather_pack(src, src_bf16, bases, strides, slots, blk, head, tr, tc, valid, out, first, step, target):
    """Any source -> bfloat16 (from float32), float32, bfloat8_b or bfloat4_b tiles.
    Walks the tile's 32 tokens; each token's 32 dims are face rows of faces f, f+1."""
    n = blk.size
    mbits = 7 if target == 1 else 3
    for job in numba.prange(bases.size * n):
        s, k = job // n, job % n
        st, sd = strides[s, 2], strides[s, 3]
        o = first[k] + slots[s] * step[k]
        tile = bases[s] + blk[k] * strides[s, 0] + head[k] * strides[s, 1] + tr[k] * 32 * st + tc[k] * 32 * sd
        row = np.empty(16, dtype=np.uint32)
        for t in range(32):
            for half in range(2):
                fr = (t // 16) * 32 + half * 16 + t % 16  # face row: face (t//16)*2+half, row t%16
                p = tile + t * st + half * 16 * sd
                if valid[k]:
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
                else:  # block float: shared exponent byte, then codes
                    shared = np.uint32(0)
                    for c in range(16):
                        shared = max(shared, (row[c] >> np.uint32(23)) & np.uint32(0xFF))
                    out[o + fr] = np.uint8(shared)
                    if mbits == 7:
                        for c in range(16):
                            out[o + 64 + pos + c] = np.uint8(_bfp_code(row[c], shared, 7))
                    else:
                        for c in range(8):
                            lo = _bfp_code(row[2 * c], shared, 3)
                            hi = _bfp_code(row[2 * c + 1], shared, 3)
                            out[o + 64 + pos // 2 + c] = np.uint8(lo | (hi << np.uint32(4)))

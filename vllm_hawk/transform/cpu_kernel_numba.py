"""numba kernels of :mod:`vllm_hawk.transform.cpu_kernel` (imported on first use only).

One job is one destination tile of one source view (slot ``s`` = 2*layer + K|V). Element
``(token t, dim d)`` of source block ``blk``, head ``h`` sits at element
``base[s] + blk*sb[s] + h*sh[s] + tok_off[s, t] + dim_off[s, d]`` of the storage; three
access kinds are specialised:

* kind 0, rows: ``dim_off[d] = d`` (FlashAttention, CPU V, gathered tensors): a face row
  is 16 consecutive elements (32 bytes), copied as 64-bit words when aligned; block floats
  take a token's two face rows (64 bytes) at a time;
* kind 1, transposed: ``tok_off[t] = t`` (CPU ``vec``/``vec16`` K, stored ``[D, N]``): each
  dim's 32 tokens are one contiguous 64-byte load, 16 dims at a time (two faces):
  bf16 is transposed in registers as 16-bit lanes and stored a face row (32 bytes) at a
  time; block floats are packed as loaded and only their byte codes are transposed;
* kind 2, tables: anything else (CPU ``amx`` K and V, whose token and dim digits are split
  over several axes), read through the two offset tables.

Techniques (each measured with ``hawk bench transform``, all byte-identical to
:func:`~vllm_hawk.layout.formats.pack_tiles`):
every index is unsigned 64-bit (numba adds a negative-index fix-up to signed indices, which
blocks vectorisation); bf16 block-float packing runs in 16-bit lanes (exact: see
:func:`_bfp_code16`), written as LLVM vector IR 16 or 32 lanes wide; jobs come in source
order (the caller sorts tiles by source address, layer K then V); the next tile's source
lines are prefetched.
"""

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

U64 = np.uint64


@intrinsic
def _prefetch(typingctx, arr, idx):
    """``llvm.prefetch`` of ``arr[idx]`` (read, high locality); a hint, never faults."""
    if not isinstance(arr, types.Array) or not isinstance(idx, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False, boundscheck=False)
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i8p, ir.IntType(32), ir.IntType(32), ir.IntType(32)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        i32 = ir.IntType(32)
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(arr, idx), codegen


_I16, _I8, _I32 = ir.IntType(16), ir.IntType(8), ir.IntType(32)
_V16 = ir.VectorType(_I16, 16)


def _ir_ptr(context, builder, aty, arr, idx):
    """Pointer to ``arr[idx]`` (no wraparound, no bounds check)."""
    a = context.make_array(aty)(context, builder, arr)
    return cgutils.get_item_pointer(context, builder, aty, a, [idx], wraparound=False, boundscheck=False)


def _splat(x, n=16):
    return ir.Constant(ir.VectorType(_I16, n), [ir.Constant(_I16, x)] * n)


def _ir_exp(builder, v):
    """Biased exponents of the bf16 lanes ``v`` (<n x i16>)."""
    n = v.type.count
    return builder.and_(builder.lshr(v, _splat(7, n)), _splat(0xFF, n))


def _ir_codes(builder, v, ex, sv, mbits):
    """Sign+magnitude codes (<n x i16>, ``mbits + 1`` bits) of the bf16 lanes ``v`` with
    exponents ``ex`` against the shared exponents ``sv``: :func:`_bfp_code16` per lane."""
    n = v.type.count

    def k(x):
        return _splat(x, n)

    d = builder.sub(sv, ex)
    lim = k(mbits + 1)
    d = builder.select(builder.icmp_unsigned(">", d, lim), lim, d)
    m8 = builder.or_(builder.and_(v, k(0x7F)), k(0x80))
    sh = builder.add(d, k(8 - mbits))
    q = builder.lshr(m8, sh)
    rest = builder.and_(m8, builder.sub(builder.shl(k(1), sh), k(1)))
    half = builder.shl(k(1), builder.sub(sh, k(1)))
    odd = builder.icmp_unsigned("!=", builder.and_(q, k(1)), k(0))
    up = builder.or_(builder.icmp_unsigned(">", rest, half), builder.and_(builder.icmp_unsigned("==", rest, half), odd))
    q = builder.add(q, builder.zext(up, v.type))
    top = k((1 << mbits) - 1)
    q = builder.select(builder.icmp_unsigned(">", q, top), top, q)
    q = builder.select(builder.icmp_unsigned("==", ex, k(0)), k(0), q)
    sign = builder.select(builder.icmp_unsigned("!=", q, k(0)), builder.lshr(v, k(15)), k(0))
    return builder.or_(builder.shl(sign, k(mbits)), q)


def _ir_nibble_pairs(builder, a, b):
    """``a | b << 4`` per lane (<n x i16> bfloat4_b codes)."""
    return builder.or_(a, builder.shl(b, _splat(4, a.type.count)))


def _ir_transpose(builder, rows, perm=None):
    """Rows ``rows`` (2**k vectors of n = 16m lanes, m 16x16 blocks side by side) -> each
    block's 16 columns, two by two: vector j of the result holds, per 16-lane block, its
    columns 2j, 2j+1 (k = 4: column j alone), i.e. per block the concatenation is the
    column-major order; any lane width. k interleave stages, each zipping row i with row
    i + 2**(k-1) within each 16-lane block (bytes: vpunpcklbw/vpunpckhbw on x86's 128-bit
    lanes). ``perm``: lane order applied to every row first (lane l of the permuted row
    is lane ``perm[l]``), folded into the first stage's shuffles at no cost."""
    n, m = len(rows), rows[0].type.count
    perm = list(range(m)) if perm is None else list(perm)

    def zip_mask(off, src):
        return ir.Constant(
            ir.VectorType(_I32, m),
            [x for b in range(0, m, 16) for i in range(off, off + 8) for x in (src[b + i], m + src[b + i])],
        )

    ident = list(range(m))
    for stage in range(n.bit_length() - 1):
        h, src = n // 2, perm if stage == 0 else ident
        lo, hi = zip_mask(0, src), zip_mask(8, src)
        rows = [builder.shuffle_vector(rows[i], rows[i + h], z) for i in range(h) for z in (lo, hi)]
    return rows


def _row_bfp_intrinsic(mbits: int):
    """An intrinsic ``f(src, i, out, e, c)``: the 16 bf16 values ``src[i:i+16]`` (uint16
    bits, one face row) packed as block floats with ``mbits`` magnitude bits: the shared
    exponent byte to ``out[e]``, the codes to ``out[c:]`` (16 bytes, or 8 nibble pairs).
    Written as LLVM vector IR on <16 x i16> (the arithmetic of :func:`_bfp_code16`), with
    the face-row max as ``llvm.vector.reduce.umax``: numba's own lowering widens 16-bit
    math to 64 bits and keeps the reduction scalar."""

    @intrinsic
    def row_bfp(typingctx, src, i, out, e, c):
        if not (isinstance(src, types.Array) and isinstance(out, types.Array)):
            return None

        def codegen(context, builder, sig, args):
            v8 = ir.VectorType(_I8, 16)
            p_src = builder.bitcast(_ir_ptr(context, builder, sig.args[0], args[0], args[1]), _V16.as_pointer())
            v = builder.load(p_src, align=2)
            ex = _ir_exp(builder, v)
            red = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_I16, [_V16]), "llvm.vector.reduce.umax.v16i16"
            )
            shared = builder.call(red, [ex])
            sv = builder.insert_element(ir.Constant(_V16, None), shared, ir.Constant(_I32, 0))
            sv = builder.shuffle_vector(sv, ir.Constant(_V16, None), ir.Constant(ir.VectorType(_I32, 16), [0] * 16))
            code = _ir_codes(builder, v, ex, sv, mbits)
            builder.store(builder.trunc(shared, _I8), _ir_ptr(context, builder, sig.args[2], args[2], args[3]))
            p_code = _ir_ptr(context, builder, sig.args[2], args[2], args[4])
            if mbits == 7:
                builder.store(builder.trunc(code, v8), builder.bitcast(p_code, v8.as_pointer()), align=1)
            else:
                v8h, w8 = ir.VectorType(_I16, 8), ir.VectorType(_I8, 8)
                lo = builder.shuffle_vector(code, code, ir.Constant(ir.VectorType(_I32, 8), list(range(0, 16, 2))))
                hi = builder.shuffle_vector(code, code, ir.Constant(ir.VectorType(_I32, 8), list(range(1, 16, 2))))
                pair = builder.or_(lo, builder.shl(hi, ir.Constant(v8h, [ir.Constant(_I16, 4)] * 8)))
                builder.store(builder.trunc(pair, w8), builder.bitcast(p_code, w8.as_pointer()), align=1)
            return context.get_dummy_value()

        return types.void(src, i, out, e, c), codegen

    return row_bfp


def _token_bfp_intrinsic(mbits: int):
    """An intrinsic ``f(src, i, out, e, c)``: the 32 bf16 values ``src[i:i+32]`` (uint16
    bits: one token's two face rows, dims 0-15 and 16-31) packed as block floats with
    ``mbits`` magnitude bits: the shared exponents to ``out[e]`` and ``out[e + 16]``, the
    codes to ``out[c:]`` and ``out[c + 16*r:]`` (r = 16 bytes, or 8 nibble pairs: the
    face to the right). One <32 x i16> pass; each 16-lane half's max is a 4-step
    butterfly, so it is already in every lane of its half."""

    @intrinsic
    def token_bfp(typingctx, src, i, out, e, c):
        if not (isinstance(src, types.Array) and isinstance(out, types.Array)):
            return None

        def codegen(context, builder, sig, args):
            i64, v32 = ir.IntType(64), ir.VectorType(_I16, 32)
            r = 16 if mbits == 7 else 8

            def mask(lanes):
                return ir.Constant(ir.VectorType(_I32, len(lanes)), lanes)

            def at(k, off):  # pointer to out[args[k] + off]
                return _ir_ptr(context, builder, sig.args[2], args[2], builder.add(args[k], ir.Constant(i64, off)))

            p_src = builder.bitcast(_ir_ptr(context, builder, sig.args[0], args[0], args[1]), v32.as_pointer())
            v = builder.load(p_src, align=2)
            ex = _ir_exp(builder, v)
            sv = ex
            for step in (8, 4, 2, 1):
                sw = builder.shuffle_vector(sv, sv, mask([k ^ step for k in range(32)]))
                sv = builder.select(builder.icmp_unsigned(">", sw, sv), sw, sv)
            code = _ir_codes(builder, v, ex, sv, mbits)
            if mbits != 7:
                lo, hi = (builder.shuffle_vector(code, code, mask(list(range(k, 32, 2)))) for k in (0, 1))
                code = _ir_nibble_pairs(builder, lo, hi)
            code = builder.trunc(code, ir.VectorType(_I8, 2 * r))
            for h in range(2):
                builder.store(builder.trunc(builder.extract_element(sv, ir.Constant(_I32, 16 * h)), _I8), at(3, 16 * h))
                part = builder.shuffle_vector(code, code, mask(list(range(r * h, r * h + r))))
                builder.store(part, builder.bitcast(at(4, 16 * r * h), part.type.as_pointer()), align=1)
            return context.get_dummy_value()

        return types.void(src, i, out, e, c), codegen

    return token_bfp


def _faces_bfp_t_intrinsic(mbits: int):
    """An intrinsic ``f(src, p, sd, out, e, c)``: the two faces of one 16-dim half of a
    transposed source tile (kind 1: dim j's 32 tokens are ``src[p + j*sd:][:32]``, uint16
    bf16 bits; a face row is one token) packed as block floats with ``mbits`` magnitude
    bits. Token t < 16: shared exponent to ``out[e + t]``, codes to ``out[c + r*t:]`` (r =
    16 bytes, or 8 nibble pairs); token 16 + t: the same at ``e + 32``, ``c + 32*r`` (the
    face below). Works on the 16 dims' 64-byte token runs as loaded: the face-row max is a
    lane-wise umax across them, the codes are computed 32 tokens wide, and only the byte
    codes are transposed (:func:`_ir_transpose`), so no 16-bit tile buffer is needed."""

    @intrinsic
    def faces_bfp_t(typingctx, src, p, sd, out, e, c):
        if not (isinstance(src, types.Array) and isinstance(out, types.Array)):
            return None

        def codegen(context, builder, sig, args):
            i64, v32, v8, v16 = ir.IntType(64), ir.VectorType(_I16, 32), ir.VectorType(_I8, 32), ir.VectorType(_I8, 16)
            r = 16 if mbits == 7 else 8
            lo_hi = [ir.Constant(ir.VectorType(_I32, 16), list(range(h, h + 16))) for h in (0, 16)]

            def store16(vec, idx, off):  # bytes 16*half .. of vec to out[idx + off*half]
                for h, mask in enumerate(lo_hi):
                    ptr = _ir_ptr(context, builder, sig.args[3], args[3], builder.add(idx, ir.Constant(i64, off * h)))
                    builder.store(
                        builder.shuffle_vector(vec, vec, mask), builder.bitcast(ptr, v16.as_pointer()), align=1
                    )

            vs = []
            for j in range(16):
                idx = builder.add(args[1], builder.mul(args[2], ir.Constant(i64, j)))
                ptr = _ir_ptr(context, builder, sig.args[0], args[0], idx)
                vs.append(builder.load(builder.bitcast(ptr, v32.as_pointer()), align=2))
            exs = [_ir_exp(builder, v) for v in vs]
            sv = exs[0]
            for ex in exs[1:]:
                sv = builder.select(builder.icmp_unsigned(">", ex, sv), ex, sv)
            codes = [_ir_codes(builder, v, ex, sv, mbits) for v, ex in zip(vs, exs, strict=False)]
            if mbits != 7:
                codes = [_ir_nibble_pairs(builder, codes[2 * j], codes[2 * j + 1]) for j in range(8)]
            rows = _ir_transpose(builder, [builder.trunc(x, v8) for x in codes])
            store16(builder.trunc(sv, v8), args[4], 32)
            for j, row in enumerate(rows):
                store16(row, builder.add(args[5], ir.Constant(i64, 16 * j)), 32 * r)
            return context.get_dummy_value()

        return types.void(src, p, sd, out, e, c), codegen

    return faces_bfp_t


@intrinsic
def _faces_bf16_t(typingctx, src, p, sd, out16, o):
    """Two faces of one 16-dim half of a transposed source tile (kind 1: dim j's 32 tokens
    are ``src[p + j*sd:][:32]``, uint16 bf16 bits) -> bfloat16 tile rows: token t < 16 to
    ``out16[o + 16*t:][:16]``, token 16 + t to ``out16[o + 512 + 16*t:][:16]`` (the face
    below). The 16 runs are loaded as <32 x i16> and transposed in registers as 16-bit
    lanes (:func:`_ir_transpose`), even tokens in one 16x16 block and odd in the other,
    so each result is tokens 2j and 2j+1: two adjacent face rows, one 64-byte store."""
    if not (isinstance(src, types.Array) and isinstance(out16, types.Array)):
        return None

    def codegen(context, builder, sig, args):
        i64, v32 = ir.IntType(64), ir.VectorType(_I16, 32)
        vs = []
        for j in range(16):
            ptr = _ir_ptr(
                context, builder, sig.args[0], args[0], builder.add(args[1], builder.mul(args[2], ir.Constant(i64, j)))
            )
            vs.append(builder.load(builder.bitcast(ptr, v32.as_pointer()), align=2))
        even_odd = [*range(0, 32, 2), *range(1, 32, 2)]
        for j, rows in enumerate(_ir_transpose(builder, vs, even_odd)):
            t = 2 * j  # tokens t, t + 1: face t // 16, rows t % 16 and the next
            ptr = _ir_ptr(
                context,
                builder,
                sig.args[3],
                args[3],
                builder.add(args[4], ir.Constant(i64, 512 * (t // 16) + 16 * (t % 16))),
            )
            builder.store(rows, builder.bitcast(ptr, v32.as_pointer()), align=2)
        return context.get_dummy_value()

    return types.void(src, p, sd, out16, o), codegen


_row_bfp8 = _row_bfp_intrinsic(7)
_row_bfp4 = _row_bfp_intrinsic(3)
_token_bfp8 = _token_bfp_intrinsic(7)
_token_bfp4 = _token_bfp_intrinsic(3)
_faces_bfp8_t = _faces_bfp_t_intrinsic(7)
_faces_bfp4_t = _faces_bfp_t_intrinsic(3)


@numba.njit(cache=True, inline="always")
def _bfp_code16(v, shared, mbits):
    """Code of bf16 value ``v`` (uint16 bits) against shared exponent ``shared``, as
    :func:`~vllm_hawk.layout.formats.pack_tiles` computes it from float32.

    The float32 mantissa of a bf16 value is ``m8 << 16`` (m8: 8 bits with the hidden one),
    so shifting it by ``d`` and rounding to ``mbits`` bits equals rounding ``m8`` at bit
    ``d + 8 - mbits`` (ties to even); any ``d > mbits + 1`` gives 0, so ``d`` is clamped
    there and every intermediate fits in 16 bits."""
    e = (v >> 7) & 0xFF
    d = min(shared - e, mbits + 1)
    m8 = (v & 0x7F) | 0x80
    sh = d + 8 - mbits
    q = m8 >> sh
    rest = m8 & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    q += (rest > half) | ((rest == half) & (q & 1))
    q = min(q, (1 << mbits) - 1)
    if e == 0:
        q = 0
    s = (v >> 15) if q != 0 else 0
    return (s << mbits) | q


@numba.njit(cache=True, inline="always")
def _pack_rows(buf, out, o, mbits):
    """Face-ordered tile ``buf`` (uint16[1024], bf16 bits) -> bfloat8_b (mbits 7) or
    bfloat4_b (mbits 3) bytes at ``out[o:]``: 64 shared exponents, then the codes."""
    for fr in range(64):
        r = U64(fr) * U64(16)
        if mbits == 7:
            _row_bfp8(buf, r, out, o + U64(fr), o + U64(64) + r)
        else:
            _row_bfp4(buf, r, out, o + U64(fr), o + U64(64) + r // U64(2))


@numba.njit(cache=True, inline="always")
def _gather_tile(src, tile, kind, st, tok_off, dim_off, tr0, tc0, buf):
    """Read one source tile into ``buf`` (uint16[1024], face order); kind 0 or 2 (kind 1
    never comes here: :func:`transform_bf16` has a path for each target)."""
    if kind == 0:  # rows: 16 consecutive elements per face row
        for t in range(32):
            p = tile + U64(t) * st
            d0 = U64((t // 16) * 512 + (t % 16) * 16)
            for c in range(16):
                buf[d0 + U64(c)] = src[p + U64(c)]
            for c in range(16):
                buf[d0 + U64(256) + U64(c)] = src[p + U64(16) + U64(c)]
    else:  # offset tables
        for t in range(32):
            p = tile + tok_off[tr0 + U64(t)]
            d0 = U64((t // 16) * 512 + (t % 16) * 16)
            for c in range(16):
                buf[d0 + U64(c)] = src[p + dim_off[tc0 + U64(c)]]
            for c in range(16):
                buf[d0 + U64(256) + U64(c)] = src[p + dim_off[tc0 + U64(16 + c)]]


@numba.njit(cache=True, inline="always")
def _tile_start(bases, sbs, shs, kinds, sts, sds, blk, head, tr, tc, s, k):
    """Element offset of tile k's first element in view s, and the stride (elements) between
    its 32 contiguous 64-byte source runs (kind 0: token rows, kind 1: dims; kind 2: 0)."""
    tile = bases[s] + blk[k] * sbs[s] + head[k] * shs[s]
    tr0, tc0 = tr[k] * U64(32), tc[k] * U64(32)
    if kinds[s] == 0:
        return tile + tr0 * sts[s] + tc0, sts[s]
    if kinds[s] == 1:
        return tile + tr0 + tc0 * sds[s], sds[s]
    return tile, U64(0)


# The two kernels are one prange loop nest each, branching per tile on the source kind and the
# target format. They are kept whole as `hawk bench transform` measured them (over the mccabe
# bound): splitting the loop body into calls is a performance change to measure first.
@numba.njit(cache=True, parallel=True, boundscheck=False)
def transform_bf16(  # noqa: C901
    src,
    src64,
    bases,
    sbs,
    shs,
    kinds,
    sts,
    sds,
    tok_off,
    dim_off,
    slots,
    blk,
    head,
    tr,
    tc,
    valid,
    out,
    out16,
    out64,
    first,
    step,
    target,
):
    """bf16 source (uint16 storage ``src``; ``src64`` its uint64 view, or empty when the
    storage is not 8-byte sized) -> target 0 bfloat16, 1 bfloat8_b, 2 bfloat4_b.

    Per view s: ``bases, sbs, shs, sts, sds`` (uint64, elements), ``kinds`` (see module
    doc), offset tables ``tok_off[s]``, ``dim_off[s]``; ``slots[s]``: its (layer, K|V)
    slot. Per tile k (any order; the caller passes source order): ``blk, head, tr, tc``
    (uint64; tr/tc in tiles), ``valid`` (uint8) and the output byte offset
    ``first[k] + slots[s] * step[k]``. ``out``/``out16``/``out64``: one buffer as
    uint8/uint16/uint64 (the 64-bit view may be empty)."""
    n = blk.size
    nv = bases.size
    mbits = 7 if target == 1 else 3
    for job in numba.prange(nv * n):
        s = U64(job // n)
        k = U64(job % n)
        o = first[k] + slots[s] * step[k]
        kind = kinds[s]
        st, sd = sts[s], sds[s]
        tr0, tc0 = tr[k] * U64(32), tc[k] * U64(32)
        tile, _ = _tile_start(bases, sbs, shs, kinds, sts, sds, blk, head, tr, tc, s, k)
        if job + 1 < nv * n:  # the next job's source lines
            p1, line = _tile_start(
                bases, sbs, shs, kinds, sts, sds, blk, head, tr, tc, U64((job + 1) // n), U64((job + 1) % n)
            )
            for i in range(32 if line != 0 else 1):
                _prefetch(src, p1 + U64(i) * line)
        if valid[k] == 0:
            nbytes = U64(2048) if target == 0 else (U64(1088) if target == 1 else U64(576))
            for i in range(nbytes):
                out[o + U64(i)] = 0
            continue
        if target == 0 and kind == 0 and src64.size > 0 and (tile & U64(3)) == 0 and (st & U64(3)) == 0:
            # whole face rows are 4 aligned 64-bit words on both sides
            w = tile // U64(4)
            wst = st // U64(4)
            o64 = o // U64(8)
            for t in range(32):
                p = w + U64(t) * wst
                d0 = o64 + U64((t // 16) * 128 + (t % 16) * 4)
                for c in range(4):
                    out64[d0 + U64(c)] = src64[p + U64(c)]
                for c in range(4):
                    out64[d0 + U64(64) + U64(c)] = src64[p + U64(4) + U64(c)]
            continue
        if target == 0 and kind == 1:  # two faces per 16 dims' 32-token runs, transposed in registers
            for ch in range(2):
                _faces_bf16_t(src, tile + U64(ch * 16) * sd, sd, out16, o // U64(2) + U64(ch * 256))
            continue
        if target != 0 and kind == 0:  # a token's two face rows straight from the source
            for t in range(32):
                p = tile + U64(t) * st
                fr = U64((t // 16) * 32 + t % 16)
                if mbits == 7:
                    _token_bfp8(src, p, out, o + fr, o + U64(64) + fr * U64(16))
                else:
                    _token_bfp4(src, p, out, o + fr, o + U64(64) + fr * U64(8))
            continue
        if target != 0 and kind == 1:  # two faces per 16 dims' 32-token runs
            for ch in range(2):
                p = tile + U64(ch * 16) * sd
                fr = U64(ch * 16)
                if mbits == 7:
                    _faces_bfp8_t(src, p, sd, out, o + fr, o + U64(64) + fr * U64(16))
                else:
                    _faces_bfp4_t(src, p, sd, out, o + fr, o + U64(64) + fr * U64(8))
            continue
        buf = np.empty(1024, dtype=np.uint16)
        _gather_tile(src, tile, kind, st, tok_off[s], dim_off[s], tr0, tc0, buf)
        if target == 0:
            o16 = o // U64(2)
            for i in range(1024):
                out16[o16 + U64(i)] = buf[i]
        else:
            _pack_rows(buf, out, o, mbits)


@numba.njit(cache=True, parallel=True, boundscheck=False)
def pack_tiles_bf16(tiles, out, mbits):
    """Face-ordered bf16 tiles (uint16 [n, 1024]) -> block-float bytes (uint8 [n, *]):
    the arithmetic of :func:`transform_bf16` on its own (exhaustive tests)."""
    tb = out.shape[1]
    flat = out.reshape(-1)
    for i in numba.prange(tiles.shape[0]):
        _pack_rows(tiles[i], flat, U64(i) * U64(tb), mbits)


# --------------------------------------------------------------------------- float32 sources


@numba.njit(cache=True, inline="always")
def _to_bf16(bits):
    if (bits & np.uint32(0x7F800000)) == np.uint32(0x7F800000) and (bits & np.uint32(0x7FFFFF)) != 0:
        return np.uint16(0x7FC0)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return np.uint16(rounded >> np.uint32(16))


@numba.njit(cache=True, inline="always")
def _bfp_code(bits, shared, mbits):
    """One float32 value's sign+magnitude code against its face row's shared exponent."""
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
def transform_f32(  # noqa: C901
    src,
    bases,
    sbs,
    shs,
    kinds,
    sts,
    sds,
    tok_off,
    dim_off,
    slots,
    blk,
    head,
    tr,
    tc,
    valid,
    out,
    first,
    step,
    target,
):
    """float32 source (uint32 storage) -> target 0 bfloat16, 1 bfloat8_b, 2 bfloat4_b,
    3 float32; same arguments as :func:`transform_bf16`."""
    n = blk.size
    nv = bases.size
    mbits = 7 if target == 1 else 3
    for job in numba.prange(nv * n):
        s = U64(job // n)
        k = U64(job % n)
        o = first[k] + slots[s] * step[k]
        tr0, tc0 = tr[k] * U64(32), tc[k] * U64(32)
        tile = bases[s] + blk[k] * sbs[s] + head[k] * shs[s]
        to, do = tok_off[s], dim_off[s]
        row = np.empty(16, dtype=np.uint32)
        for t in range(32):
            for half in range(2):
                fr = U64((t // 16) * 32 + half * 16 + t % 16)  # face row
                p = tile + to[tr0 + U64(t)]
                if valid[k]:
                    for c in range(16):
                        row[c] = src[p + do[tc0 + U64(half * 16 + c)]]
                else:
                    for c in range(16):
                        row[c] = 0
                pos = fr * U64(16)
                if target == 0:
                    for c in range(16):
                        h = _to_bf16(row[c])
                        out[o + U64(2) * (pos + U64(c))] = np.uint8(h & np.uint16(0xFF))
                        out[o + U64(2) * (pos + U64(c)) + U64(1)] = np.uint8(h >> np.uint16(8))
                elif target == 3:
                    for c in range(16):
                        for b in range(4):
                            out[o + U64(4) * (pos + U64(c)) + U64(b)] = np.uint8(
                                (row[c] >> np.uint32(8 * b)) & np.uint32(0xFF)
                            )
                else:
                    shared = np.uint32(0)
                    for c in range(16):
                        shared = max(shared, (row[c] >> np.uint32(23)) & np.uint32(0xFF))
                    out[o + fr] = np.uint8(shared)
                    if mbits == 7:
                        for c in range(16):
                            out[o + U64(64) + pos + U64(c)] = np.uint8(_bfp_code(row[c], shared, 7))
                    else:
                        for c in range(8):
                            lo = _bfp_code(row[2 * c], shared, 3)
                            hi = _bfp_code(row[2 * c + 1], shared, 3)
                            out[o + U64(64) + pos // U64(2) + U64(c)] = np.uint8(lo | (hi << np.uint32(4)))

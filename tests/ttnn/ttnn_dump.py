"""Dump ttnn's host-tilized bytes for a directory of test cases.

Runs under the CPython 3.12 side environment that has ttnn (scripts/ensure_env.sh ttnn);
it must not import vllm_hawk (that package lives in the 3.11 environment).

    python ttnn_dump.py CASE_DIR

CASE_DIR/cases.json:
    {"cases": [{"file": "case_0.npy", "dtypes": ["bfloat16", ...]}, ...],
     "raw":   [{"file": "sweep.bin", "dtype": "bfloat8_b", "shape": [2048, 32]}, ...]}
Each case_N.npy is a float32 array [..., H, W]. For every case and dtype this writes

    case_N.<dtype>.bin          the tensor's raw host buffer (TILE layout, padded to 32x32
                                tiles with zeros): exactly the bytes ttnn would send to DRAM
    case_N.<dtype>.decoded.npy  what ttnn decodes from that buffer (Tensor.to_numpy(),
                                float32, logical shape)

and CASE_DIR/ttnn_manifest.json with the ttnn version and per-file sizes.

Each optional "raw" entry is a host buffer we made ourselves (tile-aligned shape): it is
wrapped in a .tensorbin header taken from a zero tensor of that shape and dtype, loaded
with ttnn.load_tensor, and decoded to <file stem>.decoded.npy, so ttnn's decoder can be
checked on bytes its encoder never produces.

The buffer is taken from ttnn.dump_tensor's .tensorbin file, whose layout (tt-metal
tensor serialization, "inline file storage") is: u64 little-endian header_size, then a
flatbuffer of header_size bytes describing the tensor, then the host buffer bytes. We
check that the tail is exactly num_tiles * tile_nbytes long, so a format change fails loudly.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_CLUSTER_DESC = HERE / "mock_cluster_blackhole_p150.yaml"

TILE_NBYTES = {"bfloat16": 2048, "float32": 4096, "bfloat8_b": 1088, "bfloat4_b": 576}


def _dump_split(ttnn, tensor, scratch: Path) -> tuple[bytes, bytes]:
    """(header incl. its u64 size prefix, raw host buffer) of ttnn.dump_tensor's file."""
    path = scratch / "t.tensorbin"  # dump_tensor insists on this extension
    ttnn.dump_tensor(str(path), tensor)
    data = path.read_bytes()
    path.unlink()
    if len(data) < 8:
        raise RuntimeError(f"tensorbin too short: {len(data)} bytes")
    (header_size,) = struct.unpack_from("<Q", data, 0)
    if 8 + header_size > len(data):
        raise RuntimeError(f"tensorbin header_size {header_size} exceeds file size {len(data)}")
    return data[: 8 + header_size], data[8 + header_size :]


def _decode_raw(ttnn, np, raw: bytes, dtype, shape, scratch: Path):
    """ttnn's decode of a host buffer we supply, via a .tensorbin with ttnn's own header."""
    zero = ttnn.Tensor(np.zeros(shape, np.float32), dtype, None, ttnn.TILE_LAYOUT)
    header, zero_raw = _dump_split(ttnn, zero, scratch)
    if len(zero_raw) != len(raw):
        raise RuntimeError(f"raw buffer is {len(raw)} bytes, ttnn's is {len(zero_raw)} for {shape}")
    path = scratch / "raw.tensorbin"
    path.write_bytes(header + raw)
    out = _decoded(np, ttnn.load_tensor(str(path)), shape)
    path.unlink()
    return out


def _decoded(np, tensor, shape):
    """What ttnn decodes from the tensor, as float32 of the logical shape.

    to_numpy() gives float32 for float32/bfloat8_b/bfloat4_b; for bfloat16 it returns a
    bf16 DLPack array numpy 1.26 cannot read, so take to_list() (bf16 -> Python float is
    exact, and float -> float32 is exact for bf16 values).
    """
    out = tensor.to_numpy()
    if out.dtype != np.float32:
        out = np.array(tensor.to_list(), dtype=np.float32)
    out = np.ascontiguousarray(out, dtype=np.float32)
    if out.shape != tuple(shape):
        raise RuntimeError(f"ttnn decoded shape {out.shape} != logical shape {tuple(shape)}")
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    case_dir = Path(argv[1]).resolve()
    os.environ.setdefault("TT_METAL_MOCK_CLUSTER_DESC_PATH", str(DEFAULT_CLUSTER_DESC))
    os.environ.setdefault("TT_LOGGER_LEVEL", "error")

    t0 = time.perf_counter()
    import numpy as np
    import ttnn

    t_import = time.perf_counter() - t0
    try:
        from importlib.metadata import version

        ttnn_version = version("ttnn")
    except Exception:  # pragma: no cover - informational only
        ttnn_version = getattr(ttnn, "__version__", "unknown")

    dtypes = {
        "bfloat16": ttnn.bfloat16,
        "float32": ttnn.float32,
        "bfloat8_b": ttnn.bfloat8_b,
        "bfloat4_b": ttnn.bfloat4_b,
    }
    spec = json.loads((case_dir / "cases.json").read_text())
    manifest = {"ttnn_version": ttnn_version, "import_s": round(t_import, 3), "files": {}}
    with tempfile.TemporaryDirectory(prefix="hawk-ttnn-") as tmp:
        scratch = Path(tmp)
        for case in spec["cases"]:
            src = case_dir / case["file"]
            stem = src.name[: -len(".npy")]
            arr = np.ascontiguousarray(np.load(src), dtype=np.float32)
            if arr.ndim < 2:
                raise ValueError(f"{src}: need at least 2 dims, got shape {arr.shape}")
            for name in case["dtypes"]:
                # Positional form (tensor, data_type, device, layout): host tensor, tilized on
                # the host; the logical shape is padded to whole 32x32 tiles with zeros.
                t = ttnn.Tensor(arr, dtypes[name], None, ttnn.TILE_LAYOUT)
                padded = list(t.padded_shape)
                lead = 1
                for d in padded[:-2]:
                    lead *= d
                num_tiles = lead * (padded[-2] // 32) * (padded[-1] // 32)
                _, raw = _dump_split(ttnn, t, scratch)
                if len(raw) != num_tiles * TILE_NBYTES[name]:
                    raise RuntimeError(
                        f"{src.name} {name}: host buffer is {len(raw)} bytes, expected "
                        f"{num_tiles} tiles x {TILE_NBYTES[name]} B (padded shape {padded})"
                    )
                out = case_dir / f"{stem}.{name}.bin"
                out.write_bytes(raw)
                decoded = _decoded(np, t, arr.shape)
                np.save(case_dir / f"{stem}.{name}.decoded.npy", decoded)
                manifest["files"][out.name] = {
                    "shape": list(arr.shape),
                    "padded_shape": padded,
                    "num_tiles": num_tiles,
                    "nbytes": len(raw),
                }
        for entry in spec.get("raw", []):
            src = case_dir / entry["file"]
            shape = tuple(entry["shape"])
            decoded = _decode_raw(ttnn, np, src.read_bytes(), dtypes[entry["dtype"]], shape, scratch)
            np.save(case_dir / f"{src.stem}.decoded.npy", decoded)
            manifest["files"][src.name] = {"shape": list(shape), "decoded": True}
    manifest["total_s"] = round(time.perf_counter() - t0, 3)
    (case_dir / "ttnn_manifest.json").write_text(json.dumps(manifest, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

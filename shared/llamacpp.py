"""llama.cpp through llama-cpp-python's C API, as both sides load it: the edge's draft runtime
and the verifier's llama.cpp engine. Only model evaluation is used (token ids come from the HF
tokenizer; sampling is the project's own), so a model is a GGUF file and a context."""

from __future__ import annotations

import ctypes
import logging
import weakref
from pathlib import Path
from typing import Any

from shared.errors import ConfigError

log = logging.getLogger("llama.cpp")
_GGML_LOG_LEVEL_ERROR = 4


def available() -> bool:
    """True when llama-cpp-python imports (an optional part of either install)."""
    try:
        import llama_cpp  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def api(flag: str) -> Any:
    """The llama_cpp module, or one line naming the flag that asked for it."""
    try:
        import llama_cpp
    except (ImportError, OSError) as err:
        raise ConfigError(f"{flag}: llama-cpp-python is not importable ({err})") from None
    _Logs.quiet(llama_cpp)
    return llama_cpp


class _Logs:
    """llama.cpp logs every load in detail; keep its errors only (the callback must stay alive)."""

    callback: Any = None

    @classmethod
    def quiet(cls, llama: Any) -> None:
        if cls.callback is None:

            def forward(level: int, text: bytes, _user: Any) -> None:
                if level == _GGML_LOG_LEVEL_ERROR:
                    log.error("llama.cpp: %s", text.decode(errors="replace").rstrip())

            cls.callback = llama.llama_log_callback(forward)
            llama.llama_log_set(cls.callback, ctypes.c_void_p(0))
            llama.llama_backend_init()


def load_model(llama: Any, gguf: str | Path) -> Any:
    """A GGUF model, freed with the returned handle's owner; one line when it cannot load."""
    path = Path(gguf).expanduser()
    if not path.is_file():
        raise ConfigError(f"GGUF {path} does not exist")
    model = llama.llama_model_load_from_file(str(path).encode(), llama.llama_model_default_params())
    if not model:
        raise ConfigError(f"llama.cpp could not load {path} (not a GGUF model it knows?)")
    return model


def free_with(owner: object, llama: Any, model: Any) -> None:
    """Free `model` when `owner` is collected."""
    weakref.finalize(owner, llama.llama_model_free, model)


def find_gguf(path: str | Path, flag: str) -> Path | None:
    """The GGUF at `path`: the path itself when it is a file, else the folder's one .gguf (None
    when it holds none); several are one line naming `flag`, the option that picks one."""
    where = Path(path).expanduser()
    if where.is_file():
        return where
    found = sorted(where.glob("*.gguf"))
    if len(found) > 1:
        raise ConfigError(f"{where} holds {len(found)} GGUF files; name one with {flag}")
    return found[0] if found else None


def logits_width(llama: Any, model: Any) -> int:
    return int(llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(model)))


F16_BYTES = 2  # llama.cpp's KV cache type unless a context asks for another


def kv_bytes_per_token(llama: Any, model: Any) -> int:
    """Bytes of one position of a context's KV cache (keys and values of every layer, f16)."""
    layers, embd = llama.llama_model_n_layer(model), llama.llama_model_n_embd(model)
    heads, kv_heads = llama.llama_model_n_head(model), llama.llama_model_n_head_kv(model)
    return int(layers * 2 * (embd // heads) * kv_heads * F16_BYTES)

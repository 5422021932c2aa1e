"""The co-located engines demo's options: their defaults, their help, and their checks.

Every value is checked before anything starts (``check``), and a bad one is one line on stderr
and exit 2 (``DemoError``, ``OneLineParser``), never a traceback from deep inside an engine
process or a run that "succeeds" with a cache too small to hit. ``tools/bench_sharing.py``
shares ``Options`` and ``OPTION_HELP``. numpy-free, torch only to ask whether CUDA is there.
"""
from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from typing import NoReturn

from kvshm.shm.names import shm_name

# A segment serves at most 1024 clients; each engine takes two (its scheduler and its
# worker's job channel), and the demo keeps two spare.
MAX_ENGINES = (1024 - 2) // 2


@dataclass
class Options:
    engines: int = 3
    conversations: int = 12
    turns: int = 6
    system_prompts: int = 4
    system_tokens: int = 512
    user_tokens: int = 48
    reply_tokens: int = 32
    block_tokens: int = 16
    block_size_factor: int = 1
    token_bytes: int = 1024
    device_blocks: int = 128
    max_running: int = 2
    cache_mib: float = 16.0
    private: bool = False        # one cache per engine (of cache_mib each) instead of one
    inline_workers: bool = False
    device: str = "cpu"
    cache: str | None = None
    keep: bool = False
    seed: int = 0


# Help for the workload options, shared with tools/bench_sharing.py.
OPTION_HELP = {
    "engines": "engine processes N",
    "conversations": "conversations C",
    "turns": "turns per conversation T",
    "system_prompts": "shared system prompts S",
    "system_tokens": "tokens per system prompt",
    "user_tokens": "tokens per user message",
    "reply_tokens": "tokens per reply",
    "block_tokens": "tokens per device block",
    "block_size_factor": "device blocks per kvshm block",
    "token_bytes": "KV bytes per token per plane (2 planes: K, V)",
    "device_blocks": "device KV blocks per engine",
    "max_running": "requests an engine runs at once",
    "seed": "workload seed",
}
PLANES = 2  # K and V: the mini engine's default


class DemoError(Exception):
    """What the demo refuses to do, said in one line (its ``main`` prints it and exits 2)."""


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (argparse prints the usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help explains every option)\n")


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def longest_prompt(o: Options) -> int:
    """Tokens of the last turn's prompt: system prompt, every earlier turn, one message."""
    return o.system_tokens + (o.turns - 1) * (o.user_tokens + o.reply_tokens) + o.user_tokens


def check(o: Options) -> None:
    """Raise ``DemoError`` naming the first option whose value cannot make a sensible run."""
    for f in OPTION_HELP:
        low = 0 if f == "seed" else 1
        if getattr(o, f) < low:
            raise DemoError(f"{_flag(f)} must be at least {low} ({OPTION_HELP[f]}); got "
                            f"{getattr(o, f)}")
    if o.engines > MAX_ENGINES:
        raise DemoError(f"--engines must be at most {MAX_ENGINES} (a segment serves 1024 "
                        f"clients, two per engine); got {o.engines}")
    need = -(-(longest_prompt(o) + o.reply_tokens) // o.block_tokens)
    if o.device_blocks < need:
        raise DemoError(f"--device-blocks {o.device_blocks} cannot hold the longest request "
                        f"({longest_prompt(o)} prompt + {o.reply_tokens} reply tokens, "
                        f"{need} blocks of {o.block_tokens}): give at least --device-blocks "
                        f"{need}, or fewer --turns")
    block_tokens = o.block_tokens * o.block_size_factor
    block_bytes = PLANES * block_tokens * o.token_bytes
    blocks = -(-longest_prompt(o) // block_tokens)
    least = blocks * block_bytes / 2**20
    if not (math.isfinite(o.cache_mib) and o.cache_mib > 0):
        raise DemoError(f"--cache-mib must be a positive number of MiB; got {o.cache_mib:g}")
    if o.cache_mib * 2**20 < blocks * block_bytes:
        raise DemoError(f"--cache-mib {o.cache_mib:g} cannot hold one conversation ({blocks} "
                        f"blocks of {block_bytes} bytes, {least:.2f} MiB), so nothing could "
                        f"hit: give at least --cache-mib {math.ceil(least * 100) / 100:g}")
    if o.cache is not None:
        for name in [f"{o.cache}-e{o.engines - 1}" if o.private else o.cache]:
            try:
                shm_name(name)
            except ValueError as e:
                raise DemoError(f"--cache {o.cache!r}: {e}") from None
    if o.device == "cuda" and not cuda_available():
        raise DemoError("--device cuda: no CUDA device is available here; use --device cpu "
                        "(or auto, the default: CUDA when there is one)")
    if o.device not in ("cpu", "cuda"):
        raise DemoError(f"--device must be cpu or cuda (or auto); got {o.device!r}")


def cuda_available() -> bool:
    if not os.path.exists("/dev/nvidiactl"):
        return False  # no driver: do not pay for importing torch to find out
    import torch
    return torch.cuda.is_available()


if __name__ == "__main__":  # a library: say what it is and what to run instead
    from library_help import explain
    explain("demo_options.py", __doc__)

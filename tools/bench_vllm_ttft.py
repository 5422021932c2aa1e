"""``tools/bench_vllm.py --engines 2``: time to first token when another engine prefilled.

Engine A serves long prompts; engine B, another process on the same kvshm segment, then
serves the same prompts. B's time to first token (TTFT) is compared with B recomputing them
(no offloading), with an engine hitting its own earlier run through a private in-process CPU
tier (vLLM's CPUOffloadingManager and a plain torch copy worker: the comparator), and with
A's own cold TTFT. Results are recorded in docs/benchmarks.md and docs/vllm.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

DESCRIPTION = """\
Cross-engine time to first token (--engines 2). A model of realistic shape with random
weights is built locally (24 layers, hidden 896, 14 query and 2 KV heads: Qwen2-0.5B's
shape as a Llama, bfloat16; --shape tiny for the test suite's tiny model). Every engine is a
vLLM engine process of its own (single-process mode: scheduler and worker in it) that first
serves one short unrelated warm-up prompt, then --prompts prompts of --prompt-tokens random
token ids one at a time with one output token: the wall time of that request is its TTFT.

  a_cold        engine A (kvshm, fresh segment): the prompts, first time (cold prefill)
  kvshm_same    engine A again after vLLM's device prefix cache is reset: hits on its own
                stores, through kvshm
  b_kvshm       engine B (kvshm, A's segment, started once A is done and idle): every
                prompt is a hit on A's prefill -- the headline figure
  b_recompute   an engine without offloading: the prompts are computed again
  cpu_cold      an engine with the private in-process CPU tier: the prompts, first time
  cpu_same      the same engine after its device prefix cache is reset: hits on its own
                stores, through its private CPU tier -- the comparator

Each of --rounds rounds runs the engines in alternating order (kvshm pair, none, cpu; then
cpu, none, kvshm pair), so that load from other processes hits all alike. Reported: each
figure's median, minimum and all values (ms), hit tokens per request, whether every engine produced
the same first token for each prompt, the ratios b_kvshm / cpu_same (goal <= 1.1),
b_recompute / b_kvshm and a_cold / b_kvshm, and the host's load average before and after.
"""

FIGURES = ("a_cold", "kvshm_same", "b_kvshm", "b_recompute", "cpu_cold", "cpu_same")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("--engines 2 (cross-engine TTFT)")
    g.add_argument("--shape", choices=("half-b", "tiny"), default="half-b",
                   help="model shape (default half-b: ~0.4B parameters)")
    g.add_argument("--prompt-tokens", type=int, default=2000,
                   help="tokens per prompt (default 2000)")
    g.add_argument("--block-size", type=int, default=32, help="tokens per block (32)")
    g.add_argument("--offload-bytes", type=int, default=1 << 30,
                   help="cpu_bytes_to_use of kvshm and of the CPU tier (1 GiB)")


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _model(shape: str, tmp: str) -> tuple[str, dict[str, Any]]:
    from tests.vllm_support.tiny_model import HALF_B, build_tiny_model
    if shape == "tiny":
        return build_tiny_model(os.path.join(tmp, "tiny-llama")), {"dtype": "float32"}
    return build_tiny_model(os.path.join(tmp, "half-b"), **HALF_B), dict(HALF_B)


def _passes(tag: str, prompts: list[list[int]]) -> list[dict[str, Any]]:
    return [{"op": "generate", "tag": f"{tag}{i}", "prompts": [p], "max_tokens": 1}
            for i, p in enumerate(prompts)]


class _Run:
    def __init__(self, args: argparse.Namespace, model: str, dtype: str, tmp: str):
        from tests.vllm_support import engine as E
        self.E, self.args, self.model, self.tmp = E, args, model, tmp
        n = args.prompt_tokens
        self.prompts = [E.random_prompt(500 + i, length=n) for i in range(args.prompts)]
        self.started = 0  # engines started: each warms up on a prompt of its own
        blocks = (n // args.block_size + 2) * (args.prompts + 1)  # the device holds them all
        self.llm = {"dtype": dtype, "block_size": args.block_size, "num_gpu_blocks": blocks,
                    "max_model_len": n + 64}
        self.values: dict[str, list[float]] = {f: [] for f in FIGURES}
        self.hit_tokens: dict[str, list[int]] = {f: [] for f in FIGURES}
        self.first: dict[str, list[list[int]]] = {f: [] for f in FIGURES}

    def _extra(self, kind: str, segment: str = "") -> dict | None:
        E, nbytes = self.E, self.args.offload_bytes
        if kind == "kvshm":
            return E.offload_extra_config("KvshmOffloadingSpec", "kvshm.integrations.vllm",
                                          kvshm_segment=segment, cpu_bytes_to_use=nbytes)
        if kind == "cpu":
            return E.offload_extra_config("TorchCPUSpec", "tests.vllm_support.toy_spec",
                                          cpu_bytes_to_use=nbytes)
        return None

    def _start(self, kind: str, steps: list[dict], segment: str = ""):
        """An engine process that first serves a warm-up prompt of its own twice (computed,
        then, after a device cache reset, from its offloading tier if it has one), so that
        every measured request runs on warm code paths, loads included."""
        E = self.E
        self.started += 1
        warm = E.random_prompt(10_000 + self.started, length=min(self.args.prompt_tokens, 256))
        gen = {"op": "generate", "tag": "warm", "prompts": [warm], "max_tokens": 1}
        reset = {"op": "reset_prefix_cache"}
        return E.start_engine_subprocess(
            E.engine_config(self.model, self._extra(kind, segment),
                            [gen, reset, {**gen, "tag": "warm2"}, reset] + steps,
                            llm_kwargs=self.llm), python=sys.executable, workdir=self.tmp)

    def _keep(self, res: dict[str, Any], tag: str, figure: str) -> None:
        for i in range(len(self.prompts)):
            step = res["steps"][f"{tag}{i}"]
            self.values[figure].append(step["seconds"])
            self.hit_tokens[figure].append(step["outputs"][0]["num_cached_tokens"])
            self.first[figure].append(step["outputs"][0]["token_ids"])

    def kvshm_pair(self) -> None:
        segment = f"bench-ttft-{uuid.uuid4().hex[:8]}"
        a_done = os.path.join(self.tmp, f"{segment}-a")
        b_done = os.path.join(self.tmp, f"{segment}-b")
        a = self._start("kvshm", _passes("cold", self.prompts) + [
            {"op": "reset_prefix_cache"}] + _passes("same", self.prompts) + [
            {"op": "touch", "path": a_done},
            {"op": "wait_file", "path": b_done, "timeout": 3600}], segment)
        b = None
        try:
            while not os.path.exists(a_done):  # B starts once A is done and idle
                if a.proc.poll() is not None:
                    a.result(1)  # raises with A's log
                time.sleep(0.2)
            b = self._start("kvshm", [{"op": "wait_file", "path": a_done}]
                            + _passes("hit", self.prompts)
                            + [{"op": "touch", "path": b_done}], segment)
            rb = b.result(3600)
            ra = a.result(600)
        finally:
            for p in (a, b):
                if p is not None:
                    p.kill()
            from kvshm.shm.segment import Segment
            Segment.unlink(segment)  # its owner exits by itself once the segment is gone
        self._keep(ra, "cold", "a_cold")
        self._keep(ra, "same", "kvshm_same")
        self._keep(rb, "hit", "b_kvshm")

    def none(self) -> None:
        self._keep(self._start("none", _passes("cold", self.prompts)).result(3600), "cold",
                   "b_recompute")

    def cpu(self) -> None:
        r = self._start("cpu", _passes("cold", self.prompts) + [{"op": "reset_prefix_cache"}]
                        + _passes("same", self.prompts)).result(3600)
        self._keep(r, "cold", "cpu_cold")
        self._keep(r, "same", "cpu_same")

    def report(self) -> dict[str, Any]:
        med = {f: statistics.median(v) for f, v in self.values.items() if v}
        out: dict[str, Any] = {"ttft_ms": {
            f: {"median": round(1e3 * med[f], 1), "min": round(1e3 * min(v), 1),
                "all": [round(1e3 * x, 1) for x in v]}
            for f, v in self.values.items() if v}}
        out["hit_tokens_per_request"] = {f: v for f, v in self.hit_tokens.items() if v}
        firsts = [v for v in self.first.values() if v]
        out["same_first_tokens"] = all(v == firsts[0] for v in firsts)
        out["b_kvshm_vs_cpu_same"] = round(med["b_kvshm"] / med["cpu_same"], 3)
        out["b_kvshm_vs_kvshm_same"] = round(med["b_kvshm"] / med["kvshm_same"], 3)
        out["b_recompute_vs_b_kvshm"] = round(med["b_recompute"] / med["b_kvshm"], 2)
        out["a_cold_vs_b_kvshm"] = round(med["a_cold"] / med["b_kvshm"], 2)
        return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The --engines 2 measurement; one JSON-able dict."""
    import shutil
    result: dict[str, Any] = {"tool": "bench_vllm", "engines": 2, "cpus": os.cpu_count(),
                              "loadavg_before": _loadavg(), "args": vars(args)}
    tmp = tempfile.mkdtemp(prefix="kvshm-bench-ttft-")
    try:
        model, shape = _model(args.shape, tmp)
        result["model"] = shape
        r = _Run(args, model, shape["dtype"], tmp)
        order = [r.kvshm_pair, r.none, r.cpu]
        for i in range(args.rounds):
            for step in (order if i % 2 == 0 else order[::-1]):
                step()
        result.update(r.report())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result["loadavg_after"] = _loadavg()
    return result


if __name__ == "__main__":  # a library: say what it is and who runs it
    import os.path
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from library_help import explain
    explain("bench_vllm_ttft.py", __doc__, instead="tools/bench_vllm.py")

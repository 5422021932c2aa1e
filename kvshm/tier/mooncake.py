"""Mooncake Store as kvshm's lower tier, and a helper that runs a local ``mooncake_master``.

This module owns the only code that imports ``mooncake`` (lazily, inside ``connect``), the
mapping of Mooncake's return codes onto ``Code``, and the command line of a master. It must
never be imported by an engine process or by ``kvshm-inspect`` (only the mover uses it), and
it never touches a segment.

Facts it relies on (mooncake-transfer-engine-non-cuda 0.3.13.post1, checked by the tests):

* ``setup`` joins the cluster and contributes ``global_segment_bytes`` of this host's memory
  to the distributed pool; that share goes when this client goes (a killed mover's keys still
  "exist" for ~10 s but fail to read: a failed get here, a miss for the engine).
* ``register_buffer`` works on a POSIX shm mapping: the segment's data region is registered
  once and blocks move straight between it and the store (``batch_put_from_multi_buffers``,
  ``batch_get_into_multi_buffers``: header + one page per plane, no staging copy).
* ``setup`` with an unreachable master retries ~20 times, ~4.5 s apart, holding the GIL all
  along (no other thread of the process runs, signal handlers included); so ``connect``
  first opens a TCP connection to the master and to an HTTP metadata server, and calls
  ``setup`` only when both accept one. A master that takes connections but does not answer
  (stopped, overloaded, a proxy in front) passes that check, and ``setup`` then holds the
  GIL for up to ~10 min (20 tries of a 30 s RPC timeout): the mover leaves its stop signals
  to the kernel while it connects (``link.py``).
* Calls return negative codes instead of raising; with the master down a call blocks ~4 s
  before -900, and after a master restart the client re-registers by itself within ~3 s (the
  store's content is gone). So nothing here reconnects: the mover backs off instead.
* The master's HTTP metadata server and this client's transfer engine listen on all
  addresses whatever ``--http_metadata_server_host`` says; the RPC and metrics ports follow
  ``--rpc_address``/``--metrics_host``. Firewall the metadata and transfer ports.
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvshm.errors import LowerTierUnavailableError
from kvshm.tier.api import Code, LowerTier

log = logging.getLogger(__name__)

PINNED = "mooncake-transfer-engine-non-cuda==0.3.13.post1"  # setup.cfg's [mooncake] extra
_REACH_S = 2.0  # a TCP connect to the master or metadata server not answered by then: unreachable
_INSTALL = ("pip install 'kvshm[mooncake]' (it pins " + PINNED + "), and on Debian/Ubuntu "
            "apt-get install libibverbs1 (the wheel loads it but does not declare it)")


@dataclass
class MooncakeConfig:
    """Where the cluster's master is and what this host contributes to it."""
    master: str                         # "host:port" of mooncake_master's RPC
    metadata: str                       # "http://host:port/metadata" (the master's, or etcd)
    local_host: str = "127.0.0.1"       # this host's address as other hosts reach it
    global_segment_bytes: int = 512 << 20  # this host's share of the distributed pool
    local_buffer_bytes: int = 64 << 20
    protocol: str = "tcp"               # "tcp", or "rdma" with ``devices``
    devices: str = ""


class MooncakeTier(LowerTier):
    """A ``MooncakeDistributedStore`` client. Not thread-safe: one thread at a time uses it
    (the mover's connect thread, then its loop)."""

    def __init__(self, cfg: MooncakeConfig) -> None:
        for what, v in (("global_segment_bytes", cfg.global_segment_bytes),
                        ("local_buffer_bytes", cfg.local_buffer_bytes)):
            if not isinstance(v, int) or v <= 0:
                raise LowerTierUnavailableError(f"Mooncake {what} must be a positive int, got "
                                                f"{v!r}")
        if ":" not in cfg.master:
            raise LowerTierUnavailableError(f"Mooncake master address {cfg.master!r} is not "
                                            "host:port")
        self.cfg = cfg
        self.description = f"mooncake master {cfg.master} ({cfg.protocol})"
        self._store: Any = None  # the Mooncake client once connected (an untyped module)

    def connect(self) -> bool:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:  # the package, or libibverbs.so.1 it loads
            raise LowerTierUnavailableError(f"cannot load Mooncake ({e}); {_INSTALL}") from None
        c = self.cfg
        if (why := self._unreachable()) is not None:
            log.warning("Mooncake %s; retrying later", why)
            return False
        store = MooncakeDistributedStore()
        rc = store.setup(c.local_host, c.metadata, c.global_segment_bytes,
                         c.local_buffer_bytes, c.protocol, c.devices, c.master)
        if rc != 0:
            log.warning("Mooncake setup with master %s failed (code %s); retrying later",
                        c.master, rc)
            try:
                store.close()
            except Exception:  # a half-set-up client: nothing more to release
                pass
            return False
        self._store = store
        return True

    def _unreachable(self) -> str | None:
        """Why the master or the HTTP metadata server takes no TCP connection now (None:
        both do). A socket waits without the GIL, unlike ``setup``."""
        where = [("master", self.cfg.master)]
        meta = urlsplit(self.cfg.metadata)
        if meta.scheme in ("http", "https") and meta.hostname:  # (etcd and others: setup's)
            try:
                port = meta.port or (443 if meta.scheme == "https" else 80)
            except ValueError as e:
                return f"metadata URL {self.cfg.metadata!r}: {e}"
            where.append(("metadata server", f"{meta.hostname}:{port}"))
        for what, addr in where:
            host, _, port_text = addr.rpartition(":")
            try:
                socket.create_connection((host.strip("[]"), int(port_text)), _REACH_S).close()
            except (OSError, ValueError) as e:
                return f"{what} {addr} unreachable ({e})"
        return None

    def register(self, address: int, length: int) -> bool:
        rc = self._store.register_buffer(address, length)
        if rc != 0:
            log.warning("Mooncake register_buffer(%#x, %d) failed (code %s)", address, length, rc)
        return rc == 0

    def exists(self, keys: Sequence[str]) -> list[Code]:
        out = self._store.batch_is_exist(list(keys))
        return [Code.OK if r == 1 else Code.NOT_FOUND if r == 0 else Code.of(min(r, -1))
                for r in out]  # 1/0: present/absent; below 0 an error code

    def put(self, keys: Sequence[str], buffers: Sequence[Sequence[tuple[int, int]]]) -> list[Code]:
        rcs = self._store.batch_put_from_multi_buffers(
            list(keys), [[a for a, _ in b] for b in buffers], [[n for _, n in b] for b in buffers])
        return [Code.of(r) for r in rcs]

    def get(self, keys: Sequence[str], buffers: Sequence[Sequence[tuple[int, int]]]) -> list[int]:
        return list(self._store.batch_get_into_multi_buffers(
            list(keys), [[a for a, _ in b] for b in buffers], [[n for _, n in b] for b in buffers]))

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


# --- a local master (tests, examples, single-machine trials) ------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the master binds it moments later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Master:
    """A ``mooncake_master`` this process started (master and HTTP metadata in one)."""
    proc: subprocess.Popen
    host: str
    rpc_port: int
    metadata_port: int
    metrics_port: int

    @property
    def config(self) -> MooncakeConfig:
        return MooncakeConfig(master=f"{self.host}:{self.rpc_port}",
                              metadata=f"http://{self.host}:{self.metadata_port}/metadata",
                              local_host=self.host)

    def args(self) -> list[str]:
        """``kvshm mover`` arguments that point at this master."""
        c = self.config
        return ["--master", c.master, "--metadata", c.metadata, "--local-host", c.local_host]

    def mover_command(self, name: str, *extra: str) -> list[str]:
        """The command line of a ``kvshm mover`` of segment ``name`` served by this master,
        run by this Python (``extra``: more ``kvshm mover`` options)."""
        return [sys.executable, "-m", "kvshm.cli", "mover", name, *self.args(), *extra]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def master_binary() -> str | None:
    return shutil.which("mooncake_master")


def start_master(host: str = "127.0.0.1", log_path: str | None = None,
                 ports: tuple[int, int, int] | None = None) -> Master:
    """Start ``mooncake_master`` on free ports of ``host`` (or ``ports``: rpc, metadata,
    metrics) with its HTTP metadata server, so no etcd is needed. It is ready ~2 s later;
    clients that come earlier fail their setup and retry."""
    exe = master_binary()
    if exe is None:
        raise LowerTierUnavailableError(f"no mooncake_master on PATH; {_INSTALL}")
    rpc, meta, metrics = ports or (free_port(host), free_port(host), free_port(host))
    cmd = [exe, f"--rpc_address={host}", f"--rpc_port={rpc}",
           "--enable_http_metadata_server=true", f"--http_metadata_server_host={host}",
           f"--http_metadata_server_port={meta}", f"--metrics_host={host}",
           f"--metrics_port={metrics}"]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL,
                                env={**os.environ, "GLOG_logtostderr": "1"})
    finally:
        if not isinstance(out, int):  # a log file we opened (DEVNULL is an int)
            out.close()
    return Master(proc, host, rpc, meta, metrics)

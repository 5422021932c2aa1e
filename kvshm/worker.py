"""Worker-side connector: runs the jobs a scheduler connector built, reports them finished.

This module owns the worker's half of the job protocol: it submits jobs to a transfer handler
(a job the handler refuses fails cleanly instead of raising into the engine), flushes (waits
for) jobs whose device blocks are about to be reused, and reports ``(job_id, success)``. In a
worker process, ``serve(channel)`` does the same for jobs arriving on a kvshm job channel.

Stores are submitted when they arrive. The scheduler side sends a step's stores only after
that step's KV was written (the ordering vLLM gets by deferring stores to the next step); on
CUDA the handler additionally orders each store after the submitting thread's current stream.

It never talks to the manager (the scheduler completes jobs there) and imports torch only
through the handler it is given.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING, Iterable

from .errors import KvshmError
from .transfer import TransferHandler, TransferResult

if TYPE_CHECKING:
    from .channel import WorkerChannel
    from .connector import Job

log = logging.getLogger(__name__)


class WorkerConnector:
    """One worker's job runner over one transfer handler."""

    def __init__(self, handler: TransferHandler, channel: "WorkerChannel | None" = None) -> None:
        self.handler = handler
        self.channel = channel
        self._lock = threading.Lock()
        self._failed: list[TransferResult] = []
        # kind -> [jobs, failed jobs, bytes, seconds], for the engine's statistics
        self.stats: dict[str, list[float]] = {"load": [0, 0, 0, 0.0], "store": [0, 0, 0, 0.0]}

    def submit(self, jobs: Iterable["Job"]) -> None:
        """Queue jobs on the handler; one it rejects is reported failed by the next poll."""
        for job in jobs:
            try:
                ok = self.handler.transfer_async(job.job_id, job.spec)
            except KvshmError as e:  # bad ids, duplicate job, handler shut down
                log.error("kvshm worker: job %d (%s) rejected: %s", job.job_id, job.spec.kind, e)
                ok = False
            if not ok:
                with self._lock:
                    self._failed.append(TransferResult(job.job_id, False, 0, 0.0, job.spec.kind))

    def flush(self, job_ids: Iterable[int]) -> None:
        """Return once those jobs are finished (their device blocks may then be reused)."""
        self.handler.wait(list(job_ids))

    def results(self) -> list[TransferResult]:
        """Finished jobs since the last call, with sizes and times."""
        with self._lock:
            out, self._failed = self._failed, []
        out += self.handler.get_finished()
        for r in out:
            s = self.stats.setdefault(r.kind, [0, 0, 0, 0.0])
            s[0] += 1
            s[1] += not r.success
            s[2] += r.nbytes
            s[3] += r.seconds
        return out

    def poll(self) -> list[tuple[int, bool]]:
        """``(job_id, success)`` of every job finished since the last call."""
        return [(r.job_id, r.success) for r in self.results()]

    # --- worker process ----------------------------------------------------------------
    def serve(self, channel: "WorkerChannel | None" = None) -> None:
        """Run jobs from ``channel`` until the scheduler sends Stop or goes away.

        The calling thread receives and submits; a reporter thread waits for jobs in
        submission order and publishes their completions (it is the only producer of the
        completion ring, which is single-producer).
        """
        from .channel import Flush, JobFrame, Stop
        channel = channel or self.channel
        if channel is None:
            raise KvshmError("serve() needs a WorkerChannel")
        todo: queue.SimpleQueue = queue.SimpleQueue()
        reporter = threading.Thread(target=self._report, args=(channel, todo),
                                    name="kvshm-worker-report", daemon=True)
        reporter.start()
        try:
            while True:
                msgs = channel.recv(timeout=0.2)
                if msgs is None:
                    log.warning("kvshm worker: scheduler of channel %d is gone; exiting",
                                channel.slot)
                    return
                for m in msgs:
                    if isinstance(m, Stop):
                        return
                    if isinstance(m, Flush):
                        self.flush(m.job_ids)  # before any later job touches those blocks
                    elif isinstance(m, JobFrame):
                        self.submit([m.to_job()])
                        todo.put(m.job_id)
        finally:
            todo.put(None)
            reporter.join()

    def _report(self, channel: "WorkerChannel", todo: queue.SimpleQueue) -> None:
        while True:
            job_id = todo.get()
            if job_id is not None:
                self.handler.wait([job_id])
            done = self.results()
            if done and not channel.send_done(done):
                return  # scheduler gone: nobody to tell
            if job_id is None:
                return

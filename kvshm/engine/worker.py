"""Worker-side connector: runs the jobs a scheduler connector built, reports them finished.

This module owns the worker's half of the job protocol: it submits jobs to a transfer handler
(a job the handler refuses fails cleanly instead of raising into the engine), flushes (waits
for) jobs whose device blocks are about to be reused, and reports ``(job_id, success)``. In a
worker process, ``serve(channel)`` does the same for jobs arriving on a kvshm job channel.
A job id reports once: a second job under an id whose copy still runs, or whose failure is
not yet reported, is dropped, so the scheduler never takes that refusal for the running job's
end, nor a failure for a job whose copy then runs.
A frame the channel could not read (``frames.Broken``) fails the job it names, if it names
one, once every running copy has finished: it may have been a Flush.

Stores are submitted when they arrive. The scheduler side sends a step's stores only after
that step's KV was written (the ordering vLLM gets by deferring stores to the next step); on
CUDA the handler additionally orders each store after the submitting thread's current stream.

A worker may outlive its scheduler. When it knows the segment (``segment=`` or the channel's),
it copies for a scheduler's manager slot only while registered under that slot and generation
(``kvshm.shm.writers``): it registers before admitting the first job of a generation, refuses
(reports failed, copies nothing) any job of a generation that is dead, stays registered while
that generation's copies are in flight, and unregisters once the generation is dead and its
copies finished. Meanwhile the owner keeps the dead scheduler's WRITING blocks out of reach.

It never talks to the manager (the scheduler completes jobs there) and imports torch only
through the handler it is given.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvshm.errors import KvshmError
from kvshm.shm import writers
from kvshm.transfer.spec import TransferHandler, TransferResult

if TYPE_CHECKING:
    from kvshm.engine.channel import WorkerChannel
    from kvshm.engine.connector import Job
    from kvshm.engine.frames import JobFrame
    from kvshm.shm.segment import Segment

log = logging.getLogger(__name__)


class WorkerConnector:
    """One worker's job runner over one transfer handler."""

    def __init__(self, handler: TransferHandler, channel: WorkerChannel | None = None, *,
                 segment: Segment | None = None) -> None:
        self.handler = handler
        self.channel = channel
        self._lock = threading.Lock()
        self._failed: list[TransferResult] = []
        seg = segment if segment is not None else channel.segment if channel else None
        # Without the segment (a worker inside its scheduler's process) jobs are not
        # checked: such a worker cannot outlive its scheduler.
        self._writers = writers.Registrations(seg) if seg is not None else None
        self._inflight: dict[int, tuple[int, int]] = {}  # job id -> writer it copies for
        # jobs the handler took and has not reported: their ids are taken, and a second job
        # or a failure under one of them would be reported as the first's completion
        self._running: set[int] = set()
        # kind -> [jobs, failed jobs, bytes, seconds], for the engine's statistics
        self.stats: dict[str, list[float]] = {"load": [0, 0, 0, 0.0], "store": [0, 0, 0, 0.0]}

    def submit(self, jobs: Iterable[Job]) -> None:
        """Queue jobs on the handler; one it rejects is reported failed by the next poll."""
        for job in jobs:
            with self._lock:  # running, or failed and not yet reported: that report stands
                taken = job.job_id in self._running or \
                    any(r.job_id == job.job_id for r in self._failed)
            if taken:
                log.error("kvshm worker: job %d came again before its report; the second is "
                          "dropped (job ids must be unique among unfinished jobs)", job.job_id)
                continue
            writer = getattr(job, "writer", None)
            if writer is not None and self._writers is not None:
                # Admit and count the job in one step under the lock: retire() must never
                # unregister a generation between its admission and its copy.
                with self._lock:
                    ok = self._writers.admit(*writer)
                    if ok:
                        self._inflight[job.job_id] = writer
                if not ok:
                    log.warning("kvshm worker: job %d (%s) refused: its scheduler (client "
                                "slot %d generation %d) is gone", job.job_id, job.spec.kind,
                                *writer)
                    self._fail(job.job_id, job.spec.kind)
                    continue
            with self._lock:  # before the copy: the reporter may see it finish at once
                self._running.add(job.job_id)
            try:
                ok = self.handler.transfer_async(job.job_id, job.spec)
            except KvshmError as e:  # bad ids, duplicate job, handler shut down
                log.error("kvshm worker: job %d (%s) rejected: %s", job.job_id, job.spec.kind, e)
                ok = False
            if not ok:
                with self._lock:
                    self._running.discard(job.job_id)
                self._fail(job.job_id, job.spec.kind)

    def _fail(self, job_id: int, kind: str) -> None:
        """Report ``job_id`` failed at the next poll, no copy of it admitted; never while a
        job of that id runs (its own report stands)."""
        with self._lock:
            if job_id in self._running:
                return
            self._inflight.pop(job_id, None)
            self._failed.append(TransferResult(job_id, False, 0, 0.0, kind))

    def _open(self) -> list[int]:
        """Jobs the handler took and has not reported."""
        with self._lock:
            return list(self._running)

    def flush(self, job_ids: Iterable[int]) -> None:
        """Return once those jobs are finished (their device blocks may then be reused)."""
        self.handler.wait(list(job_ids))

    def results(self) -> list[TransferResult]:
        """Finished jobs since the last call, with sizes and times."""
        with self._lock:
            out, self._failed = self._failed, []
        finished = self.handler.get_finished()
        with self._lock:  # (a failure is never of a running job: its id may run again now)
            self._running.difference_update(r.job_id for r in finished)
        out += finished
        if self._writers is not None:
            with self._lock:  # finished copies no longer write: their writers may retire
                for r in out:
                    self._inflight.pop(r.job_id, None)
                self._writers.retire(set(self._inflight.values()))
        for r in out:
            s = self.stats.setdefault(r.kind, [0, 0, 0, 0.0])
            s[0] += 1
            s[1] += not r.success
            s[2] += r.nbytes
            s[3] += r.seconds
        return out

    def retire(self) -> None:
        """Unregister from dead schedulers whose copies are done (the serve loop calls this)."""
        if self._writers is not None:
            with self._lock:
                self._writers.retire(set(self._inflight.values()))

    def close(self) -> None:
        """Wait for every admitted copy, then drop every registration."""
        if self._writers is not None:
            with self._lock:
                ids = list(self._inflight)
            self.handler.wait(ids)  # nothing may still write once we unregister
            with self._lock:
                self._inflight.clear()
                self._writers.close()

    def poll(self) -> list[tuple[int, bool]]:
        """``(job_id, success)`` of every job finished since the last call."""
        return [(r.job_id, r.success) for r in self.results()]

    # --- worker process ----------------------------------------------------------------
    def serve(self, channel: WorkerChannel | None = None) -> None:
        """Run jobs from ``channel`` until the scheduler sends Stop or goes away.

        The calling thread receives and submits; a reporter thread waits for jobs in
        submission order and publishes their completions (it is the only producer of the
        completion ring, which is single-producer).
        """
        from kvshm.engine.frames import Broken, Flush, JobFrame, Stop
        channel = channel or self.channel
        if channel is None:
            raise KvshmError("serve() needs a WorkerChannel")
        if self._writers is None:
            self._writers = writers.Registrations(channel.segment)
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
                        self._submit_frame(m)  # refused if its scheduler is dead
                        todo.put(m.job_id)
                    elif isinstance(m, Broken):
                        # It may have been a Flush: copies still running may read or write
                        # blocks the next jobs use, so they finish first.
                        self.flush(self._open())
                        if m.job_id is not None:
                            self._fail(m.job_id, m.kind)
                            todo.put(m.job_id)
                self.retire()
        finally:
            todo.put(None)
            reporter.join()
            self.close()  # the reporter may have stopped early: wait for the copies here

    def _submit_frame(self, m: JobFrame) -> None:
        """Submit the job a frame carries; one that is no job (such as an unknown kind) fails
        alone, reported like a job the handler refused."""
        try:
            job = m.to_job()
        except KvshmError as e:
            log.error("kvshm worker: job %d (%s) rejected: %s", m.job_id, m.kind, e)
            self._fail(m.job_id, str(m.kind))
            return
        self.submit([job])

    def _report(self, channel: WorkerChannel, todo: queue.SimpleQueue) -> None:
        while True:
            job_id = todo.get()
            if job_id is not None:
                self.handler.wait([job_id])
            done = self.results()
            if done and not channel.send_done(done):
                return  # scheduler gone: nobody to tell
            if job_id is None:
                return

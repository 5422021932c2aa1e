"""Job channel between an engine's scheduler and one of its worker processes, on kvshm rings.

For engines whose scheduler and workers are separate processes and that have no channel of
their own. The scheduler claims a client slot of the segment and marks it CHANNEL; that slot's
``peer_in`` ring carries jobs (scheduler produces), ``peer_out`` carries completions (worker
produces), each with a doorbell. The worker attaches by (segment name, slot, generation): a
worker started for a scheduler that died never attaches to the next channel of its slot.

Liveness is the kernel's, as everywhere in kvshm: the scheduler holds the slot's lock, the
worker holds ``WORKER_LOCK_BASE + slot``. A worker's first frame says it attached (naming the
generation); once the scheduler read it, a free worker lock means the worker died: every job
outstanding on the channel is reported failed, so the scheduler connector frees the stores
and releases the loads, whether or not the scheduler looked while the worker lived. A worker
whose scheduler died exits.
Every job frame names the scheduler's manager slot and generation: the worker refuses a job
of a generation that is dead, even one still queued here (see ``kvshm.shm.writers``).
When the scheduler dies, the owner reclaims the slot (clears it to FREE).

It owns the rings' two ends and liveness; the frames and their reading are ``frames``'s, and
it knows nothing about what jobs mean.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence

from kvshm.engine.frames import (
    Attached,
    Broken,
    Done,
    Flush,
    JobFrame,
    JobReader,
    Stop,
    encoder,
    named_job,
    to_scheduler,
)
from kvshm.errors import ClientSlotsExhaustedError, InvalidArgumentError, TransferError
from kvshm.shm import layout as L
from kvshm.shm import locks, slots
from kvshm.shm.ring import Doorbell, Ring
from kvshm.shm.segment import Segment
from kvshm.transfer.spec import TransferResult, TransferSpec

log = logging.getLogger(__name__)
WORKER_LOCK_BASE = L.LOCK_CLIENT_BASE + 1024  # + slot: held by the channel's worker
MAX_IDS_PER_FRAME = 2048  # bigger jobs travel in several frames, fewer where rings are small
# A JobFrame's bytes besides its ids, and the most an id takes (msgpack: a 64-bit int)
FRAME_OVERHEAD, ID_BYTES = 128, 9


class _Ends:
    """The two rings and doorbells of a channel slot, as seen from one side."""

    def __init__(self, seg: Segment, slot: int):
        self.jobs = Ring(slots.ring_view(seg, slot, "peer_in"))
        self.done = Ring(slots.ring_view(seg, slot, "peer_out"))
        self.jobs_bell = Doorbell(slots.bell_view(seg, slot, "peer_in"))
        self.done_bell = Doorbell(slots.bell_view(seg, slot, "peer_out"))

    def close(self) -> None:
        for r in (self.jobs, self.done):
            r.close()
        self.jobs_bell.close()
        self.done_bell.close()


def _put(ring: Ring, frame: bytes, alive, drain=None, timeout: float = 30.0) -> bool:
    """Put ``frame``, waiting for room while the peer lives. False if the peer is gone."""
    deadline = time.monotonic() + timeout
    delay = 1e-5
    while not ring.try_put(frame):
        if drain is not None:
            drain()  # our peer may be blocked on our other ring: keep it moving
        if not alive():
            return False
        if time.monotonic() > deadline:
            raise TransferError(f"job channel ring stayed full for {timeout:g}s; its consumer "
                                "is alive but not draining it")
        time.sleep(delay)  # backoff while the consumer drains, bounded by the deadline
        delay = min(2 * delay, 1e-3)
    return True


class SchedulerChannel:
    """The scheduler's end: send jobs, receive completions, notice a dead worker.

    One thread at a time: the job ring has one producer, and a worker takes a frame of
    another job amid a job's frames for the end of that job's sending (``frames.py``).
    ``send`` fails exactly the jobs it could not send whole, whatever exception ends it.
    What no code here can make whole is the hand-over of a completion: a signal handler's
    exception inside ``poll``, ``wait`` or the draining ``send`` does while it waits for
    room (or in the caller, before it stored what ``poll`` returned) may lose other jobs'
    reports. After one, stop using the channel, and take each job it did not report as still
    copying until its worker is gone: failing a store frees its blocks at once.
    """

    def __init__(self, segment_name: str, *, timeout: float = 30.0) -> None:
        self.seg = Segment.attach(segment_name)
        self.timeout = timeout
        try:  # the segment's descriptor holds our slot's lock: close it on any failure
            self.slot, self.gen = self._claim(timeout)
            slots.activate(self.seg, self.slot, self.gen, state=L.SlotState.CHANNEL)
            self._ends = _Ends(self.seg, self.slot)
        except BaseException:
            self.seg.close()
            raise
        self._outstanding: dict[int, str] = {}  # job id -> kind
        self._received: list[Done] = []
        self._worker_seen = False  # its Attached frame came: a free worker lock is a death
        self._worker_lost = False

    def _claim(self, timeout: float) -> tuple[int, int]:
        """``slots.claim``, but skipping slots whose previous worker still holds on: it may
        still be draining completions into that slot's rings (and, as ``slots.claim``, slots
        an owner still serves)."""
        g, fd = self.seg.geometry, self.seg.fd
        deadline = time.monotonic() + timeout
        while True:
            for slot in range(g.max_clients):
                if locks.is_held(fd, WORKER_LOCK_BASE + slot):
                    continue
                gen = slots.lock_free(self.seg, slot)
                if gen is not None:
                    return slot, gen
            if time.monotonic() > deadline:
                raise ClientSlotsExhaustedError(
                    f"no free client slot in segment {self.seg.name!r} for a job channel; "
                    "close unused clients or create the segment with more max_clients")
            time.sleep(0.05)  # dead clients' slots go FREE when the owner reclaims them

    @property
    def address(self) -> tuple[str, int, int]:
        """What a worker passes to ``WorkerChannel``: (segment name, slot, generation)."""
        return self.seg.name, self.slot, self.gen

    # --- liveness ----------------------------------------------------------------------
    def worker_alive(self) -> bool:
        """Whether our worker is attached now: it said so, and it holds its lock (never
        again once it was lost: a channel has one worker)."""
        if not self._worker_seen:
            self._drain()
        return self._worker_seen and not self._worker_lost and \
            locks.is_held(self.seg.fd, WORKER_LOCK_BASE + self.slot)

    def wait_worker(self, timeout: float = 60.0,
                    starting: Callable[[], bool] = lambda: True) -> None:
        """Return once a worker attached. Raises TransferError after ``timeout``, or as soon
        as ``starting()`` (e.g. the worker process's ``is_alive``) turns False, or the
        channel's worker is lost (none other ever attaches)."""
        deadline = time.monotonic() + timeout
        while not self.worker_alive():
            if self._worker_seen:  # attached, and gone
                self._check_worker()  # (its jobs fail)
                raise TransferError(f"the worker of job channel {self.address} was lost; "
                                    "a channel takes one worker: open a new channel")
            if not starting() or time.monotonic() > deadline:
                raise TransferError(f"no worker attached to job channel {self.address} "
                                    f"({'it exited' if not starting() else f'{timeout:g}s'}); "
                                    "check the worker process's output")
            time.sleep(0.005)  # polling a kernel lock while the worker starts, bounded

    def _check_worker(self) -> bool:
        """False once a worker that was alive is gone (then every outstanding job fails)."""
        if not self._worker_lost:
            if self.worker_alive() or not self._worker_seen:
                return True
            self._drain()  # completions it published before dying still count
            self._worker_lost = True
        self._received += [Done(j, False) for j in self._outstanding]
        self._outstanding.clear()
        return False

    # --- sending -------------------------------------------------------------------------
    def _ids_per_frame(self) -> int:
        """Ids a frame may carry: two lists of them must fit the ring's largest frame."""
        room = (Ring.max_payload(self._ends.jobs.capacity) - FRAME_OVERHEAD) // (2 * ID_BYTES)
        return max(1, min(MAX_IDS_PER_FRAME, room))

    def send(self, jobs: Sequence) -> None:
        """Send ``Job``s (from the scheduler connector); after the worker died they fail.

        Should sending raise (the ring stayed full past the timeout, an interrupt at any step),
        every job given whose last frame did not enter the ring fails here, reported as the
        others are, before the error goes on: it can never run, and its report is this
        side's alone (the worker drops the parts it has, reporting nothing). A job whose id is
        still in flight keeps that job's report. (A sequence: the jobs of an iterator an
        interrupt cut short could not all be failed.)"""
        # Where the sending is, for an exception at any step (a signal handler's may come at
        # any): ``whole`` jobs went whole into the ring (or failed with their worker); job
        # ``at`` is under way, ``ours`` if this send puts it in _outstanding, ``before_last``
        # the ring's tail before its last frame (None: not reached yet), and ``mark`` the
        # reports there were when it began (a lost worker's may have reported it since).
        whole, at, ours, before_last, mark = 0, -1, None, None, 0
        began = len(self._received)  # (reports since: a lost worker's, of jobs in flight)
        try:
            n = self._ids_per_frame()
            jobs = list(jobs)
            for k, job in enumerate(jobs):
                at, ours, before_last, mark = (
                    k, None if job.job_id in self._outstanding else job, None,
                    len(self._received))
                spec: TransferSpec = job.spec
                dev, seg = list(spec.device_block_ids), list(spec.segment_block_ids)
                self._outstanding[job.job_id] = spec.kind
                wslot, wgen = getattr(job, "writer", None) or (-1, 0)
                parts = max(1, -(-max(len(dev), len(seg)) // n))
                for i in range(parts):
                    sl = slice(i * n, (i + 1) * n)
                    if i == parts - 1:
                        before_last = self._ends.jobs.tail
                    if not self._send(JobFrame(job.job_id, spec.kind, dev[sl], seg[sl],
                                               i == parts - 1, spec.skip, wslot, wgen, i)):
                        break  # the worker is gone: the job is already reported failed
                whole = k + 1
        except BaseException:
            if at == whole and before_last is not None and self._ends.jobs.tail != before_last:
                whole += 1  # its last frame entered the ring: the worker runs it and reports
            elif at == whole and ours is not None and any(
                    d.job_id == ours.job_id for d in self._received[mark:]):
                whole += 1  # its worker was lost meanwhile, which reported it failed
            self._fail_unsent(jobs[whole:] if isinstance(jobs, Sequence) else [],
                              ours if at == whole else None, began)
            raise

    def _fail_unsent(self, jobs: Sequence, ours: object, began: int) -> None:
        """Fail jobs whose last frame never entered the ring (the worker can never run them),
        their blocks going back; ``ours``: the first of them, if this send put (or was
        putting) it in ``_outstanding``. Any other whose id is outstanding, or was reported
        since the send ``began`` (a lost worker's failures), is a job in flight under that
        id: its report stands."""
        reported = {d.job_id for d in self._received[began:]}
        failed: set[int] = set()
        for job in jobs:
            j = job.job_id
            if j in failed or (job is not ours and (j in self._outstanding or j in reported)):
                continue
            self._outstanding.pop(j, None)
            self._received.append(Done(j, False))
            failed.add(j)

    def flush(self, job_ids: Iterable[int]) -> None:
        """Ask the worker to finish these jobs before it takes any later one."""
        ids, n = [j for j in job_ids if j in self._outstanding], self._ids_per_frame()
        for i in range(0, len(ids), n):  # (the worker waits for each part's jobs in turn)
            if not self._send(Flush(ids[i:i + n])):
                break

    def stop(self) -> None:
        """Tell the worker to finish what it has and exit."""
        self._send(Stop())

    def _send(self, frame: JobFrame | Flush | Stop) -> bool:
        if not self._check_worker():
            return False
        ok = _put(self._ends.jobs, encoder.encode(frame), self._check_worker, self._drain,
                  self.timeout)
        self._ends.jobs_bell.ring()
        return ok

    # --- receiving -----------------------------------------------------------------------
    def _drain(self) -> None:
        ring = self._ends.done
        while (frame := ring.try_get()) is not None:
            try:
                d = to_scheduler.decode(frame)
            except Exception as e:  # its job, if it names one, failed (DecodeError and more)
                job_id, _ = named_job(frame, "Done")
                log.error("kvshm: undecodable completion from the worker of job channel "
                          "%d (%s); job %s counts as failed", self.slot, e, job_id)
                if job_id is None:
                    continue
                d = Done(job_id, False)
            if isinstance(d, Attached):
                self._worker_seen |= d.gen == self.gen
            elif self._outstanding.pop(d.job_id, None) is not None:
                self._received.append(d)

    def poll(self) -> list[Done]:
        """Completions since the last call (failed ones for a worker that died)."""
        self._drain()
        self._check_worker()
        out, self._received = self._received, []
        return out

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> list[Done]:
        """Block until ``job_ids`` are complete; returns every completion received meanwhile."""
        want = set(job_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        got: list[Done] = []
        while True:
            got += self.poll()
            if not want & self._outstanding.keys():
                return got
            if deadline is not None and time.monotonic() > deadline:
                raise TransferError(f"jobs {sorted(want & self._outstanding.keys())} not done "
                                    f"within {timeout:g}s")
            self._ends.done_bell.wait(0.1, self._ends.done.pending)

    def outstanding(self) -> dict[int, str]:
        return dict(self._outstanding)

    def close(self) -> None:
        """Give the slot back (the worker notices and exits)."""
        if self.seg is None:
            return
        self._ends.close()
        slots.release(self.seg, self.slot, self.gen)
        self.seg.close()
        self.seg = None  # type: ignore[assignment]

    def __enter__(self) -> SchedulerChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WorkerChannel:
    """The worker's end: receive jobs, publish completions, notice a dead scheduler."""

    def __init__(self, segment_name: str, slot: int, gen: int) -> None:
        """Attach to the channel at ``SchedulerChannel.address``."""
        self.seg = Segment.attach(segment_name)
        self.slot, self.gen = slot, gen
        try:
            if not 0 <= slot < self.seg.geometry.max_clients:
                raise InvalidArgumentError(f"slot {slot} is out of range")
            self._check_channel()
            if not locks.try_lock(self.seg.fd, WORKER_LOCK_BASE + slot):
                raise InvalidArgumentError(f"job channel {slot} already has a worker")
            self._check_channel()  # again, ours now: its scheduler may have died meanwhile
            self._ends = _Ends(self.seg, slot)
            if self._ends.done.tail:  # a worker attached before us (its first frame): the
                raise InvalidArgumentError(  # jobs it left were failed, their blocks reused
                    f"job channel {slot} generation {gen} had a worker already, which is "
                    "gone; its scheduler failed the jobs it left: open a new channel")
            _put(self._ends.done, encoder.encode(Attached(gen)), self.scheduler_alive)
            self._ends.done_bell.ring()
        except BaseException:  # its descriptor may hold the worker lock: close it
            if "_ends" in self.__dict__:
                self._ends.close()
            self.seg.close()
            raise
        self._ends.jobs_bell.reset()
        self._reader = JobReader()

    def _check_channel(self) -> None:
        rec = slots.record(self.seg, self.slot)
        if rec.state != L.SlotState.CHANNEL:
            raise InvalidArgumentError(
                f"slot {self.slot} of segment {self.seg.name!r} is not a job channel (state "
                f"{rec.state}); pass the address SchedulerChannel.address gave")
        if rec.gen != self.gen:
            raise InvalidArgumentError(
                f"the scheduler of job channel {self.slot} generation {self.gen} is gone "
                f"(the slot now holds generation {rec.gen}); this worker has nothing to serve")

    @property
    def segment(self) -> Segment:
        """The mapped segment (its planes are what the worker's handler copies to)."""
        return self.seg

    def scheduler_alive(self) -> bool:
        rec = slots.record(self.seg, self.slot)
        return rec.state == L.SlotState.CHANNEL and rec.gen == self.gen and \
            locks.is_held(self.seg.fd, L.LOCK_CLIENT_BASE + self.slot)

    def recv(self, timeout: float) -> list[JobFrame | Flush | Stop | Broken] | None:
        """Frames waiting now (after up to ``timeout`` s), a job sent in several frames as one,
        a frame it could not take as ``Broken``; None once the scheduler is gone."""
        ends = self._ends
        if not ends.jobs_bell.wait(timeout, ends.jobs.pending, spin_s=50e-6):
            return [] if self.scheduler_alive() else None
        out: list[JobFrame | Flush | Stop | Broken] = []
        while (frame := ends.jobs.try_get()) is not None:
            out += self._reader.read(frame)
        return out

    def send_done(self, results: Sequence[TransferResult]) -> bool:
        """Publish completions; False if the scheduler is gone."""
        if not self.scheduler_alive():
            return False  # its slot may be someone else's soon: write nothing more
        for r in results:
            frame = encoder.encode(Done(r.job_id, r.success, r.nbytes, r.seconds))
            if not _put(self._ends.done, frame, self.scheduler_alive, timeout=3600.0):
                return False
        self._ends.done_bell.ring()
        return True

    def close(self) -> None:
        if self.seg is None:
            return
        self._ends.close()
        locks.unlock(self.seg.fd, WORKER_LOCK_BASE + self.slot)
        self.seg.close()
        self.seg = None  # type: ignore[assignment]

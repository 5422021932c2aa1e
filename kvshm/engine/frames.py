"""The job channel's frames, and how a worker turns the frames it reads into whole jobs.

This module owns the wire format between an engine's scheduler and its worker (msgspec,
tagged, array_like: a frame is ``[tag, field, ...]``) and the worker's reading of it:
``JobReader`` decodes frames, joins a job sent in several frames, and turns what it cannot
read into ``Broken`` (a job to fail, never to run).

It must never hand the worker a job with blocks missing: a job whose frames arrive with a gap
(one lost to an undecodable frame) is broken, and every later frame of it is dropped; a frame
naming no job breaks every job still being joined (it may have been any one's next or last
part: none may wait for it forever). A job another frame cuts short (a scheduler sends a
job's frames one after another: its sending failed partway, and the rest never comes) is
dropped unreported, as its scheduler failed it: one report per job, whoever makes it. A
broken job is handed over once. It must never raise on a frame, whatever its bytes, and
never guess a job id a frame does not carry.
It knows nothing about what jobs mean, and nothing about rings or liveness (``channel``).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Literal, cast

import msgspec

from kvshm.transfer.spec import TransferSpec

if TYPE_CHECKING:  # (the connector imports the channel, which imports this module)
    from kvshm.engine.connector import Job

log = logging.getLogger(__name__)


# Frozen, and every subclass says so again: type checkers do not inherit the option.
class _Frame(msgspec.Struct, tag=True, array_like=True, frozen=True):
    pass


class JobFrame(_Frame, tag="Job", frozen=True):
    job_id: int
    kind: str
    device: list[int]
    segment: list[int]
    last: bool = True  # False: more ids of this job follow in the next frame
    skip: int | None = None  # TransferSpec.skip
    writer_slot: int = -1  # Job.writer: the scheduler's manager slot (-1: none) ...
    writer_gen: int = 0  # ... and its generation; the worker refuses a dead generation's job
    part: int = 0  # this frame's place among its job's frames: a gap means one was lost

    def to_job(self) -> Job:
        from kvshm.engine.connector import Job
        writer = (self.writer_slot, self.writer_gen) if self.writer_slot >= 0 else None
        kind = cast(Literal["store", "load"], self.kind)  # TransferSpec refuses any other
        return Job(self.job_id, "", TransferSpec(kind, self.device, self.segment, self.skip),
                   writer)


class Flush(_Frame, frozen=True):
    job_ids: list[int]


class Stop(_Frame, frozen=True):
    pass


class Done(_Frame, frozen=True):
    job_id: int
    success: bool
    nbytes: int = 0
    seconds: float = 0.0


class Attached(_Frame, frozen=True):
    gen: int  # the channel's generation the worker attached to (its first frame)


class Broken(msgspec.Struct, frozen=True):
    """What the worker reads in place of a frame it could not take: fail ``job_id`` (None:
    the frame named no job) without copying any of it. Never on the wire."""
    job_id: int | None
    kind: str
    why: str


encoder = msgspec.msgpack.Encoder()
to_worker = msgspec.msgpack.Decoder(JobFrame | Flush | Stop)
to_scheduler = msgspec.msgpack.Decoder(Done | Attached)


def named_job(frame: bytes, tag: str) -> tuple[int | None, str]:
    """(job id, kind) that an undecodable frame tagged ``tag`` still carries in its first
    fields, else (None, "unknown"). Only read, never trusted further."""
    try:
        raw: Any = msgspec.msgpack.decode(frame)
    except Exception:  # msgspec raises more than DecodeError on some bytes (bad UTF-8)
        return None, "unknown"
    if not (isinstance(raw, list) and len(raw) >= 2 and raw[0] == tag
            and type(raw[1]) is int):
        return None, "unknown"
    kind = raw[2] if len(raw) > 2 and raw[2] in ("load", "store") else "unknown"
    return raw[1], kind


class JobReader:
    """The worker's decoding of its ring: whole jobs, flushes, stops, and Broken jobs."""

    def __init__(self) -> None:
        self._parts: dict[int, list[JobFrame]] = {}  # job id -> its frames so far
        # jobs failed for a lost part, while their later parts may still come: dropped
        self._broken: set[int] = set()

    def read(self, frame: bytes) -> list[JobFrame | Flush | Stop | Broken]:
        """What ``frame`` adds: a whole job, another frame, Broken jobs, or nothing (a part,
        or a frame of a job already broken)."""
        try:
            m = to_worker.decode(frame)
        except Exception as e:  # DecodeError, ValidationError, UnicodeDecodeError, ...
            job_id, kind = named_job(frame, "Job")
            why = f"undecodable frame ({e})"
            if job_id is None:  # it may have been the next part of any job being joined
                return [self._break(None, kind, why), *self._end_joins("a frame naming no job")]
            if job_id in self._broken:
                return []  # failed already: fail it once
            return [self._break(job_id, kind, why)]
        # A scheduler sends a job's frames one after another: any other frame ends the
        # joining of the one before, whose sending failed partway. That scheduler failed the
        # job itself (``SchedulerChannel.send``): its parts are dropped and it is not
        # reported here, for its id may be in use again, and a second report would be taken
        # for the new job's.
        going_on = isinstance(m, JobFrame) and m.part > 0  # (the next part of a job)
        if self._parts:  # (rarely: most jobs are one frame)
            for j in [j for j in self._parts if not (going_on and j == m.job_id)]:
                log.error("kvshm worker: job %d dropped, its sending stopped after %d frames",
                          j, len(self._parts.pop(j)))
        if self._broken and not (going_on and m.job_id in self._broken):
            self._broken.clear()  # a broken job's frames have ended: its id may come again
        if not isinstance(m, JobFrame):
            return [m]
        if m.job_id in self._broken:
            return []
        parts = self._parts.get(m.job_id, [])
        if m.part != len(parts):
            return [self._break(m.job_id, m.kind, f"frame {m.part} of the job came after "
                                                  f"{len(parts)} of its frames")]
        if m.last and not parts:
            return [m]
        parts.append(m)
        self._parts[m.job_id] = parts
        if not m.last:
            return []
        del self._parts[m.job_id]
        return [msgspec.structs.replace(
            m, device=[d for p in parts for d in p.device],
            segment=[s for p in parts for s in p.segment])]

    def _end_joins(self, what: str) -> list[Broken]:
        """Break every job being joined: after ``what``, none can be whole, nor may it wait
        for its next part forever."""
        return [self._break(j, parts[0].kind, f"{what} came after {len(parts)} of its frames")
                for j, parts in list(self._parts.items())]

    def _break(self, job_id: int | None, kind: str, why: str) -> Broken:
        if job_id is not None:
            self._parts.pop(job_id, None)
            self._broken.add(job_id)
        log.error("kvshm worker: job %s is broken: %s", job_id, why)
        return Broken(job_id, kind, why)

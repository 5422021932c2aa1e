"""The mini engine's scheduler loop: admit, load, compute, store, preempt, finish.

One ``step()`` is one engine iteration, in vLLM's order:

1. completions: worker reports -> ``jobs_finished`` (a finished load is verified byte for byte
   and its blocks join the device prefix cache; finished requests' deferred blocks are freed);
2. schedule: running requests first (decode / rest of prefill), preempting the newest ones when
   the device pool runs dry; then admit waiting requests: device prefix cache, then kvshm
   (``get_num_new_matched_tokens`` -> allocate -> ``update_state_after_alloc``);
3. ``build_jobs``; wait for ``flush`` (preempted requests' blocks are reused in this step);
   send the loads;
4. "forward pass": write the KV of every scheduled token, sample, extend the hash chain;
5. send the stores (after the KV they read exists), finish requests (``request_finished``).
"""
from __future__ import annotations

import time


class EngineLoop:
    """Mixin: the scheduling logic of ``mini_engine.Engine`` (state lives there)."""

    def step(self) -> bool:
        """One iteration. False when there was nothing to do but wait for the worker."""
        self._complete(self.worker.poll())
        scheduled, preempted = self._schedule()
        jobs = self.conn.build_jobs(
            {r.req_id: (r.num_computed + r.scheduled, r.blocks) for r in scheduled},
            preempted=[r.req_id for r in preempted])
        self.stats["jobs_flushed"] += len(jobs.flush)
        if jobs.flush:  # those blocks get new owners in this very step
            self._complete(self.worker.wait(jobs.flush))
        self._send(jobs.loads)
        for r in scheduled:
            self._forward(r)
        self._send(jobs.stores)
        self.stats["steps"] += 1
        return bool(scheduled or jobs.loads or jobs.stores)

    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.loading or self.deferred or self.jobs)

    def run_until_idle(self) -> None:
        while self.busy():
            if not self.step():
                if self.jobs:
                    self._complete(self.worker.wait([min(self.jobs)]))  # nothing to compute
                else:  # only lookups answered "not yet": let the host's mover have the CPU
                    time.sleep(0.001)

    def drain(self) -> None:
        """Wait for every job in flight (e.g. so that stores are published before a barrier)."""
        while self.jobs:
            self._complete(self.worker.wait(list(self.jobs)))

    def _send(self, jobs: list) -> None:
        for j in jobs:
            self.jobs[j.job_id] = j.spec.kind
        if jobs:
            self.worker.send(jobs)

    # --- completions -------------------------------------------------------------------
    def _complete(self, results: list) -> None:
        if not results:
            return
        for r in results:
            kind = self.jobs.pop(r.job_id, None)
            if kind is not None and r.success:
                self.stats["bytes_loaded" if kind == "load" else "bytes_stored"] += r.nbytes
        comp = self.conn.jobs_finished([(r.job_id, r.success) for r in results])
        for d in comp.done:
            if d.kind == "store":
                if d.success:
                    self.own_keys.update(d.keys)
                    self.stats["blocks_stored"] += len(d.keys)
                else:
                    self.stats["stores_failed"] += 1
            else:
                self._loaded(self.loading.pop(d.req_id), d)
        for req_id in comp.freeable:
            self.pool.release(self.deferred.pop(req_id).blocks)

    def _loaded(self, r, done) -> None:
        first, end, local = r.load
        bt = self.cfg.block_tokens
        counted, r.first_load = r.first_load, False  # prompt accounting: first admission only
        ok = done.success and self.verify(r, first, end)
        if done.success and not ok:
            self.stats["blocks_mismatched"] += len(done.keys)
        if ok:
            self.stats["blocks_verified"] += len(done.keys)
            if counted:
                own = sum(k in self.own_keys for k in done.keys)
                self.stats["kvshm_blocks_own"] += own
                self.stats["kvshm_blocks_other"] += len(done.keys) - own
                self.stats["kvshm_hit_tokens"] += (end - first) * bt
            for i in range(first, end):
                self.pool.register(r.blocks[i], r.hashes[i])
            # vLLM: with the whole prompt loaded, the last token is computed again (logits).
            r.num_computed = min(end * bt, len(r.tokens) - 1)
        else:
            self.stats["loads_failed"] += not done.success
            if counted:
                self.stats["recomputed_tokens"] += (end - first) * bt
            r.num_computed = local  # recompute what the load should have brought
        self.running.append(r)

    # --- scheduling --------------------------------------------------------------------
    def _schedule(self) -> tuple[list, list]:
        budget, scheduled, preempted = self.cfg.step_tokens, [], []
        bt = self.cfg.block_tokens
        for r in list(self.running):
            if r not in self.running or budget == 0:
                continue
            n = min(len(r.tokens) - r.num_computed, budget)
            need = -(-(r.num_computed + n) // bt) - len(r.blocks)
            while need > self.pool.num_free:
                victims = [v for v in self.running if v is not r and v not in scheduled]
                victim = victims[-1] if victims else r
                self._preempt(victim)
                preempted.append(victim)
                if victim is r:
                    break
            if r not in self.running:
                continue
            r.blocks += self.pool.allocate(need) if need > 0 else []
            r.scheduled, budget = n, budget - n
            scheduled.append(r)
        while self.waiting and budget > 0 and \
                len(self.running) + len(self.loading) < self.cfg.max_running:
            r = self.waiting[0]
            if not self._admit(r):
                break
            self.waiting.popleft()
            if r.req_id not in self.loading:
                n = min(len(r.tokens) - r.num_computed, budget)
                r.scheduled, budget = n, budget - n
                scheduled.append(r)
        return scheduled, preempted

    def _preempt(self, r) -> None:
        self.running.remove(r)
        self.pool.release(r.blocks)  # full blocks stay in the device prefix cache
        r.blocks, r.num_computed = [], 0
        self.waiting.appendleft(r)
        self.stats["preemptions"] += 1

    def _admit(self, r) -> bool:
        """Prefix cache, then kvshm; allocate the rest. False if the pool is too full now."""
        bt = self.cfg.block_tokens
        cached = self.pool.cached_prefix(r.hashes, (len(r.tokens) - 1) // bt)
        local = len(cached) * bt
        ext = self.conn.get_num_new_matched_tokens(r.req_id, r.hashes, local)
        if ext is None:  # kvshm's lower tier is fetching this prefix: admit it next step
            self.stats["not_yet"] = self.stats.get("not_yet", 0) + 1
            return False
        self.pool.acquire(cached)  # before allocating, so that allocation cannot evict them
        new = self.pool.allocate(-(-len(r.tokens) // bt) - len(cached))
        if new is None:
            self.pool.release(cached)
            self.conn.update_state_after_alloc(r.req_id, [], 0)  # drops the lookup's leases
            return False
        r.blocks = cached + new
        got = self.conn.update_state_after_alloc(r.req_id, r.blocks, ext)
        if not r.admitted:  # count hits once per request, not again after a preemption
            r.admitted, r.first_load = True, got > 0
            self.stats["device_hit_tokens"] += local
            self.stats["recomputed_tokens"] += r.prompt_len - local - got
        r.num_computed = local
        if got:
            r.load = (local // bt, (local + got) // bt, local)
            self.loading[r.req_id] = r
        else:
            self.running.append(r)
        return True

    # --- the forward pass ----------------------------------------------------------------
    def _forward(self, r) -> None:
        start, n = r.num_computed, r.scheduled
        self.write_kv(r, start, n)
        r.num_computed += n
        bt = self.cfg.block_tokens
        for i in range(start // bt, r.num_computed // bt):
            self.pool.register(r.blocks[i], r.hashes[i])
        if r.num_computed < len(r.tokens):
            return  # prefill continues next step
        if len(r.output) < r.max_new_tokens:
            r.append(self.next_token(r))
        if len(r.output) >= r.max_new_tokens:
            self.running.remove(r)
            self.finished[r.req_id] = r.output
            if self.conn.request_finished(r.req_id):
                self.deferred[r.req_id] = r  # stores still read its blocks
            else:
                self.pool.release(r.blocks)


if __name__ == "__main__":  # a library: say what it is and what to run instead
    from library_help import explain
    explain("mini_sched.py", __doc__)

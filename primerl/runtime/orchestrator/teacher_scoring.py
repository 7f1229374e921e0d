"""Teacher scoring beside sampling: finished episodes go to a thread that asks the teacher
(``InferenceBackend.make_teacher_client``) for their per-token log-probs, while the engine samples
on in the orchestrator's loop. A batch is handed over once every episode is scored, so no step
waits on the teacher when it keeps up; ``batch_metrics`` says how long scoring took and how far
behind it ran.

Per batch (``distill/*`` metrics): ``score_s`` the teacher's time spent on the batch's sequences,
``wait_s`` how long the batch waited for the teacher after its last episode finished sampling
(0 when the teacher kept up), ``behind_seqs`` sequences still queued for scoring at hand-over
(those of later batches).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from primerl.rl import distill_advantages

log = logging.getLogger("primerl.orchestrator")

__all__ = ["TeacherScorer", "build_teachers", "distill_batch", "in_process_teacher", "teacher_key"]


class TeacherScorer:
    """``submit(episode_state, teacher_key)`` queues a finished episode; the thread sets
    ``st.teacher_logprobs`` (aligned with ``st.episode.tokens``), ``st.scored_at`` and
    ``st.score_s`` (its share of the forward's time); with ``topk`` > 0 (``distill.topk``) also
    ``st.teacher_topk`` = (ids [L][k], log-probs [L][k]). A teacher failure is kept and re-raised by
    ``check()`` in the orchestrator's loop, naming the teacher."""

    def __init__(self, teachers: dict, *, max_batch: int = 512, topk: int = 0):
        self.teachers = teachers  # key -> teacher client (score(sequences), score_topk(sequences, k))
        self.max_batch, self.topk = max_batch, topk
        self._q: queue.Queue = queue.Queue()
        self._queued = 0
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self.error: BaseException | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="teacher-scoring", daemon=True)
        self._thread.start()

    def submit(self, st, key) -> None:
        st.teacher_logprobs, st.teacher_topk, st.done_at = None, None, time.monotonic()
        with self._lock:
            self._queued += 1
        self._q.put((st, key))

    def queued(self) -> int:
        return self._queued

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"teacher scoring failed: {self.error}") from self.error

    def wait(self, timeout: float) -> None:
        """Block until some scoring finishes (or ``timeout``)."""
        with self._done:
            self._done.wait(timeout)
        self.check()

    def close(self) -> None:
        self._stop = True
        self._q.put(None)
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop:
            item = self._q.get()
            if item is None:
                return
            items = [item]
            while len(items) < self.max_batch:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._stop = True
                    break
                items.append(nxt)
            by_key: dict = {}
            for st, key in items:
                by_key.setdefault(key, []).append(st)
            try:
                for key, sts in by_key.items():
                    t0 = time.perf_counter()
                    seqs = [list(st.episode.tokens) for st in sts]
                    if self.topk:
                        out = self.teachers[key].score_topk(seqs, self.topk)
                    else:
                        out = [(lp, None, None) for lp in self.teachers[key].score(seqs)]
                    dt = (time.perf_counter() - t0) / len(sts)
                    now = time.monotonic()
                    for st, (lp, ids, lps) in zip(sts, out):
                        st.score_s, st.scored_at = dt, now
                        st.teacher_topk = None if ids is None else (ids, lps)
                        st.teacher_logprobs = lp
            except BaseException as e:  # noqa: BLE001 - kept, re-raised in the orchestrator's loop
                log.exception("teacher scoring failed")
                self.error = e
            with self._done:
                self._queued -= len(items)
                self._done.notify_all()
            if self.error is not None:
                return


def build_teachers(cfg) -> dict:
    """The job's teacher clients, keyed by teacher path: the backend's (``distill.backend``, default
    ``inference.backend``) ``make_teacher_client``, or the model in this process."""
    from ..inference.backend import get_backend

    d = cfg.distill
    backend = get_backend(d.backend or cfg)
    clients = {}
    for p in sorted({p for p in [d.teacher, *d.teachers.values()] if p}):
        client = backend.make_teacher_client(cfg, p, name=f"teacher {p}")
        clients[p] = client if client is not None else in_process_teacher(cfg, p)
    return clients


def teacher_key(d, env_id: str) -> str:
    """The teacher (its path) of environment ``env_id``: ``distill.teachers[env_id]``, else ``distill.teacher``."""
    return d.teachers.get(env_id, d.teacher)


def in_process_teacher(cfg, path: str):
    """The teacher's model in this process, on the engine's device and dtype (the placement's)."""
    from ..inference.teacher import load_teacher, resolve_teacher
    from ..inference.teacher_clients import InProcessTeacher
    from ..placement import resolve_placement

    placement = resolve_placement(cfg)
    model = load_teacher(resolve_teacher(path), device=placement.engine_device(), dtype=placement.param_dtype)
    log.info("distillation teacher %s in-process on %s", path, placement.engine_device())
    return InProcessTeacher(model, temperature=cfg.inference.temperature, name=f"teacher {path}")


def distill_batch(samples, states, d) -> dict:
    """Replace every sample's advantage by ``distill_advantages`` over the batch (student: the
    sampler's log-probs; teacher: ``st.teacher_logprobs``), composed with its reward advantage
    unless ``d.only``; with ``d.topk`` the samples carry the teacher's top-k to the trainer
    (``Sample.teacher_topk_ids`` / ``teacher_topk_logprobs``). -> the step's ``distill/*`` metrics
    (reverse KL and scoring times)."""
    import torch

    lens = [len(s.input_ids) for s in samples]
    cu = torch.zeros(len(samples) + 1, dtype=torch.long)
    cu[1:] = torch.tensor(lens).cumsum(0)
    ls = torch.cat([s.inference_logprobs for s in samples])
    lt = torch.cat([torch.tensor(st.teacher_logprobs, dtype=torch.float32) for st in states])
    mask = torch.cat([s.loss_mask for s in samples])
    reward = None if d.only else torch.cat([torch.full((n,), float(s.advantages)) for s, n in zip(samples, lens)])
    norm = None if d.normalize == "none" else d.normalize
    out = distill_advantages(ls, lt, mask, clip=d.clip or None, normalize=norm, cu_seqlens=cu,
                             reward_advantages=reward, coef=d.coef)
    for s, st, a, b in zip(samples, states, cu[:-1].tolist(), cu[1:].tolist()):
        s.advantages = out.advantages[a:b].clone()
        if d.topk:
            ids, lps = st.teacher_topk
            s.teacher_topk_ids = torch.tensor(ids, dtype=torch.long)
            s.teacher_topk_logprobs = torch.tensor(lps, dtype=torch.float32)
    done = max(st.done_at for st in states)
    scored = max(st.scored_at for st in states)
    return {"distill/reverse_kl": float(out.reverse_kl), "distill/score_s": sum(st.score_s for st in states),
            "distill/wait_s": max(0.0, scored - done)}

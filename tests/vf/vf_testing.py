"""Shared pieces of the verifiers job tests: small configs over the examples, and a recorder of
what the inference server sampled, what the orchestrator made of each episode and what reached
the trainer's transport."""

from __future__ import annotations

import difflib
from pathlib import Path

import torch

from primerl.runtime.validate import load_config
from primerl.runtime.inference.http_routes import RouteTable
from primerl.runtime.transport import FileTransport
from primerl.runtime.orchestrator.vf_orchestrator import VerifiersOrchestrator

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--orchestrator.batch_size", "2", "--orchestrator.group_size", "4", "--env.args.max_concurrent", "8",
         "--checkpoint.interval", "0", "--log.plot", "false"]


def small_cfg(example: str, out, *over):
    return load_config(ROOT / "examples" / example, ["--output_dir", str(out), *SMALL, *over])


class Recorder:
    def __init__(self, monkeypatch):
        self.requests: list[tuple[str, list[int], list[int], list[float]]] = []  # session, prompt, completion, logprobs
        self.routing: dict[tuple, list[torch.Tensor]] = {}  # (prompt, completion) -> the engine's [P + C - 1, L, k]
        self.episodes: list[tuple[object, list]] = []  # (vf episode, units)
        self.writes: dict[int, tuple[list, dict]] = {}  # step -> (samples, metrics)
        self.batches: dict[int, dict] = {}  # step -> transport payload (rank 0)
        self.final: dict[int, list] = {}  # step -> the units (trainable traces) its samples came from
        rec = self
        record, units, write, put, finalize = (RouteTable.record_session, VerifiersOrchestrator._units,
                                               VerifiersOrchestrator._write, FileTransport.put_batch,
                                               VerifiersOrchestrator._finalize)

        def _record(self, session_id, c):
            rec.requests.append((session_id, list(c.prompt), list(c.tokens), list(c.logprobs)))
            if c.routing is not None:
                rec.routing.setdefault((tuple(c.prompt), tuple(c.tokens)), []).append(c.routing.clone())
            return record(self, session_id, c)

        def _units(self, ep):
            out = units(self, ep)
            rec.episodes.append((ep, out))
            return out

        def _write(self, step, samples, metrics):
            rec.writes[step] = (list(samples), dict(metrics))
            return write(self, step, samples, metrics)

        def _put(self, step, rank, payload):
            if rank == 0:
                rec.batches[step] = payload
            return put(self, step, rank, payload)

        def _finalize(self, step):
            groups = [[u for units in grp.members for u in units] for grp in self.batches[step]]
            out = finalize(self, step)
            if out is not None:
                rec.final[step] = [u for g in groups for u in g]
            return out

        monkeypatch.setattr(VerifiersOrchestrator, "_finalize", _finalize)
        monkeypatch.setattr(RouteTable, "record_session", _record)
        monkeypatch.setattr(VerifiersOrchestrator, "_units", _units)
        monkeypatch.setattr(VerifiersOrchestrator, "_write", _write)
        monkeypatch.setattr(FileTransport, "put_batch", _put)


    def episode_of(self, unit):
        for ep, units in self.episodes:
            for i, u in enumerate(units):
                if u is unit:
                    return ep, ep.traces[i] if len(ep.traces) == len(units) else None
        raise KeyError("unit not recorded")


def spans(mask) -> list[tuple[int, int]]:
    from primerl.rl.envs.verifiers_env import sampled_spans

    return sampled_spans([bool(m) for m in mask])


def assert_samples_are_the_sampled_tokens(rec: Recorder) -> int:
    """Every trained sample's loss tokens are, turn by turn, a completion the server returned for
    exactly the sample's preceding tokens, with the server's log-probs; the packed micro-batches
    carry the same tokens, mask and log-probs. Returns the number of model turns checked."""
    by_prompt = {}
    for _, prompt, completion, logprobs in rec.requests:
        by_prompt.setdefault(tuple(prompt), []).append((completion, logprobs))
    turns = 0
    for step, (samples, _) in rec.writes.items():
        for s in samples:
            ids = s.input_ids.tolist()
            for a, b in spans(s.loss_mask.tolist()):
                found = [lp for c, lp in by_prompt.get(tuple(ids[:a]), []) if c == ids[a:b]]
                assert found, f"step {step}: loss tokens {a}..{b} were not sampled for that prompt"
                # (one prompt may have been sampled to the same tokens by several policy versions)
                got = s.inference_logprobs[a:b]
                assert any(torch.allclose(got, torch.tensor(lp), atol=1e-6, rtol=0) for lp in found)
                turns += 1
            assert (s.inference_logprobs[~s.loss_mask] == 0).all()
        # what the trainer reads: the packed batch holds exactly these sequences
        mbs = rec.batches[step]["micro_batches"]
        packed = sorted((tuple(mb.input_ids[a:b].tolist()), tuple(mb.loss_mask[a:b].tolist()),
                         tuple(round(x, 6) for x in mb.inference_logprobs[a:b].tolist()))
                        for mb in mbs for a, b in zip(mb.cu_seqlens[:-1].tolist(), mb.cu_seqlens[1:].tolist())
                        if mb.loss_mask[a:b].any())
        mine = sorted((tuple(s.input_ids.tolist()), tuple(s.loss_mask.tolist()),
                       tuple(round(x, 6) for x in s.inference_logprobs.tolist())) for s in samples)
        assert packed == mine
    return turns


def assert_replay_is_the_samplers_routing(rec: Recorder) -> int:
    """Every sample's ``replay_ids`` are the experts the engine used when it first fed each token:
    turn i's request supplies rows ``end(i-1) - 1 .. end(i) - 2`` (its prefill of the new tokens, the
    previous turn's last sampled token included, and its decode); the final row, a token never
    fed, is filler. Returns the number of rows checked."""
    rows = 0
    for samples, _ in rec.writes.values():
        for s in samples:
            assert s.replay_ids is not None
            ids = s.input_ids.tolist()
            start = 0
            for a, b in spans(s.loss_mask.tolist()):
                cands = rec.routing.get((tuple(ids[:a]), tuple(ids[a:b])), [])
                assert cands, "a model turn without the engine's routing record"
                got = s.replay_ids[start:b - 1].to(torch.int64)
                assert any(torch.equal(got, r[start:b - 1].to(torch.int64)) for r in cands)
                rows += b - 1 - start
                start = b - 1
    return rows


def sdpa_attention(monkeypatch) -> None:
    """The job's training forwards (the warm start's and the trainer's) attend with the "sdpa"
    backend, torch's fused CPU kernel per run of equal-length sequences, instead of the CPU default
    "torch", which scores one dense ``[T, T]`` block over a whole packed batch (T = every token of the
    batch: ~1400 in a warm-start step of 8 demonstrations, up to ``orchestrator.seq_len`` in a
    training micro-batch). The same attention (tests/kernels check the backends against each other;
    here the warm start's losses agree to 1e-6), ~50x less CPU for the warm start; only a model
    whose ``attn_backend`` names none is switched. The sampling engine has its own cached attention."""
    import primerl.models.layers as layers

    dense = layers._attention

    def _attention(q, k, v, cu_seqlens, softmax_scale, backend=None):
        return dense(q, k, v, cu_seqlens, softmax_scale, backend or "sdpa")

    monkeypatch.setattr(layers, "_attention", _attention)


def similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()

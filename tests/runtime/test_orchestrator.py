"""Orchestrator scheduling with a fake engine and a fake trainer (no model): async level, policy
versions, stale-sample discards, environment errors and timeouts, dead trainer."""

import asyncio
import threading

import pytest
import torch

from primerl.rl.envs import ReverseText
from primerl.runtime.validate import load_config
from primerl.runtime.inference.engine import Completion
from primerl.runtime.orchestrator import EnvError, Orchestrator
from primerl.runtime.transport import FileTransport, ProducerDied


class FakeClient:
    """Answers every request at the next poll: the reversed prompt with probability ``p_correct``."""

    def __init__(self, p_correct=0.5, report_version=None):
        self.queue, self.version, self.loads = [], -1, []
        self.p_correct, self.report_version = p_correct, report_version

    def submit(self, req):
        self.queue.append(req)

    def abort(self, ids):
        self.queue = [r for r in self.queue if r.request_id not in set(ids)]

    def has_pending(self):
        return bool(self.queue)

    def servers_healthy(self):
        return 1

    def metrics(self):
        return {}

    def poll(self):
        out, self.queue = self.queue[:4], self.queue[4:]
        res = []
        for r in out:
            g = torch.Generator().manual_seed(r.params.seed)
            target = [t for t in r.prompt[1:-1]][::-1][: r.params.max_new_tokens]
            toks = [t if torch.rand(1, generator=g).item() < self.p_correct else 0 for t in target]
            v = self.version if self.report_version is None else self.report_version(self, r)
            res.append(Completion(r.request_id, r.prompt, toks, [-0.5] * len(toks), None, "length", v, self.version))
        return res

    def update_weights(self, version, transport):
        self.version = version
        self.loads.append(version)


def _cfg(tmp_path, *over):
    return load_config(None, ["--output_dir", str(tmp_path), "--orchestrator.batch_size", "3",
                              "--orchestrator.group_size", "4", "--orchestrator.seq_len", "64", "--max_steps", "4",
                              "--env.timeout_s", "1", *over])


def fake_trainer(transport, steps, seen, delay=0.0):
    transport.publish_weights(0, {"w": torch.zeros(1)})
    for s in range(steps):
        payload = transport.get_batch(s, 0, timeout=30)
        seen.append((s, payload["metrics"]))
        threading.Event().wait(delay)
        transport.publish_weights(s + 1, {"w": torch.zeros(1)})


def _run(cfg, env, client, steps=4, delay=0.0):
    tr = FileTransport(cfg.output_dir)
    seen = []
    th = threading.Thread(target=fake_trainer, args=(tr, steps, seen, delay), daemon=True)
    th.start()
    orch = Orchestrator(cfg, env, client, tr)
    orch.run()
    th.join(10)
    return orch, seen


@pytest.mark.parametrize("level", [0, 1, 2])
def test_async_level_bounds_the_policy_lag(tmp_path, level):
    cfg = _cfg(tmp_path, "--orchestrator.max_async_level", str(level), "--orchestrator.max_off_policy_steps", "2")
    client = FakeClient()
    orch, seen = _run(cfg, ReverseText(num_symbols=4), client, delay=0.05)
    assert [s for s, _ in seen] == [0, 1, 2, 3]
    for s, m in seen:
        assert 0 <= m["off_policy/max"] <= level
        assert m["policy_version"] >= s - level
        assert 0.0 <= m["reward/mean"] <= 1.0 and m["samples/discarded_stale"] == 0
    if level == 0:
        assert all(m["off_policy/max"] == 0 for _, m in seen)
    payload = FileTransport(cfg.output_dir).get_batch(3, 0, timeout=1)
    mb = payload["micro_batches"][0]
    T = mb.input_ids.numel()
    assert mb.cu_seqlens[-1] == T and mb.loss_mask.shape == (T,) and payload["num_loss_tokens"] > 0


def test_stale_groups_are_discarded_counted_and_resampled(tmp_path):
    cfg = _cfg(tmp_path, "--orchestrator.max_async_level", "0", "--orchestrator.max_off_policy_steps", "0")
    stale_once = set()

    def report(client, req):  # the first sample of each batch claims a policy 3 versions old
        key = client.version
        if key not in stale_once and key >= 0:
            stale_once.add(key)
            return client.version - 3
        return client.version

    orch, seen = _run(cfg, ReverseText(num_symbols=4), FakeClient(report_version=report))
    assert [s for s, _ in seen] == [0, 1, 2, 3]
    assert all(m["samples/discarded_stale"] == 4 for _, m in seen)  # one group of 4 per batch
    assert all(m["off_policy/max"] == 0 for _, m in seen)
    assert orch.counters["discarded_stale"] == 16


class FlakyEnv(ReverseText):
    def __init__(self, fail_calls=(), always=False):
        super().__init__(num_symbols=4)
        self.calls, self.fail_calls, self.always = 0, set(fail_calls), always

    def reward(self, episode):
        self.calls += 1
        if self.always or self.calls in self.fail_calls:
            raise RuntimeError("reward service unavailable")
        return super().reward(episode)


class HangingEnv(ReverseText):
    def __init__(self):
        super().__init__(num_symbols=4)
        self.calls = 0

    async def reward(self, episode):
        self.calls += 1
        if self.calls == 2:
            await asyncio.sleep(30)
        return super().reward(episode)


def test_env_errors_and_timeouts_are_counted_retries(tmp_path):
    orch, seen = _run(_cfg(tmp_path), FlakyEnv(fail_calls=(3, 20, 33)), FakeClient())
    assert sum(m["env/errors"] for _, m in seen) == orch.counters["env_errors"] == 3
    orch, seen = _run(_cfg(tmp_path / "b"), HangingEnv(), FakeClient())
    assert orch.counters["env_errors"] == 1 and len(seen) == 4


def test_env_that_always_raises_stops_with_a_clear_error(tmp_path):
    cfg = _cfg(tmp_path, "--env.max_retries", "2")
    tr = FileTransport(cfg.output_dir)
    tr.publish_weights(0, {"w": torch.zeros(1)})
    with pytest.raises(EnvError, match="failed on prompt .* 3 times"):
        Orchestrator(cfg, FlakyEnv(always=True), FakeClient(), tr).run()


def test_dead_trainer_is_reported_not_waited_on(tmp_path):
    cfg = _cfg(tmp_path, "--orchestrator.weights_timeout_s", "600")
    tr = FileTransport(cfg.output_dir)
    with pytest.raises(ProducerDied):
        Orchestrator(cfg, ReverseText(num_symbols=4), FakeClient(), tr, trainer_alive=lambda: False).run()


def test_resumed_orchestrator_replays_the_same_prompts_and_seeds(tmp_path):
    env = ReverseText(num_symbols=4)
    full, _ = _run(_cfg(tmp_path / "a", "--orchestrator.max_async_level", "0"), env, FakeClient())
    a = FileTransport(tmp_path / "a").get_batch(3, 0, timeout=1)
    cfg = _cfg(tmp_path / "b", "--orchestrator.max_async_level", "0")
    tr = FileTransport(cfg.output_dir)
    tr.publish_weights(3, {"w": torch.zeros(1)})
    Orchestrator(cfg, env, FakeClient(), tr, start_step=3).run()
    b = tr.get_batch(3, 0, timeout=1)
    for k in ("input_ids", "advantages", "loss_mask"):
        assert torch.equal(getattr(a["micro_batches"][0], k), getattr(b["micro_batches"][0], k))


@pytest.mark.parametrize("env_id", ["reverse-text", "reverse-text-feedback"])
def test_real_engine_batches_line_up_with_the_trainer(tmp_path, env_id):
    """Sampler log-probs and routing, as packed for the trainer, match the trainer's own forward at
    the same weights on every model token, across environment turns too."""
    from primerl.rl.envs import load_environment
    from primerl.runtime.orchestrator.clients import make_client
    from primerl.runtime.policy import build_model, model_config
    from primerl.runtime.trainer import shifted_logprobs

    cfg = _cfg(tmp_path, "--max_steps", "1", "--orchestrator.max_async_level", "0", "--env.id", env_id,
               "--env.args", '{"num_symbols": 4, "min_length": 2, "max_length": 5}')
    env = load_environment(cfg.env.id, **cfg.env.args)
    model = build_model(cfg, env.vocab_size)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.mul_(8.0)
    tr = FileTransport(cfg.output_dir)
    tr.publish_weights(0, model.state_dict())
    orch = Orchestrator(cfg, env, make_client(cfg, env.vocab_size), tr, top_k=model_config(cfg, env.vocab_size).top_k)
    orch.run()
    payload = tr.get_batch(0, 0, timeout=1)
    if env_id == "reverse-text-feedback":
        assert payload["metrics"]["turns/mean"] > 1.0
    n_model = 0
    with torch.no_grad():
        for mb in payload["micro_batches"]:
            for replay in (False, True):
                lp, _ = shifted_logprobs(model, mb, replay=replay)
                assert torch.allclose(lp[mb.loss_mask], mb.inference_logprobs[mb.loss_mask], atol=1e-4)
            model(mb.input_ids, mb.position_ids, mb.cu_seqlens)
            live = model.routing().long()
            starts = mb.cu_seqlens[1:].long() - 1  # each sequence's last token is a filler row
            keep = torch.ones(mb.num_tokens, dtype=torch.bool)
            keep[starts] = False
            assert torch.equal(live[keep], mb.replay_ids.long()[keep])
            n_model += int(mb.loss_mask.sum())
    assert n_model == payload["num_loss_tokens"] > 0


def test_monitor_endpoint_servers_healthy_and_samples_on_disk(tmp_path):
    """orchestrator.metrics_port serves /health and /metrics; every step reports
    inference/servers_healthy; orchestrator.save_samples writes each step's trained samples."""
    import json
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from primerl.runtime.orchestrator.monitor import OrchestratorMonitor
    from primerl.runtime.orchestrator.samples_log import samples_path

    cfg = _cfg(tmp_path, "--orchestrator.max_async_level", "1", "--orchestrator.save_samples", "true")
    tr = FileTransport(cfg.output_dir)
    seen = []
    th = threading.Thread(target=fake_trainer, args=(tr, 4, seen), daemon=True)
    th.start()
    orch = Orchestrator(cfg, ReverseText(num_symbols=4), FakeClient(p_correct=0.6), tr)
    orch.monitor = OrchestratorMonitor().start()
    try:
        orch.run()
        th.join(10)
        with urllib.request.urlopen(orch.monitor.url + "/health", timeout=10) as r:
            health = json.loads(r.read())
        with urllib.request.urlopen(orch.monitor.url + "/metrics", timeout=10) as r:
            prom = {(s.name, s.labels.get("name")): s.value for f in text_string_to_metric_families(r.read().decode())
                    for s in f.samples}
    finally:
        orch.monitor.stop()
    assert all(m["inference/servers_healthy"] == 1 for _, m in seen)
    last = seen[-1][1]
    assert health["status"] == "ok" and health["last_step"]["step"] == 3 and health["servers_healthy"] == 1
    assert health["last_step"]["reward/mean"] == last["reward/mean"]
    assert prom[("primerl_orchestrator_step_metric", "reward/mean")] == pytest.approx(last["reward/mean"])
    assert prom[("primerl_orchestrator_servers_healthy", None)] == 1.0
    for step, m in seen:
        rows = [json.loads(x) for x in samples_path(cfg.output_dir, step).read_text().splitlines()]
        assert len(rows) == 3 * 4
        assert {(r["group"], r["member"]) for r in rows} == {(g, i) for g in range(3) for i in range(4)}
        assert sum(r["reward"] for r in rows) / len(rows) == pytest.approx(m["reward/mean"])
        for g in range(3):  # drgrpo: reward minus the group's mean
            grp = [r for r in rows if r["group"] == g]
            mean = sum(r["reward"] for r in grp) / len(grp)
            assert all(r["advantage"] == pytest.approx(r["reward"] - mean, abs=1e-6) for r in grp)
        for r in rows:
            n = len(r["input_ids"])
            assert len(r["loss_mask"]) == n and len(r["inference_logprobs"]) == n and sum(r["loss_mask"]) > 0
            assert all(lp == (-0.5 if k else 0.0) for lp, k in zip(r["inference_logprobs"], r["loss_mask"]))
            assert step - 1 <= r["policy_version_min"] <= r["policy_version_max"] <= step + 1 and r["servers"] == [""]


def test_samples_are_not_written_by_default(tmp_path):
    _run(_cfg(tmp_path), ReverseText(num_symbols=4), FakeClient(), steps=4)
    assert not (tmp_path / "samples").exists()

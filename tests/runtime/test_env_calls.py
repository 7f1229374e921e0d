"""Environment calls run concurrently with per-call deadlines, failures name the environment and
the call, and rewards are checked where they enter (rejected or clipped, counted)."""

import threading
import time

import pytest
import torch
from test_orchestrator import FakeClient, _run

from primerl.rl.envs import ReverseText
from primerl.runtime.validate import load_config
from primerl.runtime.orchestrator.env_calls import EnvCallError, EnvCalls, EnvCallTimeout, RewardRejected, check_reward
from primerl.runtime.orchestrator import EnvError, Orchestrator
from primerl.runtime.transport import FileTransport


def _drain(calls, deadline_s=10.0):
    out = []
    end = time.monotonic() + deadline_s
    while calls.pending() and time.monotonic() < end:
        out += calls.poll(wait_s=0.05)
    assert not calls.pending(), "calls did not finish"
    return out


def test_calls_run_concurrently_up_to_the_limit():
    n = 8
    barrier = threading.Barrier(n, timeout=10)  # only passes if all n calls run at the same time
    calls = EnvCalls("env", timeout_s=30, max_concurrent=n)
    for i in range(n):
        calls.submit(i, "reward", lambda i=i: (barrier.wait(), i)[1])
    got = _drain(calls)
    assert sorted(v for _, _, ok, v in got if ok) == list(range(n))

    cond, live, peak = threading.Condition(), [0], [0]

    def tracked():
        with cond:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
            cond.notify_all()
            cond.wait_for(lambda: peak[0] >= 3, timeout=10)  # hold the slot until 3 ran at once
            live[0] -= 1
        return 1.0

    calls = EnvCalls("env", timeout_s=30, max_concurrent=3)
    for i in range(12):
        calls.submit(i, "reward", tracked)
    assert len(_drain(calls)) == 12 and peak[0] == 3


def test_a_hanging_call_times_out_alone_and_names_the_env_and_the_call():
    release = threading.Event()
    calls = EnvCalls("my-grader", timeout_s=1.0, max_concurrent=4)
    calls.submit("hang", "reward", release.wait)
    calls.submit("ok", "reward", lambda: 1.0)
    calls.submit("bad", "respond", lambda: 1 / 0)
    first = []
    while len(first) < 2:
        first += calls.poll(wait_s=0.05)
    assert {(k, ok) for k, _, ok, _ in first} == {("ok", True), ("bad", False)}  # before the hanging one's deadline
    bad = next(v for k, _, _, v in first if k == "bad")
    assert isinstance(bad, EnvCallError) and "'my-grader': respond() raised ZeroDivisionError" in str(bad)
    (key, name, ok, err), = _drain(calls)
    assert (key, name, ok) == ("hang", "reward", False) and isinstance(err, EnvCallTimeout)
    assert "environment 'my-grader': reward() did not return within env.timeout_s = 1.0 s" in str(err)
    assert calls.timeouts == 1
    release.set()
    time.sleep(0.05)
    assert calls.poll() == []  # the abandoned call's late result is dropped


@pytest.mark.parametrize("value", ["0.5", None, [1.0], float("nan"), float("inf"), -float("inf"), b"1", 1j])
def test_unusable_rewards_are_rejected(value):
    with pytest.raises(RewardRejected, match="reward\\(\\) returned"):
        check_reward(value, 1e6, "environment 'e'")


def test_rewards_are_floats_and_huge_ones_are_clipped():
    assert check_reward(0.25, 1e6) == (0.25, False)
    assert check_reward(3, 1e6) == (3.0, False)
    assert check_reward(torch.tensor(0.5), 1e6) == (0.5, False)
    assert check_reward(1e38, 1e6) == (1e6, True)
    assert check_reward(-1e38, 1e6) == (-1e6, True)


def _cfg(tmp_path, *over):
    return load_config(None, ["--output_dir", str(tmp_path), "--orchestrator.batch_size", "3",
                              "--orchestrator.group_size", "4", "--orchestrator.seq_len", "64", "--max_steps", "2",
                              *over])


class OddRewards(ReverseText):
    """Returns one unusable reward (a string) and a few non-representable ones (+-1e38)."""

    def __init__(self):
        super().__init__(num_symbols=4)
        self.calls, self.lock = 0, threading.Lock()

    def reward(self, episode):
        with self.lock:
            self.calls += 1
            n = self.calls
        if n == 2:
            return "0.5"
        return 1e38 if n % 5 == 0 else (-1e38 if n % 7 == 0 else super().reward(episode))


def test_orchestrator_counts_rejected_and_clipped_rewards_and_keeps_advantages_finite(tmp_path):
    cfg = _cfg(tmp_path, "--env.max_abs_reward", "100")
    orch, seen = _run(cfg, OddRewards(), FakeClient(), steps=2)
    assert orch.counters["rewards_rejected"] == 1 and orch.counters["env_errors"] == 1
    assert orch.counters["rewards_clipped"] >= 2
    assert sum(m["rewards/rejected"] for _, m in seen) == 1
    assert sum(m["rewards/clipped"] for _, m in seen) == orch.counters["rewards_clipped"]
    assert max(m["reward/max"] for _, m in seen) == 100.0
    for s in range(2):
        for mb in FileTransport(cfg.output_dir).get_batch(s, 0, timeout=1)["micro_batches"]:
            assert torch.isfinite(mb.advantages).all()


class HangsForever(ReverseText):
    def __init__(self):
        super().__init__(num_symbols=4)
        self.calls, self.release = 0, threading.Event()

    def reward(self, episode):
        self.calls += 1
        if self.calls == 3:
            self.release.wait()
        return super().reward(episode)


def test_hanging_reward_is_reported_as_the_envs_failure_not_a_trainer_timeout(tmp_path):
    cfg = _cfg(tmp_path, "--env.timeout_s", "0.5", "--env.max_retries", "0", "--env.id", "reverse-text",
               "--trainer.batch_timeout_s", "600")
    tr = FileTransport(cfg.output_dir)
    tr.publish_weights(0, {"w": torch.zeros(1)})
    env = HangsForever()
    with pytest.raises(EnvError, match=r"environment 'reverse-text' failed .*reward\(\) did not return within "
                                       r"env.timeout_s = 0.5 s"):
        Orchestrator(cfg, env, FakeClient(), tr).run()
    env.release.set()


class NeedsCompany(ReverseText):
    """reward() returns only when ``parties`` calls are in it at once (a serial caller deadlocks)."""

    def __init__(self, parties):
        super().__init__(num_symbols=4)
        self.barrier = threading.Barrier(parties, timeout=10)

    def reward(self, episode):
        self.barrier.wait()
        return super().reward(episode)


def test_orchestrator_runs_the_reward_calls_of_a_batch_concurrently(tmp_path):
    # FakeClient finishes 4 requests per poll: their 4 reward calls must all be running together
    orch, seen = _run(_cfg(tmp_path, "--env.max_retries", "0"), NeedsCompany(4), FakeClient(), steps=2)
    assert len(seen) == 2 and orch.counters["env_errors"] == 0


def test_async_env_calls_return_results_and_time_out_on_the_event_loop():
    """``AsyncEnvCalls`` (the verifiers path's built-in environments): results, an environment's
    error and a hanging call's timeout arrive in their awaiting coroutines, the others unaffected,
    including a call that waited for a free slot (max_concurrent 2) behind the hanging one."""
    import asyncio

    from primerl.runtime.orchestrator.env_calls import AsyncEnvCalls

    release = threading.Event()

    def boom():
        raise ValueError("bad grader")

    async def main():
        calls = AsyncEnvCalls(EnvCalls("env", timeout_s=0.3, max_concurrent=2), asyncio.get_running_loop())
        return await asyncio.gather(calls.call("reward", release.wait), calls.call("reward", boom),
                                    calls.call("reward", lambda: 7), calls.call("respond", lambda: [1, 2]),
                                    return_exceptions=True)

    try:
        hung, err, ok, reply = asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        release.set()
    assert isinstance(hung, EnvCallTimeout) and "'env': reward() did not return within env.timeout_s" in str(hung)
    assert isinstance(err, EnvCallError) and "reward() raised ValueError: bad grader" in str(err)
    assert ok == 7 and reply == [1, 2]

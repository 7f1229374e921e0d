"""Inference backends: the registry, capability checks at validation, the channels and receivers a
backend chooses, and the weight channels' output (streamed = what the one-shot writers write)."""

import dataclasses
import sys

import pytest
import torch
from safetensors.torch import load_file

from primerl.models.config import MoETransformerConfig
from primerl.models.transformer import MoETransformer
from primerl.runtime.config import ConfigError
from primerl.runtime.inference.backend import (BACKENDS, BackendCapabilities, InferenceBackend, check_backend,
                                               get_backend, register_backend)
from primerl.runtime.inference.embedded_backend import EmbeddedBackend
from primerl.runtime.inference.hf_weights import hf_stream, hf_weights, publish_hf
from primerl.runtime.inference.weight_channels import (BucketedBroadcast, EngineBroadcast, FileChannel, HFFileChannel,
                                                       ServerBroadcast, WeightVersions)
from primerl.runtime.inference.weight_sync import (BroadcastWeightSender, EngineWeightReceiver, FileWeightVersions,
                                                   ServerWeightVersions)
from primerl.runtime.trainer.publish import WeightStream, weight_specs
from primerl.runtime.transport import FileTransport
from primerl.runtime.validate import load_config


def _port() -> int:
    """A free port, reserved until this process exits (no other process can take it first)."""
    from primerl.runtime.ports import held_port

    return held_port()


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    cfg = MoETransformerConfig(vocab_size=64, dim=128, n_layers=2, n_heads=2, n_kv_heads=2, num_experts=4, top_k=2,
                               moe_dim=128, **kw)
    return MoETransformer(cfg).eval()


@pytest.fixture
def limited(monkeypatch):
    """Register ``name`` -> an embedded backend with some capabilities off, for this test only."""
    def make(name, **caps):
        cls = type(f"Limited_{name}", (EmbeddedBackend,), {
            "name": name, "capabilities": dataclasses.replace(EmbeddedBackend.capabilities, **caps)})
        monkeypatch.setitem(BACKENDS._items, name, cls())
        return BACKENDS._items[name]
    return make


# ------------------------------------------------------------------------------------------- registry
def test_unknown_backend_is_a_one_line_error_listing_the_registered_ones():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["--inference.backend", "sglang"])
    assert str(e.value) == "inference.backend: unknown inference backend 'sglang'; registered: embedded, vllm"


def test_builtins_register_themselves_and_are_one_instance_each():
    assert BACKENDS.names()[:2] == ["embedded", "vllm"]
    assert get_backend("embedded") is get_backend("embedded") and get_backend("vllm").name == "vllm"
    cfg = load_config(None, ["--inference.backend", "vllm"])
    assert get_backend(cfg) is get_backend("vllm") and isinstance(get_backend(cfg), InferenceBackend)
    with pytest.raises(ValueError, match="'vllm' is registered already"):
        register_backend("vllm", EmbeddedBackend())


def test_a_backend_class_from_module_attr_is_instantiated_once(tmp_path, monkeypatch):
    (tmp_path / "my_backend_mod.py").write_text(
        "from primerl.runtime.inference.embedded_backend import EmbeddedBackend\n"
        "class Mine(EmbeddedBackend):\n    name = 'mine'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_backend_mod", raising=False)
    monkeypatch.setattr(BACKENDS, "_items", dict(BACKENDS._items))
    b = get_backend("my_backend_mod:Mine")
    assert type(b).__name__ == "Mine" and b.name == "mine" and get_backend("my_backend_mod:Mine") is b
    cfg = load_config(None, [], check=False)
    cfg.inference.backend = "my_backend_mod:Mine"
    check_backend(cfg)  # its capabilities (the embedded engine's) cover the defaults


def test_something_registered_that_is_not_a_backend_is_refused(monkeypatch):
    monkeypatch.setitem(BACKENDS._items, "not-a-backend", object())
    with pytest.raises(ConfigError, match="inference.backend: 'not-a-backend' is registered as .* not an "
                                          "InferenceBackend"):
        get_backend("not-a-backend")


# ------------------------------------------------------------------------------------ capability checks
def test_pd_on_a_backend_without_pd_is_refused_naming_the_key(limited):
    limited("nopd", pd=False)
    with pytest.raises(ConfigError, match=r"^inference.pd: .*'nopd' does not offer \(capabilities.pd is false\)"):
        load_config(None, ["--inference.backend", "nopd", "--inference.pd.prefill", "1", "--inference.pd.decode", "1"])


def test_broadcast_on_a_backend_that_cannot_is_refused_naming_the_key(limited):
    limited("nobcast", broadcast=False)
    with pytest.raises(ConfigError, match=r"^inference.weight_update: 'broadcast' .*'nobcast'.*capabilities.broadcast"):
        load_config(None, ["--inference.backend", "nobcast", "--inference.weight_update", "broadcast"])
    with pytest.raises(ConfigError, match=r"^inference.vllm.weight_update: 'broadcast' .*'nobcast'"):
        load_config(None, ["--inference.backend", "nobcast", "--inference.vllm.weight_update", "broadcast"])


@pytest.mark.parametrize("caps, over, key", [
    ({"routed_experts": False}, ["--trainer.router_replay", "true", "--inference.capture_routing", "true"],
     "trainer.router_replay"),
    ({"server_pool": False}, ["--inference.num_servers", "2"], "inference.num_servers"),
    ({"external_servers": False}, ["--inference.vllm.urls", '["http://a:1"]'], "inference.vllm.urls"),
    ({"launch": False}, ["--inference.vllm.launch", "true"], "inference.vllm.launch"),
])
def test_every_capability_is_checked(limited, caps, over, key):
    limited("lacking", **caps)
    with pytest.raises(ConfigError, match=rf"^{key}: .*'lacking' does not offer \(capabilities.{next(iter(caps))}"):
        load_config(None, ["--inference.backend", "lacking", *over])


def test_inference_nodes_need_the_capability(limited):
    limited("local-only", inference_nodes=False)
    cfg = load_config(None, [], check=False)
    cfg.inference.backend = "local-only"
    cfg.deployment.inference_nodes = 1
    with pytest.raises(ConfigError, match=r"^deployment.inference_nodes: .*'local-only'.*capabilities.inference_nodes"):
        check_backend(cfg)


def test_router_replay_without_capture_asks_nothing_of_the_backend(limited):
    limited("norouting", routed_experts=False)
    cfg = load_config(None, ["--trainer.router_replay", "false"], check=False)
    cfg.inference.backend = "norouting"
    check_backend(cfg)


def test_builtin_backends_refuse_the_other_ones_keys():
    with pytest.raises(ConfigError, match="^inference.weight_update: 'broadcast' is the embedded engine's"):
        load_config(None, ["--inference.backend", "vllm", "--inference.weight_update", "broadcast"])
    with pytest.raises(ConfigError, match="^inference.vllm.weight_update: 'broadcast' is vLLM's"):
        load_config(None, ["--inference.vllm.weight_update", "broadcast"])
    with pytest.raises(ConfigError, match="^inference.num_servers: .*'vllm'.*capabilities.server_pool"):
        load_config(None, ["--inference.backend", "vllm", "--inference.num_servers", "2"])
    cfg = load_config(None, ["--inference.weight_update", "filesystem"], check=False)
    cfg.deployment.orchestrator = "own"
    with pytest.raises(ConfigError, match="^inference.weight_update: 'filesystem' needs output_dir shared"):
        check_backend(cfg)


def test_describe_says_which_servers_start():
    emb = load_config(None, [])
    assert "none started (the embedded engine" in get_backend(emb).describe(emb)
    pool = load_config(None, ["--inference.num_servers", "3"])
    assert "3 `primerl inference` servers" in get_backend(pool).describe(pool)
    pd = load_config(None, ["--inference.pd.prefill", "1", "--inference.pd.decode", "2"], check=False)
    text = get_backend(pd).describe(pd)
    assert "prefill" in text and "decode" in text and str(pd.inference.pd.router_port) in text
    v = load_config(None, ["--inference.backend", "vllm", "--inference.vllm.model", "m", "--inference.vllm.launch",
                           "true"], check=False)
    assert "vllm.entrypoints.openai.api_server" in get_backend(v).describe(v)
    ext = load_config(None, ["--inference.backend", "vllm"])
    assert f"the server at {ext.inference.vllm.url} is the user's" in get_backend(ext).describe(ext)


# ------------------------------------------------------------------------ channels and receivers chosen
def test_each_backend_chooses_its_channel(tmp_path):
    tr = FileTransport(tmp_path)
    model = _model()

    def channel(*over, rank=0):
        cfg = load_config(None, list(over), check=False)
        return get_backend(cfg).weight_channel(cfg, model=model, transport=tr, rank=rank)

    assert type(channel("--inference.weight_update", "filesystem")) is FileChannel
    bc = channel("--inference.weight_update", "broadcast", rank=1)
    assert type(bc) is BucketedBroadcast and bc.sender is None and bc.sharded  # every rank joins at its first publish
    hf = channel("--inference.backend", "vllm", "--inference.vllm.update_fp8", "true")
    assert type(hf) is HFFileChannel and hf.fp8
    sb = channel("--inference.backend", "vllm", "--inference.vllm.weight_update", "broadcast")
    assert type(sb) is ServerBroadcast and isinstance(sb.sender, BroadcastWeightSender) and not sb.fp8
    sb.close()


def test_each_backend_gives_the_orchestrator_its_weight_versions(tmp_path):
    tr = FileTransport(tmp_path)
    cfg = load_config(None, [])
    got = get_backend(cfg).weight_receiver(cfg, object(), tr)
    assert type(got) is FileWeightVersions and isinstance(got, WeightVersions)
    tr.publish_weights(3, {"w": torch.zeros(1)})
    assert got.versions() == [3] and got.wait_version(2, timeout=1) == 3 and not got.alive
    v = load_config(None, ["--inference.backend", "vllm", "--inference.vllm.weight_update", "broadcast"], check=False)
    assert type(get_backend(v).weight_receiver(v, object(), tr)) is FileWeightVersions  # one machine: markers
    v.deployment.kind = "nodes"
    assert type(get_backend(v).weight_receiver(v, object(), tr)) is ServerWeightVersions  # the servers' own


# ------------------------------------------------------------------------------------- channels' output
def _published(tr, version):
    return load_file(str(tr.weights_dir(version) / "model.safetensors"))


def test_file_channel_streams_what_a_one_shot_write_holds(tmp_path):
    model = _model(1)
    a, b = FileTransport(tmp_path / "a"), FileTransport(tmp_path / "b")
    FileChannel(a, rank=0).publish(2, WeightStream(model))
    b.publish_weights(2, model.state_dict())
    got, want = _published(a, 2), _published(b, 2)
    assert list(got) == [n for n, _, _ in weight_specs(model)] and set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("fp8", [False, True])
def test_hf_file_channel_streams_what_publish_hf_writes(tmp_path, fp8):
    model = _model(2)
    a, b = FileTransport(tmp_path / "a"), FileTransport(tmp_path / "b")
    HFFileChannel(a, rank=0, fp8=fp8).publish(5, WeightStream(model))
    publish_hf(b, 5, model, fp8=fp8)
    got, want = _published(a, 5), _published(b, 5)
    assert set(got) == set(want) and (a.weights_dir(5) / "config.json").exists()
    assert any(k.endswith("_scale_inv") for k in got) == fp8
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        bits = (lambda t: t.view(torch.uint8)) if fp8 else (lambda t: t)  # FP8: compare the bytes
        assert torch.equal(bits(got[k]), bits(want[k])), k


def test_hf_stream_renames_like_hf_weights():
    model = _model(3)
    specs, stream = hf_stream(model, weight_specs(model), ((k, v.detach()) for k, v in model.state_dict().items()))
    got = dict(stream)
    want = hf_weights(model)
    assert [s[0] for s in specs] == list(got) and set(got) == set(want)
    assert all(tuple(s[2]) == tuple(got[s[0]].shape) for s in specs)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_stream_is_gathered_once():
    ws = WeightStream(_model())
    ws.drain()
    with pytest.raises(RuntimeError, match="gathered once"):
        ws.tensors()


@pytest.mark.dist
def test_engine_broadcast_channel_delivers_each_version_then_says_goodbye(tmp_path):
    port = _port()
    model = _model(4)
    tr = FileTransport(tmp_path)
    rx = EngineWeightReceiver("127.0.0.1", port, backend="gloo", device=torch.device("cpu"), timeout_s=60).start()
    sender = BroadcastWeightSender("127.0.0.1", port, 1, timeout_s=60, backend="gloo", store_rank=1)
    channel = EngineBroadcast(sender, tr, rank=0, dtype=torch.bfloat16)
    try:
        for version in (0, 1):
            channel.publish(version, WeightStream(model))
            assert rx.wait_version(version, timeout=60) == version
            got = rx.take(version)
            want = model.state_dict()
            assert set(got) == set(want)
            assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)
            assert tr.weight_versions()[-1] == version and not (tr.weights_dir(version) / "model.safetensors").exists()
    finally:
        channel.close()  # the end-of-updates message
    rx.close(timeout=60)
    assert not rx.alive


def test_capabilities_are_declared_not_probed():
    for name in ("embedded", "vllm"):
        caps = get_backend(name).capabilities
        assert isinstance(caps, BackendCapabilities)
    assert get_backend("embedded").capabilities.engine_in_process and not get_backend("vllm").capabilities.server_pool

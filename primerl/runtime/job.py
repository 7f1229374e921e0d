"""Process entry points and the ``primerl rl`` launcher.

``primerl rl`` first runs the config's supervised warm start, if it has one (``[warm_start]``,
``trainer.vf_warmstart.job_warm_start``), then writes the resolved config to ``<output_dir>/config.toml`` and starts two
processes that only share files: the trainer (``primerl trainer``, under torchrun when
``num_trainer_ranks > 1``) and the orchestrator with its embedded inference engine
(``primerl orchestrator``). Each logs to ``<output_dir>/logs/<name>.log``; the launcher prints a
progress line per step from ``metrics.jsonl``, stops everything when one process fails (naming
it, with the end of its log), and at the end prints the reward curve and saves ``metrics.png``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from .trainer.checkpoint import latest_checkpoint, remove_stale_tmp_dirs
from .trainer.vf_warmstart import job_warm_start
from .config import RLConfig, to_toml
from .lifetime import LAUNCHER_PID_ENV, die_with_parent, pid_alive, watch_launcher
from .metrics import ascii_curve, progress_line, read_metrics, save_plot
from .output_dir import claim_output_dir
from .placement import resolve_placement
from .transport import FileTransport, make_transport

log = logging.getLogger("primerl")


def _pid_alive(pid: int | None):
    return (lambda: pid_alive(pid)) if pid else None


def start_step(cfg: RLConfig) -> int:
    if not cfg.checkpoint.resume:
        return 0
    found = latest_checkpoint(Path(cfg.output_dir) / "checkpoints")
    return found[0] if found else 0


def setup_logging(name: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s", stream=sys.stderr)


# ------------------------------------------------------------------------------------ processes
def trainer_main(cfg: RLConfig) -> None:
    from primerl.rl.envs import load_environment

    from .trainer.trainer import run_trainer

    setup_logging("trainer")
    watch_launcher()
    torch.set_num_threads(cfg.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    placement = resolve_placement(cfg)
    if placement.device == "cuda":  # before the process group: NCCL binds this rank to its GPU
        torch.cuda.set_device(placement.trainer_device(int(os.environ.get("LOCAL_RANK", "0"))))
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group(placement.dist_backend)
    try:
        env = load_environment(cfg.env.id, **cfg.env.args)
        run_trainer(cfg, env.vocab_size, orchestrator_alive=_pid_alive(int(os.environ.get("PRIMERL_PEER_PID", "0"))))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def make_client(cfg: RLConfig, vocab_size: int):
    from .orchestrator.orchestrator import EmbeddedClient

    if cfg.inference.backend == "vllm":
        from .policy import model_config
        from .inference.vllm_client import VLLMClient
        from .inference.vllm_launch import wants_routing

        mc = model_config(cfg, vocab_size)  # to check routed experts [N, L, k]
        return VLLMClient(cfg.inference.vllm, timeout_s=cfg.inference.timeout_s, output_dir=cfg.output_dir,
                          num_layers=len(mc.moe_layer_ids), top_k=mc.top_k, expect_routing=wants_routing(cfg))
    from .inference.engine import InferenceEngine
    from .policy import build_model

    i = cfg.inference
    placement = resolve_placement(cfg)
    device = placement.engine_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = build_model(cfg, vocab_size, device=device, dtype=placement.param_dtype)
    engine = InferenceEngine(model, max_batch_size=i.max_batch_size, kv_cache=i.kv_cache,
                             capture_routing=i.capture_routing, fp8_experts=i.fp8_experts,
                             router_noise=i.router_noise, noise_seed=cfg.seed, kv_cache_gb=i.kv_cache_gb)
    log.info("embedded engine on %s in %s; weights by %s", device, placement.param_dtype, placement.weight_update)
    receiver = None
    if placement.weight_update == "broadcast":
        from .inference.weight_sync import EngineWeightReceiver

        receiver = EngineWeightReceiver("127.0.0.1", i.broadcast_port, backend=placement.broadcast_backend,
                                        device=device, timeout_s=cfg.orchestrator.weights_timeout_s).start()
    return EmbeddedClient(engine, timeout_s=i.timeout_s, receiver=receiver)


def orchestrator_main(cfg: RLConfig) -> None:
    from primerl.rl.envs import load_environment

    from .orchestrator.vf_orchestrator import build_orchestrator  # the built-in Orchestrator, or the verifiers path
    from .policy import model_config

    setup_logging("orchestrator")
    watch_launcher()
    torch.set_num_threads(cfg.threads)
    env = load_environment(cfg.env.id, **cfg.env.args)
    start = start_step(cfg)
    transport = make_transport(cfg, Path(cfg.output_dir) / "transport", "orchestrator")
    transport.drop_batches_from(start)
    client = make_client(cfg, env.vocab_size)
    orch = build_orchestrator(cfg, env, client, transport, start_step=start,
                        trainer_alive=_pid_alive(int(os.environ.get("PRIMERL_PEER_PID", "0"))),
                        top_k=model_config(cfg, env.vocab_size).top_k)

    def on_batch(step, m):
        log.info("batch %d written: reward %.3f off_policy<=%d version %d %.0f tok/s", step, m["reward/mean"],
                 m["off_policy/max"], m["policy_version"], m["inference/tokens_per_s"])

    orch.run(on_batch=on_batch)


# ------------------------------------------------------------------------------------ launcher
class JobFailed(RuntimeError):
    pass


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def first_failure(procs: dict[str, subprocess.Popen], log_dir: Path) -> str | None:
    """The failure to report, or None while no process has failed. When several have, the cause
    comes first: a process that stopped because its peer was gone (ProducerDied in its log) is not."""
    failed = [(name, p.returncode, log_dir / f"{name}.log") for name, p in procs.items() if p.poll() not in (None, 0)]
    if not failed:
        return None
    failed.sort(key=lambda f: "ProducerDied" in _tail(f[2]))
    name, rc, log_path = failed[0]
    return f"the {name} exited with code {rc}; end of {log_path}:\n" + _tail(log_path)


def prepare_output(cfg: RLConfig) -> int:
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for d in ("checkpoints", "transport/weights"):  # temp dirs of saves that failed or were killed
        remove_stale_tmp_dirs(out / d)
    step = start_step(cfg)
    if not cfg.checkpoint.resume:
        for name in ("transport", "checkpoints"):
            shutil.rmtree(out / name, ignore_errors=True)
        (out / "metrics.jsonl").unlink(missing_ok=True)
    transport = FileTransport(out / "transport")
    transport.drop_batches_from(step)
    transport.drop_weights_after(step)
    (out / "config.toml").write_text(to_toml(cfg))
    (out / "logs").mkdir(exist_ok=True)
    return step


def _spawn(args: list[str], log_path: Path, env: dict) -> subprocess.Popen:
    f = open(log_path, "ab")
    return subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            preexec_fn=die_with_parent(os.getpid()))


def _stop(p: subprocess.Popen | None, grace: float = 5.0) -> None:
    if p is None or p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(grace)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def run_rl(cfg: RLConfig, *, quiet: bool = False, poll_s: float = 0.2) -> list[dict]:
    """Run trainer + orchestrator as two processes until ``max_steps``; return the metrics rows.

    Holds ``output_dir``'s lock for the job's life (``output_dir.claim_output_dir``)."""
    with claim_output_dir(cfg):
        cfg = job_warm_start(cfg, quiet=quiet)
        if cfg.deployment.kind == "nodes":  # several nodes on this machine (127.x hosts)
            from .launch.local import run_nodes

            return run_nodes(cfg, quiet=quiet, poll_s=poll_s)
        with launched_vllm(cfg, quiet=quiet):
            return _run_rl(cfg, quiet=quiet, poll_s=poll_s)


@contextlib.contextmanager
def launched_vllm(cfg: RLConfig, *, quiet: bool = True):
    """``inference.vllm.launch``: vLLM serves the job's initial policy for the job's life; its whole
    process group is stopped when the job ends, failed or not (``inference.vllm_launch.launch_for_job``)."""
    if cfg.inference.backend != "vllm" or not cfg.inference.vllm.launch:
        yield None
        return
    from primerl.rl.envs import load_environment

    from .inference.vllm_client import InferenceServerError
    from .inference.vllm_launch import launch_for_job

    if not quiet:
        print(f"primerl rl: starting vLLM on {cfg.inference.vllm.url} (log: {Path(cfg.output_dir) / 'logs' / 'vllm.log'})",
              flush=True)
    try:
        server = launch_for_job(cfg, load_environment(cfg.env.id, **cfg.env.args).vocab_size)
    except InferenceServerError as e:
        raise JobFailed(f"launching vLLM: {e}") from None
    try:
        yield server
    finally:
        server.stop()


def _run_rl(cfg: RLConfig, *, quiet: bool, poll_s: float) -> list[dict]:
    out = Path(cfg.output_dir)
    start = prepare_output(cfg)
    cfg_path = str(out / "config.toml")
    py = sys.executable
    base_env = dict(os.environ, OMP_NUM_THREADS=str(cfg.threads), PYTHONUNBUFFERED="1", **{LAUNCHER_PID_ENV: str(os.getpid())})
    t0 = time.perf_counter()
    if not quiet:
        print(f"primerl rl: output_dir {out} | start step {start} | logs in {out / 'logs'}", flush=True)
    orch = _spawn([py, "-m", "primerl.runtime.cli", "orchestrator", "--config", cfg_path], out / "logs" / "orchestrator.log",
                  dict(base_env, PRIMERL_PEER_PID=str(os.getpid())))
    trainer_cmd = [py, "-m", "primerl.runtime.cli", "trainer", "--config", cfg_path]
    if cfg.num_trainer_ranks > 1:
        trainer_cmd = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg.num_trainer_ranks}",
                       "-m", "primerl.runtime.cli", "trainer", "--config", cfg_path]
    trainer = _spawn(trainer_cmd, out / "logs" / "trainer.log",
                     dict(base_env, PRIMERL_PEER_PID=str(orch.pid)))
    (out / "pids").write_text(f"trainer {trainer.pid}\norchestrator {orch.pid}\n")
    seen = start - 1
    try:
        while True:
            rows = read_metrics(out / "metrics.jsonl")
            for r in rows:
                if r["step"] > seen:
                    seen = r["step"]
                    if not quiet and cfg.log.progress:
                        print(progress_line(r, cfg.max_steps), flush=True)
            failure = first_failure({"trainer": trainer, "orchestrator": orch}, out / "logs")
            if failure:
                raise JobFailed(failure)
            if trainer.returncode == 0:
                break
            time.sleep(poll_s)
    finally:
        _stop(trainer)
        _stop(orch)
    rows = read_metrics(out / "metrics.jsonl")
    if not rows or rows[-1]["step"] != cfg.max_steps - 1:  # nothing may go missing silently
        raise JobFailed(f"the trainer exited normally but {out / 'metrics.jsonl'} ends at step "
                        f"{rows[-1]['step'] if rows else None}, not {cfg.max_steps - 1}; end of the trainer's log:\n"
                        + _tail(out / "logs" / "trainer.log"))
    wall = time.perf_counter() - t0
    if not quiet:
        print(f"done: {len(rows)} steps in {wall:.1f} s; reward curve:\n{ascii_curve(rows)}", flush=True)
    if cfg.log.plot and rows:
        path = save_plot(rows, out / "metrics.png")
        if path and not quiet:
            print(f"plot saved to {path}", flush=True)
    return rows


def run_threads(cfg: RLConfig, *, quiet: bool = True, parts: dict | None = None) -> list[dict]:
    """The same job in ONE process: trainer in a thread, orchestrator + engine in this one.

    For tests, notebooks and experiments; each side still talks only through the transport.
    Holds ``output_dir``'s lock for the job's life, as ``run_rl`` does. ``parts``, when given,
    receives the job's ``"client"`` (with the engine) and, at the end, its ``"trainer"``.
    """
    with claim_output_dir(cfg):
        cfg = job_warm_start(cfg, quiet=quiet)
        with launched_vllm(cfg):
            return _run_threads(cfg, quiet=quiet, parts={} if parts is None else parts)


def _run_threads(cfg: RLConfig, *, quiet: bool, parts: dict) -> list[dict]:
    import threading

    from primerl.rl.envs import load_environment

    from .orchestrator.vf_orchestrator import build_orchestrator  # the built-in Orchestrator, or the verifiers path
    from .policy import model_config
    from .trainer.trainer import run_trainer

    out = Path(cfg.output_dir)
    start = prepare_output(cfg)
    env = load_environment(cfg.env.id, **cfg.env.args)
    errors: list[BaseException] = []
    done = threading.Event()

    def trainer_thread():
        try:
            parts["trainer"] = run_trainer(cfg, env.vocab_size, orchestrator_alive=lambda: not errors)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
        finally:
            done.set()

    cfg.log.progress = cfg.log.progress and not quiet
    th = threading.Thread(target=trainer_thread, name="trainer", daemon=True)
    th.start()
    transport = make_transport(cfg, out / "transport", "orchestrator")
    client = parts["client"] = make_client(cfg, env.vocab_size)
    orch = build_orchestrator(cfg, env, client, transport, start_step=start,
                        trainer_alive=lambda: not done.is_set() or not errors, top_k=model_config(cfg, env.vocab_size).top_k)
    try:
        orch.run()
    except BaseException:
        getattr(transport, "close", lambda: None)()  # the ZeroMQ batch server's port
        if errors:
            raise errors[0]
        raise
    th.join(timeout=cfg.trainer.batch_timeout_s + 60)
    getattr(transport, "close", lambda: None)()
    if errors:
        raise errors[0]
    receiver = getattr(client, "receiver", None)
    if receiver is not None:  # the trainer said goodbye: let the receiving thread leave its group
        receiver.join(timeout=30)
    return read_metrics(out / "metrics.jsonl")

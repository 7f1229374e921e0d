"""The ``primerl`` command.

    primerl rl           --config examples/reverse_text.toml [--key.sub value ...] [--dry-run]
    primerl trainer      --config ...   (one process, or under torchrun --nproc-per-node N)
    primerl orchestrator --config ...   (rollouts + embedded inference engine, or a vLLM client)
    primerl inference    --config ... [--host H --port P]   (the embedded engine as an HTTP server)
    primerl vllm-command --config ...   (print the `vllm serve` command the config maps to)
    primerl node         --config ... --role trainer|orchestrator|inference [--node-rank R] [--rdzv HOST:PORT]
                         (one node of a multi-node job, [deployment]; rank from SLURM_NODEID if not given)
    primerl plan         --config ... [--device-memory 141GB] [--seq-len N] [--link-gbps 400]
                         (the memory plan, and the predicted weight-update time)
    primerl eval         --config ... --checkpoint OUTPUT_DIR/checkpoints/step_N   (the [[eval.env]]s on it)

Every subcommand takes the same config file and overrides, so a cluster can run the pieces
separately against one ``output_dir`` on a shared filesystem.
"""

from __future__ import annotations

import argparse
import sys

from .config import ConfigError, describe_parallel, to_toml
from .inference.backend import get_backend
from .placement import describe_placement
from .validate import load_config

SUBCOMMANDS = ("rl", "trainer", "orchestrator", "inference", "vllm-command", "node", "plan", "eval")


def _parser() -> argparse.ArgumentParser:
    # no abbreviations: "--device cpu" is the config key `device`, not a prefix of --device-memory
    p = argparse.ArgumentParser(prog="primerl", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=SUBCOMMANDS)
    p.add_argument("--config", default=None, help="TOML config file")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    p.add_argument("--host", default="127.0.0.1", help="inference: address to serve on")
    p.add_argument("--port", type=int, default=8000, help="inference: port to serve on")
    p.add_argument("--role", default=None, help="node: trainer, orchestrator or inference; "
                   "inference: prefill, decode or both (default: both; prefill/decode disaggregation), or teacher "
                   "(serve distill.teacher's model for POST /v1/score)")
    p.add_argument("--node-rank", type=int, default=None, help="node: index in the plan (default: SLURM_NODEID)")
    p.add_argument("--rdzv", default=None, help="node: rendezvous HOST:PORT (default: deployment.rdzv_endpoint)")
    p.add_argument("--device-memory", default="141GB", help="plan / --dry-run: memory of one device (141GB, 80GiB)")
    p.add_argument("--link-gbps", type=float, default=400.0,
                   help="plan: one GPU's network link in Gb/s for the predicted weight-update time (default 400, RDMA)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="plan: tokens per micro-batch (default orchestrator.seq_len)")
    p.add_argument("--checkpoint", default=None, help="eval: a checkpoint folder (<output_dir>/checkpoints/step_N)")
    return p


def _memory_plan(cfg, args) -> str:
    from .memory_plan import format_plan, parse_bytes, plan_for_config

    try:
        device_memory = parse_bytes(args.device_memory)
    except ValueError as e:
        raise ConfigError(f"--device-memory: {e}") from None
    plan = plan_for_config(cfg, device_memory=device_memory, seq_len=args.seq_len)
    return format_plan(plan) + _update_plan(cfg, plan, args)


def _update_plan(cfg, plan, args) -> str:
    from .memory_plan import param_counts
    from .update_plan import format_update_plan

    if not args.link_gbps > 0:
        raise ConfigError(f"--link-gbps must be > 0, got {args.link_gbps}")
    return format_update_plan(cfg, param_counts(plan.model).total, link_gbps=args.link_gbps)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, rest = _parser().parse_known_args(argv)
    try:
        # plan: the config's own checks, not this machine's (a GPU cluster is planned from a laptop)
        cfg = load_config(args.config, rest, this_machine=args.command != "plan")
    except ConfigError as e:
        print(f"primerl: config error: {e}", file=sys.stderr)
        return 2
    if args.command == "rl":
        from .launch.deployment import check_fixed_ports, check_rendezvous_port

        try:
            check_rendezvous_port(cfg)
            check_fixed_ports(cfg)
        except ConfigError as e:
            print(f"primerl: config error: {e}", file=sys.stderr)
            return 2
    if args.command == "plan" or args.dry_run:
        try:
            plan = _memory_plan(cfg, args)
        except ConfigError as e:
            if args.command == "plan" or e.args[0].startswith(("--device-memory", "--link-gbps")):
                print(f"primerl: config error: {e}", file=sys.stderr)
                return 2
            plan = f"# memory plan: not made: {e}\n"  # the dry run's checks passed; say why there is no plan
    if args.command == "plan":
        print(plan, end="")
        return 0
    if args.dry_run:
        print(to_toml(cfg), end="")
        print(describe_parallel(cfg), end="")
        print(describe_placement(cfg), end="")
        print(get_backend(cfg).describe(cfg), end="")  # the servers, router and roles the backend starts
        print(plan, end="")
        return _describe_launch(cfg)
    if args.command == "node":
        from .launch.node import NodeError, node_main

        try:
            return node_main(cfg, args.config, rest, args.role or "", node_rank=args.node_rank, rdzv=args.rdzv)
        except NodeError as e:
            print(f"primerl node: FAILED: {e}", file=sys.stderr)
            return e.exit_code
    if args.command == "rl":
        from .launch.common import JobFailed
        from .launch.launcher import run_job
        from .output_dir import OutputDirError, OutputDirUnusable

        try:
            run_job(cfg)
        except (OutputDirUnusable, ConfigError) as e:
            print(f"primerl: config error: {e}", file=sys.stderr)
            return 2
        except (JobFailed, OutputDirError) as e:
            print(f"primerl rl: FAILED: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("primerl rl: interrupted", file=sys.stderr)
            return 130
        return 0
    if args.command == "eval":
        import json

        from .orchestrator.evaluate import evaluate_checkpoint

        if not args.checkpoint:
            print("primerl: config error: --checkpoint: primerl eval needs a checkpoint folder", file=sys.stderr)
            return 2
        try:
            out = evaluate_checkpoint(cfg, args.checkpoint)
        except ConfigError as e:
            print(f"primerl: config error: {e}", file=sys.stderr)
            return 2
        for k, v in out.items():
            print(f"{k} {json.dumps(v)}")
        return 0
    if args.command == "trainer":
        from .trainer.main import trainer_main

        trainer_main(cfg)
    elif args.command == "orchestrator":
        from .orchestrator.main import orchestrator_main

        orchestrator_main(cfg)
    elif args.command == "inference":
        from .inference.server import serve

        serve(cfg, host=args.host, port=args.port, role=args.role or "both")
    elif args.command == "vllm-command":
        from .inference.vllm_launch import serve_command_line

        print(serve_command_line(cfg))
    return 0


def _describe_launch(cfg) -> int:
    """The launcher's plan (``launcher.describe``): the node plan; with SLURM the sbatch script, with
    nodes the command of each node."""
    from .launch.launcher import get_launcher

    try:
        print(get_launcher(cfg).describe(cfg), end="")
        print(_describe_supervision(cfg), end="")
    except ConfigError as e:
        print(f"primerl: config error: {e}", file=sys.stderr)
        return 2
    return 0


def _describe_supervision(cfg) -> str:
    """The plan's supervision line: checkpoint interval, restart budget, stall timeout (issue 45)."""
    from .config.deployment import effective_max_restarts
    from .launch.launcher import get_launcher

    d, c = cfg.deployment, cfg.checkpoint
    n = effective_max_restarts(cfg)
    every = f"every {c.interval} steps" if c.interval else "at the end only"
    caps = get_launcher(cfg).capabilities
    if not (caps.restarts or caps.job_restarts):
        restarts = f"none by this launcher (deployment.kind {d.kind!r})"
    elif n:
        restarts = (f"up to {n} (deployment.max_restarts{' auto' if d.max_restarts < 0 else ''}), each from the last "
                    f"complete checkpoint, the rest stopped within grace_s {d.grace_s:g} s")
    else:
        restarts = "none (deployment.max_restarts = 0: the first death or stall fails the job)"
    stall = f"{d.stall_timeout_s:g} s without progress" if d.stall_timeout_s else "off"
    if d.stall_timeout_s and d.stall_startup_s > d.stall_timeout_s:
        stall += f" ({d.stall_startup_s:g} s in the start-up: deployment.stall_startup_s)"
    return f"# supervision: checkpoints {every}; restarts {restarts}; stall watchdog {stall}\n"


if __name__ == "__main__":
    raise SystemExit(main())

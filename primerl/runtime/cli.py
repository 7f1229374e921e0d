"""The ``primerl`` command.

    primerl rl           --config examples/reverse_text.toml [--key.sub value ...] [--dry-run]
    primerl trainer      --config ...   (one process, or under torchrun --nproc-per-node N)
    primerl orchestrator --config ...   (rollouts + embedded inference engine, or a vLLM client)
    primerl inference    --config ... [--host H --port P]   (the embedded engine as an HTTP server)
    primerl vllm-command --config ...   (print the `vllm serve` command the config maps to)
    primerl node         --config ... --role trainer|orchestrator|inference [--node-rank R] [--rdzv HOST:PORT]
                         (one node of a multi-node job, [deployment]; rank from SLURM_NODEID if not given)
    primerl plan         --config ... [--device-memory 141GB] [--seq-len N]   (the memory plan)
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
                   "inference: prefill, decode or both (default: both; prefill/decode disaggregation)")
    p.add_argument("--node-rank", type=int, default=None, help="node: index in the plan (default: SLURM_NODEID)")
    p.add_argument("--rdzv", default=None, help="node: rendezvous HOST:PORT (default: deployment.rdzv_endpoint)")
    p.add_argument("--device-memory", default="141GB", help="plan / --dry-run: memory of one device (141GB, 80GiB)")
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
    return format_plan(plan_for_config(cfg, device_memory=device_memory, seq_len=args.seq_len))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, rest = _parser().parse_known_args(argv)
    try:
        cfg = load_config(args.config, rest)
    except ConfigError as e:
        print(f"primerl: config error: {e}", file=sys.stderr)
        return 2
    if args.command == "rl":
        from .launch.deployment import check_rendezvous_port

        try:
            check_rendezvous_port(cfg)
        except ConfigError as e:
            print(f"primerl: config error: {e}", file=sys.stderr)
            return 2
    if args.command == "plan" or args.dry_run:
        try:
            plan = _memory_plan(cfg, args)
        except ConfigError as e:
            if args.command == "plan" or e.args[0].startswith("--device-memory"):
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
            return 1
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
    except ConfigError as e:
        print(f"primerl: config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

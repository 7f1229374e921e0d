"""The ``primerl`` command.

    primerl rl           --config examples/reverse_text.toml [--key.sub value ...] [--dry-run]
    primerl trainer      --config ...   (one process, or under torchrun --nproc-per-node N)
    primerl orchestrator --config ...   (rollouts + embedded inference engine, or a vLLM client)
    primerl inference    --config ... [--host H --port P]   (the embedded engine as an HTTP server)
    primerl vllm-command --config ...   (print the `vllm serve` command the config maps to)

Every subcommand takes the same config file and overrides, so a cluster can run the pieces
separately against one ``output_dir`` on a shared filesystem.
"""

from __future__ import annotations

import argparse
import sys

from .config import ConfigError, describe_parallel, load_config, to_toml
from .placement import describe_placement

SUBCOMMANDS = ("rl", "trainer", "orchestrator", "inference", "vllm-command")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="primerl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=SUBCOMMANDS)
    p.add_argument("--config", default=None, help="TOML config file")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    p.add_argument("--host", default="127.0.0.1", help="inference: address to serve on")
    p.add_argument("--port", type=int, default=8000, help="inference: port to serve on")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, rest = _parser().parse_known_args(argv)
    try:
        cfg = load_config(args.config, rest)
    except ConfigError as e:
        print(f"primerl: config error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(to_toml(cfg), end="")
        print(describe_parallel(cfg), end="")
        print(describe_placement(cfg), end="")
        return 0
    from . import job
    from .output_dir import OutputDirError, OutputDirUnusable

    if args.command == "rl":
        try:
            job.run_rl(cfg)
        except OutputDirUnusable as e:
            print(f"primerl: config error: {e}", file=sys.stderr)
            return 2
        except (job.JobFailed, OutputDirError) as e:
            print(f"primerl rl: FAILED: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("primerl rl: interrupted", file=sys.stderr)
            return 130
        return 0
    if args.command == "trainer":
        job.trainer_main(cfg)
    elif args.command == "orchestrator":
        job.orchestrator_main(cfg)
    elif args.command == "inference":
        from .inference.server import serve

        serve(cfg, host=args.host, port=args.port)
    elif args.command == "vllm-command":
        from .inference.vllm_launch import serve_command_line

        print(serve_command_line(cfg))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

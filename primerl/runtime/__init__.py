"""The async RL runtime: the `primerl` command, the job and its config at the top, and one room per
process below (imports are lazy; nothing heavy loads with the package).

  config        typed job config (dataclasses), TOML + ``--key.sub value`` overrides, field checks;
                imports nothing from the runtime
  validate      the job's full check (config + node plan + placement + job combinations) and the
                validating ``load_config``: what ``primerl rl`` and ``--dry-run`` call
  cli           the ``primerl`` command (rl, trainer, orchestrator, inference, vllm-command, node, plan)
  placement     device resolution: where the trainer ranks and the engine run, NCCL or gloo, dtypes
  memory_plan   predicted peak bytes per trainer rank and per inference GPU before launch (`primerl plan`)
  policy        the policy model a config describes (model_config / build_model), for every process
  transport     FileTransport: atomic rollout batches and versioned weights between the processes
  zmq_transport ZmqTransport (rollout batches over TCP) and make_transport, which picks one
  metrics       metrics.jsonl (strict JSON: NaN/inf as null), progress line, plot
  output_dir    the job's exclusive lock on output_dir; refusal of a previous run's directory
  lifetime      trainer/orchestrator processes end with the launcher (PR_SET_PDEATHSIG + watchdog)
  processes     start_process / ManagedProcess / ProcessTable: the one way a job process is started
                (process group, log file, processes.json row, grace on stop)
  registry      Registry: a config name -> the object that serves it (launchers, inference backends)

  launch/       the launchers, one per deployment.kind (local, nodes, slurm, threads) behind a registry,
                and their shared preparation (launch/launcher.py): what runs where, in its docstring
  trainer/      the trainer process (main.py: ``primerl trainer``): Trainer / run_trainer, loss glue
                (_rl), checkpoints (full state, DCP), weight publication, finite-parameter guards,
                the padded attention path
  inference/    the engine and its HTTP server, the vLLM client / launcher / worker extension,
                weight sync to the engine, weights in the Hugging Face layout
  orchestrator/ the orchestrator process (main.py: ``primerl orchestrator``; clients.py: the inference
                client it makes): Orchestrator, rollouts, batching (advantages, packing), environment calls
"""

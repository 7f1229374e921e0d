"""The async RL runtime: embedded inference engine, orchestrator, trainer, the `primerl` command.

Modules (imports are lazy; nothing heavy loads with the package):
  config        typed job config (dataclasses), TOML + ``--key.sub value`` overrides, validation
  engine        InferenceEngine: continuous batching, KV cache, sampling, log-probs, router capture, FP8 experts
  orchestrator  Orchestrator: rollouts, async level, off-policy accounting, advantages, packing, hand-over
  rollout       episodes in flight (multi-turn transcripts, log-probs, routing record)
  trainer       Trainer / run_trainer: loss, AdamW, schedule, NaN handling, checkpoints, weight publication
  transport     FileTransport: atomic rollout batches and versioned weights
  checkpoint    atomic checkpoint save / load / latest
  dcp_checkpoint  sharded DCP checkpoints (save_dcp_checkpoint / load_dcp_checkpoint, optional async), any layout
  publish       iter_full_weights / publish_streamed: full weights to rank 0 one tensor at a time, streamed safetensors
  job           process entry points; run_rl (two processes) and run_threads (one process)
  cli           the ``primerl`` command (rl, trainer, orchestrator, inference, vllm-command)
  vllm, vllm_launch, vllm_worker, server   vLLM client, launcher, worker-side weight updates, the engine's HTTP server
  hf_weights    published weights in the Hugging Face layout (models.checkpoint.hf_layout), FP8 transfer
  weight_sync   WeightPublisher (trainer rank 0): files, or a torch.distributed broadcast to vLLM workers
  metrics       metrics.jsonl (strict JSON: NaN/inf as null), progress line, plot
  output_dir    the job's exclusive lock on output_dir; refusal of a previous run's directory
  lifetime      trainer/orchestrator processes end with the launcher (PR_SET_PDEATHSIG + watchdog)
  env_calls     concurrent environment calls with per-call deadlines; reward checks (rejected / clipped)
  guards        parameters checked finite after every update, before publication
"""

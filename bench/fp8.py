"""FP8 quantization: each op at DeepSeek-V3-like sizes, every backend against the reference.

Shapes: activations ``tokens x hidden`` (4096 x 7168, bf16) for per-token-group (1 x 128),
rowwise and tensorwise; a 7168 x 7168 bf16 weight for per-block (128 x 128). GB/s counts the
bytes read (input) plus written (fp8 values and float32 scales); ``ratio`` is the reference's
time over this backend's time in the same run (> 1 = faster than the reference).

On CUDA: reference (torch on the GPU), triton and, when primerl._C is built, cuda.
On CPU: the torch reference at CPU-sized shapes, plus the Triton kernels under the interpreter
at a tiny shape (backend ``triton-interpreter``: a correctness path, not a speed claim).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from .harness import Row, time_fn

BLOCK = 128
GPU_SHAPES = {"act": (4096, 7168), "weight": (7168, 7168)}
GPU_QUICK = {"act": (1024, 2048), "weight": (2048, 2048)}
CPU_SHAPES = {"act": (512, 7168), "weight": (1024, 2048)}
CPU_QUICK = {"act": (64, 1024), "weight": (256, 512)}
INTERPRETER_SHAPES = {"act": (8, 512), "weight": (256, 256)}


def _ops():
    from primerl.kernels import fp8

    return [
        ("quant_per_token_group", "act", lambda x, be: fp8.quant_per_token_group(x, BLOCK, backend=be)),
        ("quant_per_block", "weight", lambda x, be: fp8.quant_per_block(x, (BLOCK, BLOCK), backend=be)),
        ("quant_rowwise", "act", lambda x, be: fp8.quant_rowwise(x, backend=be)),
        ("quant_tensorwise", "act", lambda x, be: fp8.quant_tensorwise(x, backend=be)),
    ]


def _gbps(x: torch.Tensor, out, seconds: float) -> float:
    q, sf = out
    moved = x.numel() * x.element_size() + q.numel() * q.element_size() + sf.numel() * sf.element_size()
    return moved / seconds / 1e9


def _measure(op, fn, x, backend, label, device, repeats, ref_time=None) -> Row:
    out = fn(x, backend)
    t = time_fn(lambda: fn(x, backend), device=device, warmup=3, repeats=repeats)
    return Row(op=op, shape="x".join(map(str, x.shape)), dtype=f"{str(x.dtype)[6:]}->e4m3", backend=label,
               median_s=t, gbps=_gbps(x, out, t), ratio=None if ref_time is None else ref_time / t,
               baseline="" if ref_time is None else "torch")


def interpreter_rows() -> list[Row]:
    """Reference vs Triton-under-the-interpreter at tiny shapes (run with TRITON_INTERPRET=1)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for op, kind, fn in _ops():
        x = torch.randn(*INTERPRETER_SHAPES[kind], generator=g).to(torch.bfloat16)
        ref = _measure(op, fn, x, "torch", "torch", "cpu", 3)
        rows += [ref, _measure(op, fn, x, "triton", "triton-interpreter", "cpu", 3, ref.median_s)]
    return rows


def _interpreter_rows_in_subprocess() -> list[Row]:
    # TRITON_INTERPRET must be set before triton itself is imported (its own @jit library functions
    # such as tl.max are decorated then), and the harness has imported triton already.
    code = "import json, dataclasses; from bench.fp8 import interpreter_rows; " \
           "print(json.dumps([dataclasses.asdict(r) for r in interpreter_rows()]))"
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                         cwd=Path(__file__).resolve().parent.parent)
    if res.returncode != 0:
        print(f"bench fp8: interpreter rows failed:\n{res.stderr[-2000:]}", file=sys.stderr)
        return []
    return [Row(**r) for r in json.loads(res.stdout.strip().splitlines()[-1])]


def run(args) -> list[Row]:
    from primerl.kernels import backend_status

    device = args.device
    rows: list[Row] = []
    g = torch.Generator().manual_seed(0)
    if device == "cuda":
        shapes = GPU_QUICK if args.quick else GPU_SHAPES
        backends = ["triton"] + (["cuda"] if backend_status("cuda").available else [])
        x = torch.randn(*shapes["act"], generator=g).to(device="cuda", dtype=torch.bfloat16)
        copy_t = time_fn(lambda: x.clone(), device="cuda")
        rows.append(Row(op="copy (bandwidth roof)", shape="x".join(map(str, x.shape)), dtype="bf16", backend="torch",
                        median_s=copy_t, gbps=2 * x.numel() * x.element_size() / copy_t / 1e9))
        for op, kind, fn in _ops():
            x = torch.randn(*shapes[kind], generator=g).to(device="cuda", dtype=torch.bfloat16)
            ref = _measure(op, fn, x, "torch", "torch", device, 20)
            rows.append(ref)
            for be in backends:
                rows.append(_measure(op, fn, x, be, be, device, 20, ref.median_s))
        return rows

    shapes = CPU_QUICK if args.quick else CPU_SHAPES
    for op, kind, fn in _ops():
        x = torch.randn(*shapes[kind], generator=g).to(torch.bfloat16)
        rows.append(_measure(op, fn, x, "torch", "torch", "cpu", 3 if args.quick else 7))
    return rows + _interpreter_rows_in_subprocess()

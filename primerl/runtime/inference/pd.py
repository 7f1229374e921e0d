"""Prefill/decode disaggregation for the embedded engine, spoken as vLLM's NixlConnector protocol.

vllm-router's P/D mode (``--vllm-pd-disaggregation --prefill URL --decode URL``) drives one request
in two legs, with the same ``X-Request-ID`` header on both (observed on vllm-router 0.1.17):

1. to a prefill server: the client's body with ``max_tokens = 1``, ``min_tokens = 1`` and
   ``kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false, ...nulls}``;
2. to a decode server: the client's original body plus the ``kv_transfer_params`` object of the
   prefill server's response, copied verbatim; the decode server's answer goes to the client.

A prefill server (``primerl inference --role prefill``) runs the prompt, samples the first token,
keeps the prompt's KV cache, first token, its log-prob and the prompt's routed experts under a
transfer id, and answers ``kv_transfer_params = {"do_remote_prefill": true, "remote_host",
"remote_port", "remote_request_id": <transfer id>, "remote_engine_id", ...}``. The decode server
(``--role decode``) PULLS that record with ``GET /kv_transfer/<id>`` (one-shot: the record is
dropped once read), checks it against its model, writes it into a batch slot and continues
generation; its answer carries the whole sample: the prefill token first, and routed experts
joined as ``[prompt rows from the prefill server; generated rows from the decode server]`` =
``[T - 1, L, k]``, the same record a colocated engine gives.

Transport: raw tensor bytes over HTTP (a JSON header + the tensors' bytes), pulled by the decode
side as NIXL reads a prefill server's blocks. Chosen over torch.distributed because the router pairs
ANY prefill with ANY decode per request: a process group needs a fixed world formed in advance,
and a vanished member hangs or poisons the whole group, where an HTTP pull fails that one request
with a clear error (connection refused / 404) and nothing else. The cost is a copy through the
host (measured in bench/RESULTS.md, issue 35); NCCL/NIXL device-to-device transfer is the GPU follow-up.

Failures of the hand-off (the prefill peer unreachable, a transfer id it does not know, a cache
whose shape or dtype does not match the decode server's model) raise ``KVTransferError`` before the
request reaches the engine; the server answers 500 naming it, and ``PDClient`` resamples the
request (counted in ``PDClient.counts``).
"""

from __future__ import annotations

import json
import struct
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .engine import Prefilled

ROLES = ("both", "prefill", "decode")
KV_ROUTE = "/kv_transfer/"
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8,
                               torch.int16, torch.int32, torch.int64)}


class KVTransferError(RuntimeError):
    """A KV hand-off failed: the message names the peer, the transfer id and what went wrong."""


# ------------------------------------------------------------------------------------ wire format
def encode_prefilled(pf: Prefilled, *, seed: int, prompt: list[int]) -> bytes:
    """-> 8-byte header length, JSON header, then k, v (and routing) raw bytes, C order."""
    tensors = {"k": pf.k, "v": pf.v}
    if pf.routing is not None:
        tensors["routing"] = pf.routing
    header = {"first_token": int(pf.first_token), "first_logprob": float(pf.first_logprob),
              "policy_version": int(pf.policy_version), "seed": int(seed), "prompt_len": len(prompt),
              "first_time": float(pf.first_time),
              "tensors": {n: {"shape": list(t.shape), "dtype": str(t.dtype)} for n, t in tensors.items()}}
    h = json.dumps(header).encode()
    parts = [struct.pack("<Q", len(h)), h]
    for t in tensors.values():
        t = t.detach().contiguous().cpu()
        parts.append(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return b"".join(parts)


def decode_prefilled(data: bytes) -> tuple[Prefilled, dict]:
    """Inverse of ``encode_prefilled`` -> (Prefilled, header). Raises KVTransferError on a torn body."""
    try:
        (n,) = struct.unpack_from("<Q", data, 0)
        header = json.loads(data[8:8 + n])
        off = 8 + n
        out = {}
        for name, meta in header["tensors"].items():
            dtype = _DTYPES[meta["dtype"]]
            shape = tuple(int(x) for x in meta["shape"])
            nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            if off + nbytes > len(data):
                raise ValueError(f"tensor {name} needs {nbytes} bytes at offset {off}, body has {len(data)}")
            buf = bytearray(data[off:off + nbytes])
            out[name] = (torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(shape) if nbytes
                         else torch.empty(shape, dtype=dtype))
            off += nbytes
        if off != len(data):
            raise ValueError(f"{len(data) - off} trailing bytes")
        pf = Prefilled(out["k"], out["v"], int(header["first_token"]), float(header["first_logprob"]),
                       out.get("routing"), int(header["policy_version"]), float(header.get("first_time", 0.0)))
    except (KeyError, ValueError, struct.error, json.JSONDecodeError) as e:
        raise KVTransferError(f"malformed KV hand-off body ({len(data)} bytes): {e}") from None
    return pf, header


# ------------------------------------------------------------------------------------ prefill side
class KVStore:
    """Prefilled records waiting for their decode server, by transfer id (thread-safe, one-shot).

    Records not pulled within ``ttl_s`` (the decode leg never came: a router retry elsewhere, a
    dead decode server) are dropped, and at most ``max_entries`` are kept (oldest dropped)."""

    def __init__(self, ttl_s: float = 120.0, max_entries: int = 4096):
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._lock = threading.Lock()
        self._items: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self.expired = 0

    def put(self, data: bytes) -> str:
        tid = uuid.uuid4().hex
        now = time.monotonic()
        with self._lock:
            self._items[tid] = (now, data)
            while self._items and (len(self._items) > self.max_entries
                                   or now - next(iter(self._items.values()))[0] > self.ttl_s):
                self._items.popitem(last=False)
                self.expired += 1
        return tid

    def take(self, tid: str) -> bytes | None:
        with self._lock:
            item = self._items.pop(tid, None)
        return None if item is None else item[1]

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


def prefill_params(host: str, port: int, engine_id: str, tid: str) -> dict:
    """The prefill response's ``kv_transfer_params`` (NixlConnector's keys; ``remote_request_id`` is
    the transfer id the decode server pulls)."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
            "remote_block_ids": [], "remote_host": host, "remote_port": int(port), "remote_request_id": tid,
            "tp_size": 1}


# ------------------------------------------------------------------------------------ decode side
def pull_prefilled(params: dict, *, timeout: float) -> tuple[Prefilled, dict, int, float]:
    """Fetch a prefill record named by a decode request's ``kv_transfer_params``
    -> (Prefilled, header, bytes, seconds). Raises KVTransferError naming the peer and the id."""
    host, port, tid = params.get("remote_host"), params.get("remote_port"), params.get("remote_request_id")
    if not host or not port or not tid:
        raise KVTransferError(f"kv_transfer_params needs remote_host, remote_port and remote_request_id "
                              f"(do_remote_prefill), got {params}")
    url = f"http://{host}:{int(port)}{KV_ROUTE}{tid}"
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            data = r.read()
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:300]
        raise KVTransferError(f"prefill peer {host}:{port} does not hold transfer {tid} "
                              f"(HTTP {e.code}: {detail})") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise KVTransferError(f"prefill peer {host}:{port} unreachable for transfer {tid}: {reason}") from None
    pf, header = decode_prefilled(data)
    return pf, header, len(data), time.perf_counter() - t0


class PDState:
    """One server's P/D side: its role, the prefill store, the pull pool and the counters
    (``GET /health`` shows them under ``pd``)."""

    COUNTS = ("prefills", "handoffs_sent", "handoffs_received", "handoff_bytes", "unknown_transfer",
              "peer_unreachable", "bad_cache", "expired")

    def __init__(self, role: str = "both", *, pull_timeout_s: float = 30.0, ttl_s: float = 120.0):
        if role not in ROLES:
            raise ValueError(f"inference role must be one of {ROLES}, got {role!r}")
        self.role = role
        self.engine_id = uuid.uuid4().hex[:12]
        self.store = KVStore(ttl_s=ttl_s)
        self.pull_timeout_s = pull_timeout_s
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-pull")
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(self.COUNTS, 0)
        self.handoff_seconds = 0.0

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def read(self) -> dict:
        with self._lock:
            return {"role": self.role, **self.counts, "expired": self.store.expired,
                    "handoff_seconds": round(self.handoff_seconds, 6), "held": len(self.store)}

    def serve_pull(self, tid: str) -> bytes | None:
        data = self.store.take(tid)
        if data is None:
            self.count("unknown_transfer")
        else:
            self.count("handoffs_sent")
        return data

    def start_decode(self, params: dict, check, submit) -> Future:
        """Pull in a worker thread, ``check(Prefilled, header)`` (raises ValueError on a mismatch),
        then ``submit(Prefilled, header) -> engine Future``; -> a Future of the engine's Completion
        that fails with KVTransferError when the hand-off does."""
        out: Future = Future()

        def run():
            try:
                pf, header, nbytes, secs = pull_prefilled(params, timeout=self.pull_timeout_s)
                try:
                    check(pf, header)
                except ValueError as e:
                    self.count("bad_cache")
                    raise KVTransferError(f"hand-off {params.get('remote_request_id')} from "
                                          f"{params.get('remote_host')}:{params.get('remote_port')}: {e}") from None
                with self._lock:
                    self.counts["handoffs_received"] += 1
                    self.counts["handoff_bytes"] += nbytes
                    self.handoff_seconds += secs
                inner = submit(pf, header)
            except KVTransferError as e:
                msg = str(e)
                if "unreachable" in msg:
                    self.count("peer_unreachable")
                elif "does not hold" in msg:
                    self.count("unknown_transfer")
                if not out.cancelled():
                    out.set_exception(e)
                return
            except BaseException as e:  # noqa: BLE001
                if not out.cancelled():
                    out.set_exception(e)
                return

            def chain(f: Future):
                if out.cancelled():
                    return
                if f.cancelled():
                    out.cancel()
                elif f.exception() is not None:
                    out.set_exception(f.exception())
                else:
                    out.set_result(f.result())

            inner.add_done_callback(chain)

        self._pool.submit(run)
        return out

"""A pool member for ``test_pool_broadcast``: speaks the weight RPCs of ``primerl inference``
(``GET /health``, ``POST /collective_rpc`` ``init_weight_transfer`` / ``update_weights_from_transfer``)
and kills itself with SIGKILL: ``python _pool_member.py send`` after the header of its first
version (a server killed in the middle of a send), ``python _pool_member.py join`` when asked to
join (a server killed while its pair forms). Prints its URL."""

import json
import os
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import torch.distributed as dist

from primerl.runtime.inference.weight_broadcast import _broadcast, new_group

group = None


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        data = json.dumps({"instance": "member", "weights_version": 0}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        global group
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if body["method"] == "init_weight_transfer":
            if sys.argv[1] == "join":
                os.kill(os.getpid(), signal.SIGKILL)
            host, port, timeout_s, prefix = body["args"]
            group = new_group(host, port, 1, 2, timeout_s=timeout_s, backend="gloo", prefix=prefix)
            data = json.dumps({"results": [None]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        held = torch.tensor([-1], dtype=torch.int64)  # the version it holds (none), the header, then killed
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        group.allreduce([held], opts).wait()
        n = torch.zeros(1, dtype=torch.int64)
        _broadcast(group, n)
        _broadcast(group, torch.zeros(int(n.item()), dtype=torch.uint8))
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(f"http://127.0.0.1:{httpd.server_address[1]}", flush=True)
    sys.stdout.flush()
    httpd.serve_forever()

"""A stand-in engine for the client's distributed transport: an HTTP server in its own process that joins the update
group as rank 1 (gloo), receives every broadcast it is told about, and answers like the endpoints of an SGLang
without weight-update sessions (404 on /begin_weight_update).

Usage: python tests/fake_engine.py PORT. A request whose first name starts with "reject" is received and then
answered with HTTP 400 (what the real server does for a refused update)."""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from sglang_fp8rl.cpu_runner import install_cpu_stubs

install_cpu_stubs()

STATE: dict = {}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def answer(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/init_weights_update_group":
            from sglang.srt.utils import init_custom_process_group

            STATE["group"] = init_custom_process_group(
                backend=body["backend"], init_method=f"tcp://{body['master_address']}:{body['master_port']}",
                world_size=body["world_size"], rank=body["rank_offset"], group_name=body["group_name"])
            self.answer(200, {"success": True, "message": "joined"})
        elif self.path == "/update_weights_from_distributed":
            received = []
            for dtype, shape in zip(body["dtypes"], body["shapes"]):
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                torch.distributed.broadcast(t, src=0, group=STATE["group"])
                received.append(float(t.float().sum()))
            STATE.setdefault("received", []).append(received)
            if body["names"][0].startswith("reject"):
                self.answer(400, {"success": False, "message": f"{body['names'][0]}: refused by the engine"})
            else:
                self.answer(200, {"success": True, "message": f"sums {received}"})
        elif self.path == "/update_weights_from_tensor":  # the step-complete marker of an engine without sessions
            STATE.setdefault("received", []).append(["tensor request"])
            self.answer(200, {"success": True, "message": "marker"})
        else:
            self.answer(404, {"success": False, "message": self.path})

    def do_GET(self) -> None:
        if self.path == "/get_server_info":
            self.answer(200, {"tp_size": 1, "received": STATE.get("received", [])})
        else:
            self.answer(404, {"success": False, "message": self.path})


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()

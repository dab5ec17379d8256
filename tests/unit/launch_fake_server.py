"""A stand-in for vLLM's API server in the process-handling tests: a real child process that logs
like vLLM, answers /health and /metrics, and can start a child of its own (as vLLM starts its
engine core), ignore SIGTERM, listen late, or exit with a code.

    python launch_fake_server.py PORT [--child] [--ignore-term] [--listen-after S] [--exit CODE]
"""

from __future__ import annotations

import argparse
import http.server
import os
import signal
import subprocess
import sys
import time

METRICS = """# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="fake"} 0
"""
ONEDNN_WARNING = "onednn_verbose,info,cpu,runtime:OpenMP,nthr:1 (a oneDNN warning printed on the way down)"


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        body = METRICS.encode() if self.path == "/metrics" else b""
        self.send_response(200 if self.path in ("/health", "/metrics") else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("port", type=int)
    p.add_argument("--child", action="store_true", help="a sleeping child (ignoring SIGTERM under --ignore-term)")
    p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--listen-after", type=float, default=0.0, help="seconds before /health answers")
    p.add_argument("--exit", type=int, default=None, help="print an engine failure and exit with this code")
    a = p.parse_args()
    if a.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    prefix = f"(APIServer pid={os.getpid()}) INFO 12-01 12:00:00"
    print(f"{prefix} [api_server.py:1] vLLM API server version 0.0-fake", flush=True)
    if a.child:
        ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if a.ignore_term else ""
        code = f"import signal, time\n{ignore}time.sleep(600)"
        child = subprocess.Popen([sys.executable, "-c", code])
        print(f"child pid {child.pid}", flush=True)
    print(f"VLLM_API_KEY is {'set' if os.environ.get('VLLM_API_KEY') else 'unset'}", flush=True)
    if a.exit is not None:
        print("(EngineCore pid=1) ERROR 12-01 12:00:01 [core.py:1] ValueError: fake engine failure", flush=True)
        print(ONEDNN_WARNING, flush=True)
        sys.exit(a.exit)
    time.sleep(a.listen_after)
    print(ONEDNN_WARNING, flush=True)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", a.port), Handler)
    print(f"{prefix} [launcher.py:1] Application startup complete.", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()

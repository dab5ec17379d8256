"""`bigmoe run --yes`'s serving half (bigmoe.run's launch and ready steps in headless.launch_and_serve) over
the fake server, for the signal tests:

    python launch_driver.py PORT [fake server flags...]

Prints the run's JSON lines; exits with the run's exit code."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from bigmoe import headless
from bigmoe import run as sequence
from bigmoe.errors import BigmoeError
from bigmoe.serve import launch, records

FAKE = str(Path(__file__).with_name("launch_fake_server.py"))


def main() -> int:
    port, flags = int(sys.argv[1]), sys.argv[2:]
    opts = sequence.RunOptions(model="fake", port=port, start_timeout=120)
    info = records.RunInfo(
        name="fake",
        pid=0,
        host="127.0.0.1",
        port=port,
        log=str(records.log_name("fake", port, time.strftime("%Y%m%d-%H%M%S"))),
        model_path="/nowhere",
        served_name="fake",
        started=time.time(),
    )
    steps = sequence.Steps(
        start_server=lambda preset, plan, path, opts: launch.start([sys.executable, FAKE, str(port), *flags], {}, info)
    )
    say = headless.Printer(as_json=True)
    start = lambda: sequence.launch_server(steps, None, None, Path(info.model_path), opts, say)  # noqa: E731
    ready = lambda server: sequence.ready(steps, server, opts, say)  # noqa: E731
    try:
        return headless.launch_and_serve(start, ready, opts, say)
    except BigmoeError as e:  # as bigmoe.cli.commands shows it
        print(f"bigmoe: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())

"""A process that has imported torch, triton and hyserve's kernels under the Triton interpreter
(``TRITON_INTERPRET=1``) and forks a child for each test file's interpreter checks, so that each file's checks no
longer pay for a fresh interpreter's imports (about 4 s of CPU each). Started by
:func:`hyserve.testing.triton_interpreter.interpreter_subprocess_results`, one per test process and environment.

Protocol, one JSON object a line: the test process writes ``{"file", "flag", "log"}`` to this process's stdin; it
forks a child that runs ``file`` as ``__main__`` with ``sys.argv = [file, flag]``, its stdout and stderr into
``log``, and answers ``{"pid"}`` at once and ``{"rc"}`` when the child has ended. EOF on stdin ends the process."""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import traceback

# Imported once here, before any child forks: what every interpreter check file imports.
PRELOAD = ("numpy", "torch", "triton", "triton.language", "pytest", "hyserve.testing.triton_interpreter",
           *(f"hyserve.kernels.{name}" for name in ("activation", "attention", "bitmask", "commit", "conv", "fp8",
                                                    "gating", "gdn", "gemv", "hyper_connection", "mamba2", "moe",
                                                    "norm", "ple", "rope")))


def _run_child(request: dict[str, str]) -> int:
    """In the forked child: run the file as ``python file flag`` would (its folder first on ``sys.path``)."""
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdin.close()
    sys.argv = [request["file"], request["flag"]]
    sys.path.insert(0, os.path.dirname(request["file"]))
    try:
        runpy.run_path(request["file"], run_name="__main__")
        code = 0
    except SystemExit as e:  # sys.exit(message) prints it and exits 1, as the interpreter does
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("interpreter_zygote needs TRITON_INTERPRET=1 in its environment")
    for name in PRELOAD:
        importlib.import_module(name)
    channel = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        channel.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os._exit(_run_child(request))
        channel.write(json.dumps({"pid": pid}) + "\n")
        channel.flush()
        _, status = os.waitpid(pid, 0)
        channel.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        channel.flush()


if __name__ == "__main__":
    main()

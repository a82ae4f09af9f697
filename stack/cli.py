"""The `phaseserve` command: one entry point for every service.

  phaseserve up         the whole stack on this machine (embedded Redis + scheduler + worker + gateway)
  phaseserve gateway    the HTTP API (OpenAI-compatible)
  phaseserve scheduler  the scheduling service
  phaseserve worker     a model worker
  phaseserve pull       fetch a model into the cache (default: SmolLM2-135M-Instruct), for offline starts
  phaseserve bench      the benchmark client
  phaseserve settings   the table of every setting (flag, environment variable, default)

Each subcommand imports only what it needs, so `phaseserve gateway` never loads torch.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys

from phaseserve import __version__

# subcommand -> (module, function taking argv)
COMMANDS = {
    "up": ("phaseserve.stack.launcher", "main"),
    "gateway": ("phaseserve.gateway.__main__", "main"),
    "scheduler": ("phaseserve.scheduler.service", "main"),
    "worker": ("phaseserve.workers.service", "main"),
    "pull": ("phaseserve.models.pull", "main"),
    "bench": ("phaseserve.stack.benchmark.cli", "main"),
}


def _stop_while_starting(signum: int, _frame) -> None:
    """SIGTERM before the service installs its own handler (slow imports, a model fetch, the thread probe):
    exit now. As a container's PID 1, a process with no handler ignores SIGTERM and is killed only after
    the stop grace period."""
    raise SystemExit(128 + signum)


def usage() -> str:
    return (__doc__ or "").split("\n\n")[1] + "\n\nRun `phaseserve COMMAND --help` for a command's flags."


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # inside the try: a reader that went away shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        # the reader closed the pipe (`phaseserve settings | head`): stop quietly, as cat does; stdout goes to
        # /dev/null so that the interpreter's own flush at exit does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # what a shell reports for a process ended by SIGPIPE


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print("usage: phaseserve COMMAND [flags]\n\n" + usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command in ("-V", "--version", "version"):
        print(f"phaseserve {__version__}")
        return 0
    if command == "settings":
        from phaseserve.settings import markdown_table

        if rest and rest[0] in ("-h", "--help"):
            print("usage: phaseserve settings\n\nPrints every setting of every service as a Markdown table: "
                  "flag, environment variable, default, the services that read it, what it does.")
            return 0
        print(markdown_table())
        return 0
    if command not in COMMANDS:
        print(f"phaseserve: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name, func = COMMANDS[command]
    signal.signal(signal.SIGTERM, _stop_while_starting)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            print(f"phaseserve: `{command}` is not available in this installation ({e})", file=sys.stderr)
            return 2
        raise
    code = getattr(module, func)(rest)
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())

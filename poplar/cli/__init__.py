"""The `poplar` command line: one subcommand per feature module.

Each module listed in ``COMMAND_MODULES`` defines ``register(subparsers)``, which adds its
subcommands and sets ``func`` (taking the parsed args, returning an exit code) on each.

Under torchrun (only there), the entry point runs inside torchrun's ``record``
(``torch.distributed.elastic.multiprocessing.errors``): an error that escapes a command is written
to the worker's error file, and ``poplar train``'s one failure line is written there too
(``poplar.process.failure``), so torchrun's failure summary shows the real error rather than
``error_file: <N/A>``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMAND_MODULES = [
    "poplar.cli.demo",
    "poplar.cli.export",
    "poplar.cli.plan",
    "poplar.cli.profile",
    "poplar.cli.simulate",
    "poplar.cli.train",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="poplar", description=__import__("poplar").__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # no launcher to tell (record would also take over faulthandler)
        return _main(argv)
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_main)(argv)


def _main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except BrokenPipeError:
        # the reader went away (`poplar simulate ... | head`): the rest of the output goes nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, FileNotFoundError) as e:  # our input errors carry the fix in the message
        print(f"poplar {args.command}: error: {e}", file=sys.stderr)
        return 2

"""Command-line interface: one module per command (``add`` its parser, ``run`` it); the work
lives in the library modules. :func:`main` maps every failure to one line and an exit status."""

from __future__ import annotations

import argparse
import sys

from specdec.cli import bench, generate, models, profile, serve, toy, train_head, verify
from specdec.cli.common import UsageError

# The commands in `specdec --help`'s order; each module has add(subparsers) and run(args).
COMMANDS = (toy, models, generate, serve, train_head, profile, bench, verify)
__all__ = ["UsageError", "build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """Bad arguments: one line saying what is wrong and where help is, not the whole usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n(see `{self.prog} --help`)\n")

def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="specdec",
        description="Exact speculative decoding: generate faster without changing what the model would say.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        command.add(sub)
    return parser

def main(argv: list[str] | None = None) -> int:
    """Run one command. Every failure is one line on stderr and a non-zero exit status: 2 for bad
    input, 1 for a failure while running, 130 for Ctrl-C (what was streamed stays), 141 when
    stdout is closed early. ``SPECDEC_DEBUG=1`` shows the traceback of an unexpected error."""
    import os

    from specdec.cache import CacheError, brief
    from specdec.models.loading import ModelLoadError
    from specdec.models.registry import InstallError

    parser = build_parser()
    args = parser.parse_args(argv)
    name = f"specdec {args.command}"
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (e.g. `| head`): say nothing more on stdout, not even at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        print(f"{name}: output closed early (broken pipe)", file=sys.stderr)
        return 141
    except (ModelLoadError, CacheError, InstallError, OSError) as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\n{name}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug: one line, the traceback on request
        if os.environ.get("SPECDEC_DEBUG"):
            raise
        print(f"{name}: internal error: {brief(exc)} (set SPECDEC_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1

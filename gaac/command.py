"""What every ``gaac`` command shares: its argument parser, its exit statuses, and the runner that turns a
user error into one line on stderr.

:mod:`gaac.cli` (``gaac calibrate``, ``stats``, ``pack``, ``unpack``) and :mod:`gaac.capture`
(``gaac capture``) both build on this module, and it imports neither: the command line dispatches to the
capture command, never the other way round.

Every error a user can cause -- a refused command line (:class:`UsageError`), any other
:class:`~gaac.errors.GAACError` or an ``OSError``, an optional package the command needs and does not find
-- ends the command with one line on stderr and exit status 2 (the missing package's line names the extra
that installs it); anything else is a bug and keeps its traceback.  A reader that closes the output early
(``| head``) ends the command quietly with status 141.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

from .errors import GAACError

EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 128 + 13       # what a shell reports for a program that SIGPIPE ended

# The optional packages a command may need, and the extra that installs each (setup.cfg).
EXTRAS = {"torch": "torch", "transformers": "hf", "gguf": "hf", "safetensors": "hf", "accelerate": "hf",
          "matplotlib": "plot", "numba": "cuda", "llvmlite": "cuda"}


class UsageError(GAACError):
    """A command line argparse refused."""


class CommandParser(argparse.ArgumentParser):
    """An argument parser whose refusal of a command line is a :class:`UsageError` (one line and exit 2,
    like every other user error) instead of argparse's usage text and exit."""

    def error(self, message):
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def run(command: Callable[[list[str]], int], argv=None) -> int:
    """Run ``command`` on ``argv`` (default: ``sys.argv[1:]``); its exit status, or :data:`EXIT_USAGE`
    after one line on stderr for a user error.

    A reader that closes the output early (``gaac stats --json | head``) ends the command quietly
    with status 141, as a program killed by SIGPIPE ends: no error, no traceback."""
    try:
        try:
            return _run(command, sys.argv[1:] if argv is None else list(argv))
        finally:
            sys.stdout.flush()             # here, where a closed pipe can still be caught
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at devnull so that flush has nowhere to fail.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):      # a stdout without a file descriptor: nothing to redirect
            pass
        return EXIT_BROKEN_PIPE


def _run(command: Callable[[list[str]], int], argv: list[str]) -> int:
    try:
        return command(argv)
    except BrokenPipeError:
        raise
    except (GAACError, OSError) as exc:
        return fail(exc)
    except ImportError as exc:
        extra = EXTRAS.get((exc.name or "").partition(".")[0])
        if extra is None:              # not an optional package: a broken installation or a bug
            raise
        return fail(f"this command needs {exc.name.partition('.')[0]}, which is not installed: "
                    f"pip install 'gaac[{extra}]'")


def fail(error) -> int:
    """Report a user error on one line of stderr; the exit status of every user error."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    print(f"gaac: error: {' '.join(lines)}", file=sys.stderr)
    return EXIT_USAGE

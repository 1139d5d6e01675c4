"""Operator tools: ``hyserve soak`` (a corruption soak: prefix caching + speculative decoding on a multi-turn agent
workload, every response checked) and ``hyserve bench`` (throughput and latency), offline or against a server.

- ``detectors``: pure heuristics for degenerate output (token loops, short cycles, punctuation runs, empty output).
- ``workload``: deterministic multi-turn agent conversations sharing long prefixes (also the prefix-caching
  benchmark's, ``benchmarks/prefix_cache_bench.py``).
- ``client``: a small client of an OpenAI-compatible server (token-id prompts, streaming, ``/metrics``).
- ``soak``, ``bench``: the subcommands; each has ``register(subparsers)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse

__all__ = ["add_missing_defaults"]


def add_missing_defaults(parser: argparse.ArgumentParser) -> None:
    """Append ``(default: X)`` to every option's help that does not already say its default, so that ``--help``
    lists every flag with its default."""
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings or action.help is None:
            continue
        if "default" in action.help.lower():
            continue
        default = action.default
        if isinstance(action, argparse._StoreTrueAction):
            shown = "off"
        elif isinstance(action, argparse._StoreFalseAction):
            shown = "on"
        elif default is None:
            shown = "none"
        else:
            shown = str(default)
        action.help = f"{action.help} (default: {shown.replace('%', '%%')})"

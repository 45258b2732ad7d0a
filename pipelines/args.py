"""The command line's shared manners: one parser shape for every ``megaray`` command.

Every command's help shows each argument with its default; the commands that take a config
list the shipped ones; options may come before or after the config and its overrides.
Imports nothing heavy (``megaray --help`` and ``megaray plan -h`` answer at once).
"""
from __future__ import annotations

import argparse
from importlib import resources


def shipped_configs() -> list[str]:
    """The names of the configs shipped with megaray (``demo``, ``debug``, ...)."""
    folder = resources.files("megaray.configs")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Each argument's default after its help (where it has one: a required argument, an
    unset option and a switch have none); descriptions and epilogs keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, False, [], argparse.SUPPRESS) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def parser(prog: str, description: str | None, takes_config: bool = False) -> argparse.ArgumentParser:
    """A command's parser; with ``takes_config`` its CONFIG and overrides arguments too."""
    epilog = None
    if takes_config:
        epilog = "shipped configs (use the name as CONFIG): " + ", ".join(shipped_configs())
    p = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog, formatter_class=_Formatter)
    if takes_config:
        p.add_argument("config", metavar="CONFIG", help="a YAML config file, or the name of a shipped config")
        p.add_argument("overrides", nargs="*", metavar="section.key=value",
                       help="overrides of the config's values, e.g. train.steps=20 optim.lr=3e-4")
    return p


def parse(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Options and positional arguments in any order (``plan demo --gpu-gib 80 train.steps=3``)."""
    return p.parse_intermixed_args(argv)

"""How the command line's help reads: plain text, every option with its default."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any


class HelpFormatter(argparse.HelpFormatter):
    """Descriptions filled paragraph by paragraph; each option's default shown.

    A description's paragraphs (separated by blank lines) are filled one by
    one, and a paragraph of indented lines (commands) is kept as written.
    An option's help gets `` (default: X)`` unless it states its default
    itself (``(default`` in its text), takes no value (a flag), is required
    (then `` (required)``) or has no default (None: its help must say what
    happens without it).
    """

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = textwrap.dedent(text).strip().split("\n\n")
        return "\n\n".join(
            textwrap.indent(p, indent)
            if p.startswith(" ")
            else textwrap.fill(
                " ".join(p.split()), width, initial_indent=indent, subsequent_indent=indent
            )
            for p in paragraphs
        )

    def _split_lines(self, text: str, width: int) -> list[str]:
        # Option names stay whole: "--checkpoint-dir", not "--checkpoint-" and "dir".
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "(default" in text or action.nargs == 0:
            return text
        if action.required:
            return f"{text} (required)"
        if action.default is None or action.default is argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` with :class:`HelpFormatter`; its subcommands' parsers too."""

    def __init__(self, *args: Any, formatter_class: Any = HelpFormatter, **kwargs: Any):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

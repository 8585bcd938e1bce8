"""One-line config errors naming the key, shared by the config checks of every torchtitan release.

Both torchtitan releases parse their command lines with tyro, which reports an error as a box
of wrapped lines meant for a terminal. A launcher that checks a config before starting any
worker wants ONE line naming the key as ``section.field``, with a did-you-mean for typos::

    optimizer.muon.ns_stepz: unknown key (command line --optimizer.muon.ns_stepz); did you mean
    optimizer.muon.ns_steps?

Text handling only: nothing here imports torchtitan or tyro.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence

__all__ = ["did_you_mean", "one_line", "stray_value", "unknown_key", "unrecognized_options"]

_TITLES = ("Invalid choice", "Value error", "Parsing error", "Required options")
_SECTIONS = ("Available subcommands:", "Perhaps you meant:", "Arguments similar to")


def did_you_mean(key: str, candidates: Iterable[str]) -> str:
    """``"; did you mean <closest>?"`` when a candidate is close to ``key``, else ``""``."""
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def unknown_key(key: str, where: str, candidates: Iterable[str] = ()) -> str:
    """``"<key>: unknown key (<where>)"`` plus a did-you-mean from ``candidates``."""
    return f"{key}: unknown key ({where}){did_you_mean(key, candidates)}"


def _box(text: str) -> list[str]:
    """The lines of tyro's box, without what was printed before it (e.g. log warnings)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "╭" in line or (i + 1 < len(lines) and re.fullmatch(r"\s*[-─━]{10,}\s*", lines[i + 1])):
            return lines[i:]
    return lines


def _words(text: str) -> str:
    """tyro's box as one string of words: borders, rules and the "--help" footer dropped."""
    words = []
    for line in _box(text):
        line = line.strip(" |│╭╮╰╯─┃━┏┓┗┛")
        if line.startswith("For full helptext"):
            break  # the rest ("run <program> --help", maybe wrapped) is not the error
        if not line:
            continue
        words.extend(w for w in line.split() if not re.fullmatch(r"[-─━]{3,}", w))
    return " ".join(words)


def one_line(text: str) -> str:
    """tyro's boxed error as one line (its title and rules dropped, wrapped lines joined)."""
    joined = _words(text)
    for title in _TITLES:
        if joined.startswith(title + " "):
            joined = joined[len(title) + 1 :]
    joined = joined.split(" Argument helptext:", 1)[0]
    joined = re.sub(r"^Error parsing [A-Z]\w*: ", "", joined)  # the root config's class
    joined = re.sub(r"^Error parsing (?:--)?([\w.-]+): (?=\1)", "", joined)
    joined = re.sub(r"^Error parsing (?:--)?([\w.-]+): ", r"\1: ", joined)
    return joined[:400] or "invalid command line"


def _flag_key(flag: str) -> str:
    """``--optimizer.muon.ns-steps=7`` -> ``optimizer.muon.ns_steps`` (tyro accepts both)."""
    return flag.lstrip("-").split("=", 1)[0].rstrip(",").replace("-", "_")


def stray_value(args: Sequence[str], value: str) -> str | None:
    """A value the parser did not take (``--optimizer.muon.compile true`` or ``...=true``),
    named by its flag: a flag that takes no value (a boolean). None unless exactly one flag of
    ``args`` has ``value`` after it (``--training.steps 7 ... 7`` does not say which one)."""
    found = []
    for i, arg in enumerate(args):
        if arg.startswith("--") and arg.endswith(f"={value}"):
            found.append((arg.split("=", 1)[0], arg))
        elif arg == value and i > 0 and args[i - 1].startswith("--") and "=" not in args[i - 1]:
            found.append((args[i - 1], f"{args[i - 1]} {value}"))
    if len(found) != 1:
        return None
    flag, given = found[0]
    head, _, last = flag[2:].rpartition(".")
    clear = f"--{head + '.' if head else ''}no-{last.replace('_', '-')}"
    return (
        f"{_flag_key(flag)}: a flag, it takes no value (command line {given}); "
        f"{flag} sets it, {clear} clears it"
    )


def unrecognized_options(text: str, args: Sequence[str] = ()) -> str | None:
    """tyro's "Unrecognized options" error as an :func:`unknown_key` line, else None.

    The first unrecognized flag is the key (``section.field``, underscores); tyro's first
    "Perhaps you meant" flag is the suggestion. Without a flag, a value after a boolean flag
    in ``args`` (the command line) is named by that flag (:func:`stray_value`).
    """
    joined = _words(text)
    found = re.search(r"Unrecognized options: (.*)", joined)
    if found is None:
        return None
    listed = found.group(1)
    for section in _SECTIONS:
        listed = listed.split(" " + section, 1)[0]
    tokens = [t.rstrip(",") for t in listed.split()]
    flags = [t for t in tokens if t.startswith("-")]
    if not flags:
        stray = stray_value(args, tokens[0]) if tokens else None
        return stray or f"unrecognized command-line arguments: {' '.join(tokens)}"
    hint = ""
    meant = re.search(r"Perhaps you meant: (.*)", joined)
    if meant:
        suggestions = [t for t in meant.group(1).split() if t.startswith("--")]
        if suggestions:
            hint = f"; did you mean {_flag_key(suggestions[0])}?"
    return f"{_flag_key(flags[0])}: unknown key (command line {flags[0]}){hint}"


def first_line(error: BaseException) -> str:
    """An exception's message as one line (its first), or its repr when it has no message."""
    text = str(error).strip()
    return text.splitlines()[0] if text else repr(error)

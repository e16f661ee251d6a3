"""Every command-line flag has an environment-variable equivalent, SPLITSPEC_<FLAG> with dashes
as underscores (--model-path -> SPLITSPEC_MODEL_PATH). A flag on the command line wins over the
variable, which wins over the built-in default. Containers are configured through these."""
from __future__ import annotations

import argparse
import os

PREFIX = "SPLITSPEC_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def env_name(action: argparse.Action) -> str:
    flag = next(s for s in action.option_strings if s.startswith("--"))
    return PREFIX + flag[2:].upper().replace("-", "_")


class ListFlag(argparse.Action):
    """Repeatable flag that also takes comma-separated lists; given on the command line it
    replaces (not extends) the default or the environment's list."""

    def __call__(self, parser, namespace, values, option_string=None):
        current = getattr(namespace, self.dest, None)
        items = [] if current is self.default or current is None else list(current)
        items.extend(v for v in values.split(",") if v)
        setattr(namespace, self.dest, items)


class _EnvAppend(argparse._AppendAction):
    """A repeatable flag whose default came from the environment: its first use on the command
    line replaces that list, so the command line wins as it does for every other flag."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is self.default:
            setattr(namespace, self.dest, [])
        super().__call__(parser, namespace, values, option_string)


def _convert(action: argparse.Action, raw: str, name: str):
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        low = raw.strip().lower()
        if low not in _TRUE + _FALSE:
            raise SystemExit(f"{name}={raw!r}: expected one of {', '.join(_TRUE + _FALSE[:-1])}")
        value = low in _TRUE
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if isinstance(action, ListFlag):
        return [v for v in raw.split(",") if v]
    if isinstance(action, argparse._AppendAction):
        # One value: items of these flags (stop strings) may themselves contain commas.
        return [action.type(raw) if action.type else raw]
    try:
        value = action.type(raw) if action.type else raw
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"{name}={raw!r}: {exc}") from None
    if action.choices is not None and value not in action.choices:
        raise SystemExit(f"{name}={raw!r}: expected one of {', '.join(map(str, action.choices))}")
    return value


def apply_env(parser: argparse.ArgumentParser, environ=None) -> argparse.ArgumentParser:
    """Take defaults from SPLITSPEC_* variables and name each variable in the flag's help."""
    environ = os.environ if environ is None else environ
    for action in parser._actions:
        if not any(s.startswith("--") for s in action.option_strings) or action.dest == "help":
            continue
        name = env_name(action)
        action.help = f"{action.help or ''} [env {name}]".strip()
        if name in environ:
            action.default = _convert(action, environ[name], name)
            action.required = False
            if type(action) is argparse._AppendAction:
                action.__class__ = _EnvAppend
    return parser


def check_ranges(args: argparse.Namespace, *, positive=(), non_negative=(), program: str = "") -> None:
    """Exit naming the first flag out of its range: those in `positive` must be > 0, those in
    `non_negative` >= 0 (argparse's dest names)."""
    where = f"{program}: " if program else ""
    for names, floor, words in ((positive, 0, "must be positive"), (non_negative, None, "must be >= 0")):
        for name in names:
            value = getattr(args, name)
            if not (value > 0 if floor == 0 else value >= 0):
                raise SystemExit(f"{where}--{name.replace('_', '-')} {words}")

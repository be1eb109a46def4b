"""What ``foundry train`` makes of a launcher's command line: foundry's own parser, built as ``foundry.cli.main``
builds it, so a flag the launchers pass and the CLI lacks (or spells differently) fails here."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import pytest

from foundry import cli


def parse_train_command(argv: Sequence[str]) -> argparse.Namespace:
    """The arguments ``foundry train`` reads from ``argv`` (``["foundry", "train", CFG, ...]``)."""
    assert list(argv[:2]) == ["foundry", "train"], f"not a `foundry train` command: {argv}"
    arguments = list(argv[1:])
    try:
        return cli.build_parser(cli.selected_command(arguments)).parse_args(arguments)
    except SystemExit:  # argparse has printed why (captured by pytest)
        pytest.fail(f"foundry's CLI parser refuses the launcher's command: {' '.join(argv)}")

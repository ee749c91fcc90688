"""Helpers for tests that drive a command module through typer's CliRunner."""

from __future__ import annotations

from typing import Callable

import typer


def cli_with(register: Callable[[typer.Typer], None]) -> typer.Typer:
    """A fresh Typer app with one command module registered on it.

    The callback makes the app a group, so a module with a single command keeps its name
    (``reward-audit ...``), as in the real CLI."""
    app = typer.Typer(add_completion=False)

    @app.callback()
    def main() -> None:
        pass

    register(app)
    return app


def cli_output(result) -> str:
    """stdout plus stderr of a CliRunner result (stderr is absent on some click versions)."""
    out = result.output
    try:
        out += result.stderr
    except (ValueError, AttributeError):
        pass
    return out

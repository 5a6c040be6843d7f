"""`moetier`: one command with subcommands (app.py), shared options and checks (options.py)."""


def main() -> None:
    from moetier.cli.app import app

    app()

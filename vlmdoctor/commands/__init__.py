"""The commands of `vlmdoctor`, one module each, every one registering on the one typer app (commands/app.py) through
its `register(app)`; vlmdoctor/cli.py registers them in the order `--help` lists them. Shared option groups:
commands/options.py; the run config's knobs as options: commands/knobs.py. A command's work lives in the stage
that owns it (docs/architecture.md), so a module here holds its options, the checks of its files, and its console.
"""

"""`overdrive list`: the workloads and techniques, with the devices each technique supports."""

from __future__ import annotations


def add_parser(sub) -> None:
    sub.add_parser("list", help="workloads and techniques, with the devices each supports")


def main(args, argv: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    from overdrive.techniques import list_techniques
    from overdrive.workloads import list_workloads

    console = Console()
    workloads = Table(title="workloads")
    workloads.add_column("name")
    workloads.add_column("what it is")
    for name, desc in list_workloads().items():
        workloads.add_row(name, desc)
    console.print(workloads)
    techniques = Table(title="techniques (composed in stage order)")
    for col in ("name", "stage", "devices", "lossless", "what it does"):
        techniques.add_column(col)
    for t in list_techniques():
        techniques.add_row(t.name, t.stage.name.lower(), ", ".join(t.devices), "yes" if t.lossless else "no", t.description)
    console.print(techniques)
    from overdrive.generate.tune import DESCRIPTIONS

    generation = Table(title="generation techniques (a causal LM: pydoc-lm; tried in this order)")
    for col in ("name", "what it does"):
        generation.add_column(col)
    for name, description in DESCRIPTIONS.items():
        generation.add_row(name, description)
    console.print(generation)
    return 0

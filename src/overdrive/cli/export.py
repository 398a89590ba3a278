"""`overdrive export PLAN --format F --out PATH`: the plan's model as an ONNX file, a torch.export
program, a Triton model repository or a KServe manifest (`overdrive.deploy.formats`)."""

from __future__ import annotations


def add_parser(sub) -> None:
    from overdrive.deploy.formats import FORMATS

    export = sub.add_parser("export", help="write a plan's model for deployment: onnx, pt2, triton, kserve")
    export.add_argument("plan", help="plan.json written by `overdrive optimize`")
    export.add_argument("--format", required=True, choices=FORMATS, help="what to write")
    export.add_argument("--out", required=True, help="the file (onnx, pt2) or folder (triton repository, kserve manifest)")
    export.add_argument("--name", help="the model's name in the Triton repository / KServe manifest (default: the workload's)")
    export.add_argument("--image", default="overdrive:latest", help="kserve: a container image with overdrive installed")
    export.add_argument("--overwrite", action="store_true", help="replace what is at --out")


FLAGS = {"plan": None}  # the plan is the positional PLAN

def main(args, argv: list[str]) -> int:
    from rich.console import Console

    from overdrive.deploy.formats import describe, export

    console = Console(soft_wrap=True)
    with console.status(f"exporting {args.plan} as {args.format}"):
        result = export(args.plan, args.format, args.out, name=args.name, image=args.image, overwrite=args.overwrite)
    for line in describe(result):
        console.print(line, markup=False, highlight=False)
    return 0

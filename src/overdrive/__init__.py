"""overdrive: make a PyTorch model run as fast as the hardware allows, and prove it.

    import overdrive
    result = overdrive.optimize(model, example_inputs)          # or overdrive.optimize("minilm")
    result.table                                                 # what each technique bought
    fast = result.model                                          # the optimized module
    result.save("out/mymodel")                                   # plan.json, results.json, report.md
    fast = overdrive.load("out/mymodel/plan.json", model)        # the plan rebuilt on a fresh copy
    overdrive.bench(fast, example_inputs, batch_sizes=[1, 8])    # {batch size: Measurement}
    overdrive.export(result, "onnx", "mymodel.onnx")             # also pt2, triton, kserve

The flow (docs/ARCHITECTURE.md): a Workload is measured eager in fp32, then with each technique
alone, then with the winners composed in canonical order; the result is a Plan that `serve`,
`run` and `train` reload. Errors are `OverdriveError`s (`ConfigError`, `WorkloadError`,
`PlanError`, `DataError`, `RunAborted`) whose messages name the arguments at fault.
"""

__version__ = "0.1.0"

# Exported lazily (PEP 562): `import overdrive` and the command line's start stay light; each
# name imports its module on first use.
_EXPORTS = {
    "optimize": "overdrive.tuning.api", "export": "overdrive.deploy.formats", "load": "overdrive.tuning.reuse", "bench": "overdrive.tuning.reuse",
    "OptimizeResult": "overdrive.tuning.result", "Plan": "overdrive.tuning.plan", "Measurement": "overdrive.core.measure",
    "Workload": "overdrive.core.workload", "list_techniques": "overdrive.techniques", "list_workloads": "overdrive.workloads",
    **{name: "overdrive.core.errors" for name in ("OverdriveError", "ConfigError", "WorkloadError", "PlanError",
                                                  "DataError", "RunAborted")},
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'overdrive' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])

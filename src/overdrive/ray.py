"""overdrive on Ray Data: `overdrive.ray.Predictor(plan)` for `ray.data.Dataset.map_batches`
(implemented in `overdrive.run.ray_engine`; `overdrive run PLAN --engine ray` uses it)."""

from overdrive.run.ray_engine import Predictor, run_on_ray

__all__ = ["Predictor", "run_on_ray"]

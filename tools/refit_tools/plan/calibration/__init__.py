"""The plan's calibration: every constant of the model, fitted from this repository's bench
results, with the files it came from. One module a job:

- `models`: what a calibration is (each figure with its sources; the constants at a rate);
- `file`: the calibration file (`load`, `write`, the `SHIPPED` one);
- `results`: finding, reading and checking the bench result files;
- `refit_runs`: what a `bench refit` result says (its deployment, whether it ran quiet);
- `codec_transport`: the codec and transport benches' figures;
- `numerics`: power law and non-negative least squares;
- `fitting`: `fit`, one function a stage of the refit window.

The package ships one fitted from this checkout's results (`plan/calibration.json`).
"""

from refit_tools.plan.calibration.codec_transport import CODEC_BATCH_S
from refit_tools.plan.calibration.file import SHIPPED, default_results_dir, load, write
from refit_tools.plan.calibration.fitting import CPU_BOUND_SHARE, LINK_BOUND_SHARE, fit
from refit_tools.plan.calibration.models import (
    QUIET_LOAD_PER_CPU,
    Calibration,
    CalibrationError,
    Costs,
    Curve,
    Kind,
    PowerLaw,
    Scalar,
    Source,
    bench_machine,
)
from refit_tools.plan.calibration.numerics import nnls
from refit_tools.plan.calibration.refit_runs import (
    bench_deployment,
    bench_last_tensor_bytes,
    bench_regions,
    is_quiet,
    link_bytes_s,
    load_of,
    rate_rows,
)

__all__ = [
    "CODEC_BATCH_S",
    "CPU_BOUND_SHARE",
    "LINK_BOUND_SHARE",
    "QUIET_LOAD_PER_CPU",
    "SHIPPED",
    "Calibration",
    "CalibrationError",
    "Costs",
    "Curve",
    "Kind",
    "PowerLaw",
    "Scalar",
    "Source",
    "bench_deployment",
    "bench_last_tensor_bytes",
    "bench_machine",
    "bench_regions",
    "default_results_dir",
    "fit",
    "is_quiet",
    "link_bytes_s",
    "load",
    "load_of",
    "nnls",
    "rate_rows",
    "write",
]

"""overdrive: make a PyTorch model run as fast as the hardware allows, and prove it.

The flow (see README.md): a Workload is measured eager in fp32, then with each technique
alone, then with the winners composed in canonical order; the result is a Plan.
"""

__version__ = "0.1.0"

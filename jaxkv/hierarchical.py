"""QuantSpec's hierarchical INT8 codes: an upper INT4 plane (the draft view)
and a lower INT4 plane (with the upper, the target view).

The code lives in `pallas_kernels.hierarchical` (the kernels reconstruct the
same bits; see its docstring for the exact rule); this is its public name.
"""

from pallas_kernels.hierarchical import VIEWS
from pallas_kernels.hierarchical import check_view
from pallas_kernels.hierarchical import dequantize
from pallas_kernels.hierarchical import packed_planes
from pallas_kernels.hierarchical import plane_row
from pallas_kernels.hierarchical import plane_view
from pallas_kernels.hierarchical import planes
from pallas_kernels.hierarchical import quantize

__all__ = ["VIEWS", "check_view", "dequantize", "packed_planes", "plane_row", "plane_view",
           "planes", "quantize"]

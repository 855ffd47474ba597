"""Context parallelism: a slice of every sequence per rank; attention over it (ring, Ulysses).

Context parallelism: each rank of a cp group holds a slice of every sequence, and attention
sees the whole sequence through the group (ring: keys and values pass around; ulysses: an
all-to-all to whole sequences of a head group and back).
"""

from dsnd.cp.context import ContextParallel
from dsnd.cp.slices import IMPLS, slice_positions

__all__ = ["IMPLS", "ContextParallel", "slice_positions"]

"""Input pipelines producing torchrec ``Batch``es: synthetic Criteo-like data and the Criteo TSV reader."""

from fused_dlrm.data.batching import local_batch_bounds
from fused_dlrm.data.criteo import CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE, CRITEO_SPARSE_FEATURES, CriteoTSV
from fused_dlrm.data.synthetic import SyntheticCriteo

__all__ = [
    "CRITEO_NUM_DENSE",
    "CRITEO_NUM_SPARSE",
    "CRITEO_SPARSE_FEATURES",
    "CriteoTSV",
    "SyntheticCriteo",
    "local_batch_bounds",
]

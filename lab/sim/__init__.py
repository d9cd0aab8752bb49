"""A calibrated performance model of Horovod and FastHorovod (lab/scale.md):
``python -m lab.sim {predict,calibrate,validate,project}``."""
from lab.sim.model import Cluster, Params, Plane, busbw, fasthorovod_allreduce, horovod_allreduce, ring_time

__all__ = ["Cluster", "Params", "Plane", "busbw", "fasthorovod_allreduce", "horovod_allreduce", "ring_time"]

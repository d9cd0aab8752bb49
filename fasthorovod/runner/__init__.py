"""``fasthorovodrun``: horovodrun with FastHorovod's flags and an emulated public-cloud mode.

- ``launch``: the command line. It is Horovod's own ``horovodrun`` parser with one more argument
  group, so every horovodrun flag keeps its meaning; FastHorovod's flags become ``FASTHOROVOD_*``
  variables in the launcher's environment, which Horovod's runner forwards to every rank. Real
  clusters are then run by Horovod's runner itself (Gloo, MPI or jsrun, static or elastic).
- ``emulated``: ``--emulate-cloud HOSTS:LINK:PER_FLOW`` brings up an emulated network
  (``fasthorovod.netem``) whose hosts run sshd, runs the same command line with Horovod's runner
  from the cloud's launcher namespace (ranks start over ssh, static or elastic), and always tears
  the network down.

See docs/runner.md.
"""

from .launch import fasthorovod_env, main, parse_args

__all__ = ["fasthorovod_env", "main", "parse_args"]

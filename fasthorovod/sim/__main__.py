import sys

from fasthorovod.sim.cli import main

sys.exit(main())

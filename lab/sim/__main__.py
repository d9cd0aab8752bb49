import sys

from lab.sim.cli import main

sys.exit(main())

import sys

from phaseserve.benchmark.cli import main

sys.exit(main())

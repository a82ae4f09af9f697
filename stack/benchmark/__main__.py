import sys

from phaseserve.stack.benchmark.cli import main

sys.exit(main())

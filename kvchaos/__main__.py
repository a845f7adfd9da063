import sys

from kvchaos.cli import main

sys.exit(main())

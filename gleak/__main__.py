import sys

from gleak.cli import main

sys.exit(main())

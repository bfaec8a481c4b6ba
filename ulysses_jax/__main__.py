import sys

from ulysses_jax.cli import main

sys.exit(main())

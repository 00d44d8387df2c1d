"""``python -m ciuic``: the command line, as the ``ciuic`` script."""

from .cli import main

main()

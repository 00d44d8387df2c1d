"""``python -m ciuic``: the command line, as the ``ciuic`` script."""

from ciuic.cli import main

main()

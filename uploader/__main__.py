"""``python -m uploader`` is the ``uploader`` command."""
from uploader.cli import main

main()

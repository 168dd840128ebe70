"""``python -m fastinit.restart [-m MODULE | SCRIPT] [ARGS...]``: see ``fastinit/restart``."""

from fastinit.restart.launch import main

main()

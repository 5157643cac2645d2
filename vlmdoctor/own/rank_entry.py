"""What each rank of a launcher's job runs: `torchrun ... -m vlmdoctor.own.rank_entry SCRIPT ARGS` (never typed
by hand; launchers.rank_command writes it). vlmdoctor's bootstrap (child.child_main), then the user's script.

A module of its own: `-m` runs it as `__main__`, and child.py stays one module, imported once by its name.
"""

from __future__ import annotations

from vlmdoctor.own.child import child_main

if __name__ == "__main__":  # one rank of a launcher's job
    child_main()

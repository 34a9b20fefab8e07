"""What the expertpack daemons (storaged, inference serve) share about running as services.

`servicekit.notify`: systemd's notify protocol (READY=1, STATUS=, WATCHDOG=1, STOPPING=1). No
imports of either daemon: both import from here.
"""

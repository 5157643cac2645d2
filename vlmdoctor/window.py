"""The measured window of the user's own training and what it writes, declared once for every way in: `Doctor`
(own/api.py), `DoctorCallback` (own/callback.py), `vlmdoctor run` (own/launch.py, and its flags in commands/run.py);
the traced window's length also for `vlmdoctor profile --trace-steps` (run/capture.py).

A leaf: no import, so the command line reads these defaults without importing torch.
"""

from __future__ import annotations

#: optimizer steps before the timed window (warm-up: allocator, autotuning, compilation settle)
WARMUP = 5
#: timed optimizer steps
STEPS = 20
#: optimizer steps traced with torch.profiler after the timed ones (the profiler's active steps)
TRACE_STEPS = 2
#: the user's traced window: the profiler's schedule waits one step and warms up one before it records
TRACE_WAIT, TRACE_WARMUP = 1, 1
TRACE_LEAD = TRACE_WAIT + TRACE_WARMUP
#: the folder a way in writes its report, page and trace into
OUT = "doctor-out"
#: the report and its page inside that folder
REPORT, HTML = "report.json", "report.html"
#: the longest traced window: a profiler left on for the rest of a long training would fill memory and disk
MAX_TRACE_STEPS = 1000
#: the window's bounds (`Doctor`, `DoctorCallback`, `vlmdoctor run`'s flags): steps, not a resource to exhaust
WINDOW_LIMITS = {"warmup": (0, 10**6), "steps": (1, 10**6), "trace_steps": (0, MAX_TRACE_STEPS)}
